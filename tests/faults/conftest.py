"""Fixtures of the fault suite (marker `faults`, applied to this folder by tests/conftest.py).

`fleet`: redis-server, two `prefixgate worker` processes (fw0, fw1; tiny-random) and one
`prefixgate gateway` process on Redis, shared by the tests of one module; a test that kills
or restarts a part puts the fleet back as it found it (two workers listed). A module sets
`FLEET_LOG_LEVEL` to run the fleet at another log level (default WARNING).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prefixgate.launch.redis_server import RedisServer
from tests.faults.fleet import Fleet


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if not RedisServer().available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    f = Fleet(tmp_path_factory.mktemp("fleet"),
              log_level=getattr(request.module, "FLEET_LOG_LEVEL", "WARNING"))
    try:
        f.start_redis()
        f.start_worker("fw0", wait=False)
        f.start_worker("fw1", wait=False)
        f.start_gateway()
        f.wait_workers(2, timeout_s=180)
        yield f
    finally:
        f.stop()
