"""The committed stubs in prefixgate/v1 must equal what scripts/gen_proto.py generates."""

import importlib.util
import sys
from pathlib import Path

from tests.helpers import REPO


def test_stubs_are_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = gen
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    committed = sorted(p.relative_to(REPO) for p in (REPO / "prefixgate" / "v1").glob("*_pb2*"))
    assert generated == committed, "stub files differ: run python scripts/gen_proto.py"
    for rel in generated:
        assert (tmp_path / rel).read_bytes() == (REPO / rel).read_bytes(), (
            f"{rel} is stale: run python scripts/gen_proto.py and commit the result")


def test_stubs_import_without_path_tricks() -> None:
    from prefixgate.v1 import chat_pb2, chat_pb2_grpc, worker_pb2_grpc  # noqa: F401

    assert chat_pb2.DESCRIPTOR.package == "prefixgate.v1"
