"""Fixtures shared by the end-to-end modules.

`vllm_up`: one `prefixgate up --engine vllm --workers 2` (SmolLM2, 1 GiB of KV cache per
server, the OpenAI front; tests/e2e/test_up_vllm.running_up) for every test that asks for
it, in whichever module: two vLLM CPU servers take over a minute to start on two cores, so
the modules that need the same fleet start it once. A test using it leaves both servers and
the gateway serving, and finds what it needs by its own prompts (its own conversations,
texts and cache keys, and figures taken as differences from before it), never by what
another test cached. A test that ends the fleet (kills a server, stops `up`) is marked
`ends_vllm_up`: the tests using the fleet run one after the other, those marked last (in
their order), and the fleet is stopped as soon as the last of them is done."""

from __future__ import annotations

import contextlib

import pytest

_FIXTURE = "vllm_up"
_ENDS = "ends_vllm_up"


def _uses_fleet(item: pytest.Item | None) -> bool:
    return item is not None and _FIXTURE in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fleet's tests in one run where the first of them was collected: those that
    leave it serving first, then those marked `ends_vllm_up`, each group in collection
    order."""
    users = [i for i in items if _uses_fleet(i)]
    if not users:
        return
    at = sum(1 for i in items[:items.index(users[0])] if not _uses_fleet(i))
    rest = [i for i in items if not _uses_fleet(i)]
    users.sort(key=lambda i: i.get_closest_marker(_ENDS) is not None)  # stable
    items[:] = rest[:at] + users + rest[at:]


class _SharedUp:
    """The running fleet, started on first use. A test that finds `up` gone (exited after
    a test before it) fails: a fleet started again would hide that exit."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.stack: contextlib.ExitStack | None = None
        self.running = None

    def get(self):
        if self.running is not None and self.running[0].poll() is not None:
            pytest.fail(f"the shared `prefixgate up --engine vllm` exited (code "
                        f"{self.running[0].returncode}) after an earlier test", pytrace=False)
        if self.running is None:
            from tests.e2e.test_up_vllm import running_up

            self.stack = contextlib.ExitStack()
            self.running = self.stack.enter_context(running_up(self.tmp_path_factory, 1024))
        return self.running

    def close(self) -> None:
        stack, self.stack, self.running = self.stack, None, None
        if stack is not None:
            stack.close()


_shared: list[_SharedUp] = []


@pytest.fixture(scope="session")
def _vllm_up_fleet(tmp_path_factory: pytest.TempPathFactory):
    shared = _SharedUp(tmp_path_factory)
    _shared.append(shared)
    try:
        yield shared
    finally:
        _shared.remove(shared)
        shared.close()


@pytest.fixture
def vllm_up(_vllm_up_fleet: _SharedUp, smollm2_spec):
    """The shared `up --engine vllm --workers 2`: (its process, its HTTP front's base URL,
    the vLLM servers' HTTP port -> pid)."""
    return _vllm_up_fleet.get()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the fleet after its last test, not at the end of the session: the vLLM
    servers would hold memory and CPU through the tests after it."""
    if _uses_fleet(item) and not _uses_fleet(nextitem):
        for shared in _shared:
            shared.close()
