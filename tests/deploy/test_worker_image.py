"""The worker image declares every port its pod serves (deploy/base/worker.yaml): gRPC,
the plain-text health port the probes ask, and metrics."""

from __future__ import annotations

import yaml

from tests.helpers import REPO


def test_worker_image_exposes_every_port_of_the_worker_container() -> None:
    docs = yaml.safe_load_all((REPO / "deploy" / "base" / "worker.yaml").read_text())
    containers = [c for d in docs if d and d.get("kind") in ("Deployment", "StatefulSet")
                  for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "worker"]
    assert containers, "deploy/base/worker.yaml has a worker container"
    served = {p["containerPort"] for p in containers[0]["ports"]}
    assert {50061, 50062, 9090} <= served
    exposed = {int(port) for line in
               (REPO / "deploy" / "docker" / "Dockerfile.worker").read_text().splitlines()
               if line.startswith("EXPOSE ") for port in line.split()[1:]}
    assert exposed == served, (exposed, served)
