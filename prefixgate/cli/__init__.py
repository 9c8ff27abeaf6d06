"""The `prefixgate` command: worker, gateway, up, chat, bench, replay, token.

One module per command in this package, each with HELP, DESCRIPTION,
`add_arguments(parser)` and `run(args) -> exit code`. This is the edge where flags become
configuration: each command parses its flags into the frozen dataclasses the libraries
take (WorkerConfig, GatewayStartup, EmulatedWorkerConfig, FleetPlan, ...); no library
imports this package (tests/test_layering.py). flags.py is the one helper that adds
flags, each with an environment-variable equivalent named in its --help line
(PREFIXGATE_<FLAG>; a flag given on the command line wins over the variable); common.py,
limits.py and security.py hold the flag groups several commands share. The gateway-side
commands (gateway, chat, replay) never import torch, and building the parser imports no
command's heavy dependencies.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from prefixgate import __version__
from prefixgate.cli.flags import Parser
from prefixgate.model.catalog import ModelError
from prefixgate.telemetry import logs, tracing
from prefixgate.wire.rpc import BindError

# command -> module in this package, in --help order.
COMMANDS = ("worker", "gateway", "up", "chat", "bench", "replay", "token")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="prefixgate",
                    description="Conversational prefix-cache gateway for LLM serving.")
    parser.add_argument("--version", action="version", version=f"prefixgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"prefixgate.cli.{name}")
        p = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level, getattr(args, "log_format", "text"))
    try:
        tracing.configure(getattr(args, "otel_traces", "off"), f"prefixgate-{args.command}")
        return args._run(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ModelError, BindError, tracing.TracingUnavailable) as exc:  # a user's mistake:
        # a message, not a traceback
        raise SystemExit(f"prefixgate {args.command}: {exc}") from None
