"""A private redis-server on a free loopback port (the emulated fleet, benchmarks, tests).

Contract: `RedisServer(workdir)` finds Debian's `redis-server` (`available()` says whether
it is installed); `start()` launches it without persistence on a port chosen once, at the
first start, and returns when it answers PING (at most `timeout_s`); `stop()` ends it;
`start()` again brings it back, empty, on the same port (a Redis restart). `url` is the
redis:// URL of database 0.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path


class RedisServer:
    def __init__(self, workdir: Path | None = None, timeout_s: float = 10.0) -> None:
        from prefixgate.wire.rpc import free_port

        self.binary = shutil.which("redis-server")
        self.port = free_port()
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="prefixgate-redis-"))
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def available(self) -> bool:
        return self.binary is not None

    def start(self) -> RedisServer:
        import redis

        if self.binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        self.stop()
                        raise
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
