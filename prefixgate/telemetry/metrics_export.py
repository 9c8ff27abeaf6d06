"""Prometheus exposition with a `model_name` label on every prefixgate series.

Gateway and worker metrics are defined once, process-wide, without a model label (each
process serves one model). `ModelLabelled(model_name)` is a collector that re-exposes the
default registry's `prefixgate:*` series with `model_name="<model>"` added, as vLLM labels
its series, so dashboards can tell models apart and join gateway and worker series.
Other series (process_*, python_*) pass through unchanged. No `*_created` series (the
time each counter and histogram child was made, one more series per counter that no
dashboard uses and vLLM does not export either) is exposed. `serve(port, model_name, host)` runs
the standalone /metrics server (`--metrics-port`); `exposition(model_name)` returns the
text the gateway's HTTP front serves at /metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, start_http_server
from prometheus_client.metrics_core import Metric

PREFIX = "prefixgate:"


class ModelLabelled:
    """A collector: the default registry's metrics, `prefixgate:*` ones labelled with the
    model."""

    def __init__(self, model_name: str, source: CollectorRegistry = REGISTRY) -> None:
        self.model_name = model_name
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for metric in self.source.collect():
            samples = [s for s in metric.samples if not s.name.endswith("_created")]
            if metric.name.startswith(PREFIX):
                samples = [s._replace(labels={**s.labels, "model_name": self.model_name})
                           for s in samples]
            metric.samples = samples
            yield metric


_registries: dict[str, CollectorRegistry] = {}


def registry_for(model_name: str) -> CollectorRegistry:
    """A registry exposing the process's metrics labelled with `model_name` (one per name)."""
    if model_name not in _registries:
        reg = _registries[model_name] = CollectorRegistry(auto_describe=False)
        reg.register(ModelLabelled(model_name))
    return _registries[model_name]


def exposition(model_name: str) -> bytes:
    """The Prometheus text format of the process's metrics, labelled with the model."""
    return generate_latest(registry_for(model_name))


def serve(port: int, model_name: str, host: str = "") -> None:
    """Serve /metrics on host:`port` in a background thread (prometheus_client's server;
    port 0: off). `host` is the server's own --host, so a loopback server keeps its
    metrics on loopback too."""
    if not port:
        return
    addr = host or "127.0.0.1"  # every interface only when the server's --host says so
    start_http_server(port, addr=addr, registry=registry_for(model_name))
    logging.getLogger("prefixgate").info("Prometheus metrics on %s:%d/metrics", addr, port)
