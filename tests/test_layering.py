"""The package map holds: libraries never import the command line; the gateway never
imports the worker.

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
