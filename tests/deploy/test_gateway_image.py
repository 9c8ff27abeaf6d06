"""The gateway image declares every port its pod serves (deploy/base/gateway.yaml): gRPC,
the OpenAI-compatible HTTP API, the plain-text health port and metrics."""

from __future__ import annotations

import yaml

from tests.helpers import REPO


def test_gateway_image_exposes_every_port_of_the_gateway_container() -> None:
    docs = yaml.safe_load_all((REPO / "deploy" / "base" / "gateway.yaml").read_text())
    (container,) = [c for d in docs if d and d.get("kind") == "Deployment"
                    for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    served = {p["containerPort"] for p in container["ports"]}
    assert {50051, 8000, 50052, 9090} <= served
    exposed = {int(port) for line in
               (REPO / "deploy" / "docker" / "Dockerfile.gateway").read_text().splitlines()
               if line.startswith("EXPOSE ") for port in line.split()[1:]}
    assert exposed == served, (exposed, served)
