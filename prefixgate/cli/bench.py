"""`prefixgate bench NAME`: the benchmarks of prefixgate/bench (one JSON document each).

Benchmark modules import only the standard library at top level (heavy imports live in
their run()), so building this parser stays cheap and torch-free.

Unlike the serving commands, bench flags have no PREFIXGATE_* variables (plain
`add_argument`, not `cli.flags.flag`): many share names with serving flags (--workers,
--weights, --block-size), and a benchmark must measure what its command line says, not
what an environment exported for `prefixgate up` sets.
"""

from __future__ import annotations

import argparse
import json

from prefixgate.cli.common import log_flags

HELP = "benchmarks (prints JSON with --json)"
DESCRIPTION = "Run a benchmark; with --json, one JSON document on stdout."


def add_arguments(b: argparse.ArgumentParser) -> None:
    from prefixgate.bench import BENCHMARKS, load

    bsub = b.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name in BENCHMARKS:
        module = load(name)
        bp = bsub.add_parser(name, help=summary(module.__doc__ or name),
                             description=module.__doc__)
        log_flags(bp)
        bp.add_argument("--json", action="store_true", help="print one JSON document on stdout")
        module.add_arguments(bp)
        bp.set_defaults(_bench_run=module.run)


def summary(doc: str) -> str:
    """A benchmark's one-line help: its docstring's first paragraph (a sentence may run
    over several lines; the first line alone stopped some mid-sentence)."""
    return " ".join(doc.strip().split("\n\n", 1)[0].split())


def run(args: argparse.Namespace) -> int:
    result = args._bench_run(args)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
