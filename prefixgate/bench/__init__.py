"""Benchmarks behind `prefixgate bench NAME`.

Each benchmark is a module in this package that defines

    add_arguments(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace) -> dict

`run` returns one JSON-serialisable document; the CLI prints it (with `--json`, as
one JSON document on stdout; progress and logs go to stderr). Benchmarks compare
against a baseline measured in the same run wherever a target is a ratio.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# name -> module path; the module is imported only when that benchmark runs.
BENCHMARKS: dict[str, str] = {
    "radix": "prefixgate.bench.radix",
    "router": "prefixgate.bench.router",
    "overflow": "prefixgate.bench.overflow",
    "reindex": "prefixgate.bench.reindex",
    "worker": "prefixgate.bench.worker",
    "http": "prefixgate.bench.http",
    "gateway": "prefixgate.bench.gateway",
    "gpu": "prefixgate.bench.gpu",
    "transfer": "prefixgate.bench.transfer",
    "engines": "prefixgate.bench.engines",
    "vllm-transfer": "prefixgate.bench.vllm_transfer",
    "vllm-overflow": "prefixgate.bench.vllm_overflow",
}


def load(name: str) -> ModuleType:
    """Import the benchmark module registered under `name`."""
    return importlib.import_module(BENCHMARKS[name])
