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
import subprocess
import sys
from collections.abc import Callable
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
# The torch engine, the torch-free Worker API it implements, and the other engines that
# build on that API alone.
TORCH_ENGINE = "prefixgate.worker"
WORKER_API = "prefixgate.workerapi"
ENGINES = ("prefixgate.engines", "prefixgate.emulate")


def _gateway_file(name: str) -> Path:
    return PACKAGE / "gateway" / f"{name}.py"


def front_imports_of_fronts() -> list[str]:
    """Imports of one front by the other."""
    return [line for front in FRONTS for other in FRONTS if other != front
            for line in imports_of(f"{GATEWAY}.{other}", [_gateway_file(front)])]


def transport_imports_of_turn_code() -> list[str]:
    return [line for target in TRANSPORTS
            for line in imports_of(target, [_gateway_file(m) for m in TURN_CODE])]


def import_graph() -> dict[str, dict[str, int]]:
    """Every module of the package: the modules its imports load, each with the line of
    the first such import. A name imported from a module resolves to that module, a
    module to it and its parent packages (whose __init__ runs first); a name outside the
    package to its top-level package (`torch.nn` -> `torch`)."""
    mods = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        loads: dict[str, int] = {}
        for line, name in _imports(path):
            if name.split(".")[0] != PACKAGE.name:
                loads.setdefault(name.split(".")[0], line)
                continue
            while name and name not in mods:
                name = name.rpartition(".")[0]
            while name:
                loads.setdefault(name, line)
                name = name.rpartition(".")[0]
        loads.pop(mod, None)
        graph[mod] = loads
    return graph


def chains_from(package: str, bad: Callable[[str], bool]) -> list[str]:
    """For each module that importing `package`'s modules reaches (directly or through
    any other module) and `bad` names: one shortest chain of imports to it, each step
    `file:line imports module`. A package loaded only as the parent of a bad module the
    same import loads is not named apart."""
    graph = import_graph()
    starts = sorted(m for m in graph if m == package or m.startswith(package + "."))
    via: dict[str, str | None] = dict.fromkeys(starts)
    queue = list(starts)
    found = []
    for mod in queue:  # breadth first: the chains found are shortest
        if bad(mod):
            found.append(mod)
            continue
        for dep in graph.get(mod, {}):
            if dep not in via:
                via[dep] = mod
                queue.append(dep)

    def step(importer: str, mod: str) -> tuple[str, int]:
        return importer, graph[importer][mod]

    found = [m for m in found if via[m] is None or not any(
        other.startswith(m + ".") and via[other] is not None
        and step(via[other], other) == step(via[m], m) for other in found)]
    chains = []
    for target in found:
        steps, mod = [], target
        while (importer := via[mod]) is not None:
            path = PACKAGE.parent / Path(*importer.split("."))
            path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            steps.append(f"{path.relative_to(PACKAGE.parent)}:{graph[importer][mod]} imports {mod}")
            mod = importer
        chains.append(" -> ".join(reversed(steps)) if steps else f"{target} is one")
    return chains


def torch_engine(name: str) -> bool:
    """torch, triton, or a module of the torch engine (worker/)."""
    return name in TORCH or name == TORCH_ENGINE or name.startswith(TORCH_ENGINE + ".")


def torch_reached_by_workerapi() -> list[str]:
    return chains_from(WORKER_API, torch_engine)


def torch_engine_reached_by_engines() -> list[str]:
    """engines/ and emulate/ importing the torch engine, directly or through another
    module (torch itself: tests/test_models.py imports them and checks it stays out)."""
    return [chain for pkg in ENGINES for chain in chains_from(
        pkg, lambda m: m == TORCH_ENGINE or m.startswith(TORCH_ENGINE + "."))]


def test_a_front_imports_nothing_of_the_other() -> None:
    """gRPC (gateway/grpc_front.py) and HTTP (gateway/http.py) each hold the turn core;
    gateway/server.py assembles them."""
    bad = front_imports_of_fronts()
    assert not bad, "\n".join(bad)


def test_the_turn_code_imports_no_transport() -> None:
    """turn.py, placement.py and resume.py: no front, no server framework."""
    bad = transport_imports_of_turn_code()
    assert not bad, "\n".join(bad)


def test_the_worker_api_imports_neither_torch_nor_the_torch_engine() -> None:
    """workerapi/ (the Engine contract, the Worker service, events, the transfer wire)
    is what every engine builds on: no module of it, nor any module it imports at any
    depth (lazily or for type checking alike), imports torch, triton or worker/."""
    bad = torch_reached_by_workerapi()
    assert not bad, "\n".join(bad)


def test_the_worker_api_loads_no_torch() -> None:
    """The same, as Python sees it: importing every workerapi module in a fresh
    interpreter loads neither torch nor any module of the torch engine."""
    mods = sorted(_module_name(p) for p in (PACKAGE / "workerapi").rglob("*.py"))
    code = (f"import sys\nfor m in {mods!r}:\n    __import__(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')"
            " or m == 'prefixgate.worker' or m.startswith('prefixgate.worker.')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=PACKAGE.parent).stdout
    assert out.strip() == "[]", f"importing {WORKER_API} loaded: {out}"


def test_engines_build_on_the_worker_api_alone() -> None:
    """engines/ and emulate/ build on the torch-free Worker API (workerapi/), never on
    the torch engine (worker/), directly or through another module."""
    bad = torch_engine_reached_by_engines()
    assert not bad, "\n".join(bad)


def test_the_new_checks_fail_on_a_bad_import(tmp_path, monkeypatch) -> None:
    """Each check above can fail: a front importing the other (lazily), turn code
    importing a front or aiohttp, the Worker API importing the torch engine (for type
    checking) or torch (lazily, two modules away), an emulated worker importing the
    torch engine (lazily)."""
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
    for d in ("workerapi", "launch", "model"):
        (pkg / d).mkdir()
        (pkg / d / "__init__.py").write_text("")
    (pkg / "workerapi" / "api.py").write_text("import dataclasses\n")
    (pkg / "workerapi" / "metrics.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from prefixgate.worker.engine import EngineStatus\n")
    (pkg / "workerapi" / "server.py").write_text(
        "from prefixgate.workerapi.api import Engine\n\n\ndef f():\n"
        "    from prefixgate.launch import serving\n")
    (pkg / "launch" / "serving.py").write_text("from prefixgate.model import tokenizer\n")
    (pkg / "model" / "tokenizer.py").write_text("import torch.nn\n")
    (pkg / "engines" / "vllm.py").write_text(
        "from prefixgate.workerapi.api import Engine\nfrom prefixgate.launch import serving\n")
    (pkg / "emulate" / "worker.py").write_text(
        "def f():\n    from prefixgate.worker.engine import PagedEngine\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    assert front_imports_of_fronts() == [
        "prefixgate/gateway/grpc_front.py:2 imports prefixgate.gateway.http",
        "prefixgate/gateway/grpc_front.py:2 imports prefixgate.gateway.http.HTTPFront"]
    assert transport_imports_of_turn_code() == [
        "prefixgate/gateway/turn.py:2 imports prefixgate.gateway.grpc_front",
        "prefixgate/gateway/placement.py:1 imports aiohttp",
        "prefixgate/gateway/placement.py:1 imports aiohttp.web"]
    assert torch_reached_by_workerapi() == [
        "prefixgate/workerapi/metrics.py:3 imports prefixgate.worker.engine",
        "prefixgate/workerapi/server.py:5 imports prefixgate.launch.serving"
        " -> prefixgate/launch/serving.py:1 imports prefixgate.model.tokenizer"
        " -> prefixgate/model/tokenizer.py:1 imports torch"]
    # engines/vllm.py reaches torch too, through launch/ and model/: not the torch engine.
    assert torch_engine_reached_by_engines() == [
        "prefixgate/emulate/worker.py:2 imports prefixgate.worker.engine"]


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


def _load_time_imports(path: Path, modules: set[str]) -> set[str]:
    """The prefixgate modules `path` imports at module level: inside top-level if/try
    too, `if TYPE_CHECKING:` included (a type is part of the contract), never in a
    function (a lazy import is a run-time choice, not a layer). `from package import
    submodule` is an import of the submodule alone."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                out.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{alias.name}" for alias in node.names]
                subs = [n for n in names if n in modules]
                out.update(subs if len(subs) == len(names) else [base, *subs])

    visit(ast.parse(path.read_text(), str(path)).body)
    return {m for m in out if m in modules and m != module}


def import_cycles() -> list[list[str]]:
    """Groups of prefixgate modules that import each other at module level (strongly
    connected components of more than one module)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _load_time_imports(p, set(paths)) for m, p in paths.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in order:
            connect(v)
    return cycles


def test_no_modules_import_each_other() -> None:
    """The gateway's old circle (http -> server -> turn -> server's config) is gone, and
    no module of the package is in a module-level import cycle: each module's contract
    can be read knowing only what it imports."""
    assert import_cycles() == []


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "prefixgate"
    (pkg / "gateway").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "gateway" / "__init__.py").write_text("")
    (pkg / "gateway" / "http.py").write_text("from prefixgate.gateway.server import serve\n")
    (pkg / "gateway" / "server.py").write_text("from prefixgate.gateway import turn\n")
    (pkg / "gateway" / "turn.py").write_text(
        "def f():\n    from prefixgate.gateway.http import x\n")  # lazy: no cycle
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    assert import_cycles() == []
    (pkg / "gateway" / "turn.py").write_text(  # a type-only import closes it too
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from prefixgate.gateway.http import x\n")
    assert import_cycles() == [["prefixgate.gateway.http", "prefixgate.gateway.server",
                                "prefixgate.gateway.turn"]]
