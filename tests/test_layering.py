"""The package map holds: libraries never import the command line; the gateway never
imports the worker; the gateway's two fronts know nothing of each other and its turn code
nothing of either (or of any server framework); engines build on the Worker API, never on
the torch engine.

`prefixgate/cli/` is the edge where flags become configuration (frozen dataclasses) that
the libraries take; a library importing it would make the CLI a dependency of the
libraries and let argparse state leak into them. Every import statement of every module
outside cli/ is read (top level and inside functions alike, from the source, so a lazy
import in a rarely taken branch counts too); `prefixgate/__main__.py` is the CLI's own
entry point.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "prefixgate"
ENTRY_POINTS = {PACKAGE / "__main__.py"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else \
        _module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def imports_of(target: str, sources: list[Path]) -> list[str]:
    """file:line imports NAME, for every import of `target` (a package) in `sources`."""
    bad = []
    for path in sources:
        for line, name in _imports(path):
            if name == target or name.startswith(target + "."):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    return bad


def cli_imports_outside_cli() -> list[str]:
    return imports_of("prefixgate.cli", [
        p for p in sorted(PACKAGE.rglob("*.py"))
        if p not in ENTRY_POINTS and (PACKAGE / "cli") not in p.parents])


def test_no_module_outside_cli_imports_cli() -> None:
    bad = cli_imports_outside_cli()
    assert not bad, ("libraries must not import the command line (take a config "
                     "dataclass instead):\n" + "\n".join(bad))


def test_the_gateway_imports_nothing_of_the_worker() -> None:
    """The gateway shares only torch-free packages with the worker (wire, model, radix,
    registry, security); worker/ is the model runner's side."""
    bad = imports_of("prefixgate.worker", sorted((PACKAGE / "gateway").rglob("*.py")))
    assert not bad, "\n".join(bad)


def test_the_wire_contract_is_the_bottom_layer() -> None:
    """wire/ (messages, gRPC plumbing, events) imports only the generated stubs and radix/:
    security/, the gateway and the worker build on it, never the other way round."""
    allowed = ("prefixgate.wire", "prefixgate.v1", "prefixgate.radix")
    bad = [line for line in imports_of("prefixgate", sorted((PACKAGE / "wire").rglob("*.py")))
           if not any(line.endswith(f" imports {a}") or f" imports {a}." in line
                      for a in allowed)]
    assert not bad, "\n".join(bad)


GATEWAY = "prefixgate.gateway"
# The gateway's fronts: each holds the turn core and speaks one wire.
FRONTS = ("grpc_front", "http")
# The turn path: no front, no server framework. (The worker seam is a gRPC stub, so the
# grpc package itself is allowed: its status codes are read there into Failure kinds.)
TURN_CODE = ("turn", "placement", "resume")
TRANSPORTS = (*(f"{GATEWAY}.{m}" for m in (*FRONTS, "server", "startup", "processes")),
              "prefixgate.wire.rpc", "aiohttp", "grpc_health", "grpc_reflection")
TORCH = ("torch", "triton")


def _gateway_file(name: str) -> Path:
    return PACKAGE / "gateway" / f"{name}.py"


def front_imports_of_fronts() -> list[str]:
    """Imports of one front by the other."""
    return [line for front in FRONTS for other in FRONTS if other != front
            for line in imports_of(f"{GATEWAY}.{other}", [_gateway_file(front)])]


def transport_imports_of_turn_code() -> list[str]:
    return [line for target in TRANSPORTS
            for line in imports_of(target, [_gateway_file(m) for m in TURN_CODE])]


def torch_engine_modules() -> set[str]:
    """Modules of worker/ that import torch (or triton), or such a module, at any depth:
    the torch engine. The rest of worker/ is the Worker API service the engines build on."""
    mods = {_module_name(p): p for p in sorted((PACKAGE / "worker").rglob("*.py"))}
    imported = {m: {name for _, name in _imports(p)} for m, p in mods.items()}
    torchy = {m for m, names in imported.items()
              if any(n == t or n.startswith(t + ".") for n in names for t in TORCH)}
    grown = True
    while grown:
        grown = False
        for m, names in imported.items():
            if m not in torchy and names & torchy:
                torchy.add(m)
                grown = True
    return torchy


def torch_engine_imports_of_engines() -> list[str]:
    sources = sorted([*(PACKAGE / "engines").rglob("*.py"), *(PACKAGE / "emulate").rglob("*.py")])
    torchy = torch_engine_modules()
    return [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
            for path in sources for line, name in _imports(path) if name in torchy]


def test_a_front_imports_nothing_of_the_other() -> None:
    """gRPC (gateway/grpc_front.py) and HTTP (gateway/http.py) each hold the turn core;
    gateway/server.py assembles them."""
    bad = front_imports_of_fronts()
    assert not bad, "\n".join(bad)


def test_the_turn_code_imports_no_transport() -> None:
    """turn.py, placement.py and resume.py: no front, no server framework."""
    bad = transport_imports_of_turn_code()
    assert not bad, "\n".join(bad)


def test_engines_do_not_import_the_torch_engine() -> None:
    """engines/ and emulate/ build on the torch-free Worker API (worker/api.py, server.py,
    transfer.py, ...), never on the torch engine."""
    assert "prefixgate.worker.engine" in torch_engine_modules()
    bad = torch_engine_imports_of_engines()
    assert not bad, "\n".join(bad)


def test_the_new_checks_fail_on_a_bad_import(tmp_path, monkeypatch) -> None:
    """Each check above can fail: a front importing the other (lazily), turn code
    importing a front or aiohttp, an engine importing a worker module that imports one
    that imports torch."""
    pkg = tmp_path / "prefixgate"
    for d in ("gateway", "worker", "engines", "emulate"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    gw = pkg / "gateway"
    (gw / "grpc_front.py").write_text("def f():\n    from prefixgate.gateway.http import HTTPFront\n")
    (gw / "http.py").write_text("from prefixgate.gateway import turn\n")
    (gw / "turn.py").write_text("import grpc\nfrom . import grpc_front\n")
    (gw / "placement.py").write_text("from aiohttp import web\n")
    (gw / "resume.py").write_text("from prefixgate.gateway.placement import Placer\n")
    (pkg / "worker" / "kernels.py").write_text("import torch\n")
    (pkg / "worker" / "engine.py").write_text("from prefixgate.worker import kernels\n")
    (pkg / "worker" / "api.py").write_text("import dataclasses\n")
    (pkg / "engines" / "vllm.py").write_text(
        "from prefixgate.worker.api import Engine\nfrom prefixgate.worker.engine import X\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    assert front_imports_of_fronts() == [
        "prefixgate/gateway/grpc_front.py:2 imports prefixgate.gateway.http",
        "prefixgate/gateway/grpc_front.py:2 imports prefixgate.gateway.http.HTTPFront"]
    assert transport_imports_of_turn_code() == [
        "prefixgate/gateway/turn.py:2 imports prefixgate.gateway.grpc_front",
        "prefixgate/gateway/placement.py:1 imports aiohttp",
        "prefixgate/gateway/placement.py:1 imports aiohttp.web"]
    assert torch_engine_modules() == {"prefixgate.worker.kernels", "prefixgate.worker.engine"}
    assert torch_engine_imports_of_engines() == [
        "prefixgate/engines/vllm.py:2 imports prefixgate.worker.engine"]


def test_the_check_sees_lazy_and_relative_imports(tmp_path, monkeypatch) -> None:
    """The check itself can fail: a function-level and a relative import of cli/ count."""
    pkg = tmp_path / "prefixgate"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "emulate").mkdir()
    for d in (pkg, pkg / "cli", pkg / "emulate"):
        (d / "__init__.py").write_text("")
    (pkg / "cli" / "flags.py").write_text("")
    (pkg / "emulate" / "lazy.py").write_text("def f():\n    from prefixgate.cli.flags import x\n")
    (pkg / "emulate" / "rel.py").write_text("from ..cli import flags\n")
    (pkg / "emulate" / "fine.py").write_text("from . import lazy\nimport prefixgate.radix\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    monkeypatch.setattr(sys.modules[__name__], "ENTRY_POINTS", set())
    assert cli_imports_outside_cli() == [
        "prefixgate/emulate/lazy.py:2 imports prefixgate.cli.flags",
        "prefixgate/emulate/lazy.py:2 imports prefixgate.cli.flags.x",
        "prefixgate/emulate/rel.py:1 imports prefixgate.cli",
        "prefixgate/emulate/rel.py:1 imports prefixgate.cli.flags",
    ]
