"""Shared fixtures and the suite's environment and markers.

Environment: set here, before any test module imports torch or triton
(`TRITON_INTERPRET=1`, so Triton kernels run in the interpreter on the CPU).

Markers (declared in pyproject.toml) are applied from what a test uses, so they cannot
drift from the truth:
- `slow`: it loads the real SmolLM2 model (a `smollm2_*` fixture) or runs the CLI;
- `redis`: it needs a real redis-server (`redis_url`, `redis_flush`, `own_redis`);
- `integration`: it talks real gRPC on loopback or runs processes (`loop_thread`, e2e/);
- `faults`: the fault suite (everything under tests/faults/).
`bash scripts/test.sh -m "not slow and not faults"` is the quick loop.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from prefixgate.launch.redis_server import RedisServer  # noqa: E402
from prefixgate.model.catalog import ModelSpec, resolve_model  # noqa: E402
from tests.helpers import ENGINES, LoopThread  # noqa: E402

_SLOW_FIXTURES = {"smollm2_spec", "smollm2_model"}
_REDIS_FIXTURES = {"redis_url", "redis_flush", "own_redis"}
_INTEGRATION_FIXTURES = {"loop_thread"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        path = Path(str(item.fspath))
        if used & _SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)
        if used & _REDIS_FIXTURES:
            item.add_marker(pytest.mark.redis)
        if used & (_INTEGRATION_FIXTURES | _REDIS_FIXTURES) or "e2e" in path.parts:
            item.add_marker(pytest.mark.integration)
        if "e2e" in path.parts:
            item.add_marker(pytest.mark.slow)
        if "faults" in path.parts:
            item.add_marker(pytest.mark.faults)

@pytest.fixture(autouse=True)
def engine_integrity() -> Iterator[None]:
    """After every test, each engine it made (tests.helpers.make_engine/track) must
    account for every KV block: pool references = prefix cache + block tables."""
    ENGINES.clear()
    yield
    engines = list(ENGINES)
    ENGINES.clear()
    for engine in engines:
        engine.check_integrity()


@pytest.fixture(autouse=True)
def command_logging_undone() -> Iterator[None]:
    """A command run in-process (prefixgate.cli.main) installs prefixgate's stderr log
    handler (prefixgate/telemetry/logs.py); remove it after the test, so that background threads of
    session fixtures do not log to the terminal between tests."""
    import logging

    from prefixgate.telemetry.logs import StderrHandler

    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if isinstance(h, StderrHandler) and h not in before:
            root.removeHandler(h)
    root.setLevel(level)


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="session")
def tiny_spec(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    return resolve_model("tiny-random", tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tiny_model(tiny_spec: ModelSpec):
    from prefixgate.worker.model_loader import load_model

    return load_model(tiny_spec)


@pytest.fixture
def tiny_reference_model(tiny_spec: ModelSpec):
    """A private tiny-random model for plain transformers forwards (engines switch the
    shared one to paged attention)."""
    from prefixgate.worker.model_loader import load_model

    return load_model(tiny_spec)


@pytest.fixture(scope="session")
def smollm2_spec() -> ModelSpec:
    """SmolLM2 in the default cache (materialised once per machine, by GGUF digest)."""
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_model(smollm2_spec: ModelSpec):
    """SmolLM2-135M-Instruct, loaded once per test session."""
    from prefixgate.worker.model_loader import load_model

    return load_model(smollm2_spec)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port, for the whole session."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    if not server.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    yield server.start().url
    server.stop()


@pytest.fixture
def redis_flush(redis_url: str) -> str:
    import redis

    redis.Redis.from_url(redis_url).flushall()
    return redis_url


@pytest.fixture
def own_redis(tmp_path: Path):
    """A private redis-server this test may stop and start again (same port, empty after a
    restart): yields (url, start, stop)."""
    server = RedisServer(tmp_path)
    if not server.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server.start()
    yield server.url, server.start, server.stop
    server.stop()
