"""An emulated fleet: N emulated workers and G real gateways on this machine, for replay.

Contract: `async with Fleet(config, workdir) as fleet:` starts (each as its own process,
through the `prefixgate` command, so what runs is exactly what users run)

  * with `config.redis`: a private redis-server (or `config.redis_url`), which workers
    register in and publish KV events to, and gateways discover workers and follow
    events through; without: gateways list the workers (`--worker`) and follow their
    WatchEvents streams;
  * `num_workers` emulated workers (`prefixgate worker --emulate`, emulate/engine.py);
  * `num_gateways` gateways (`prefixgate gateway`) with `gateway_flags` (policy, ...);
    or, with `peer_router` (the command of an HTTP router that takes `--host`, `--port`
    and `--worker-urls URL...`, e.g. sglang-router's launch_router; each `{free_port}` in
    it becomes a free port, per copy), that many copies of it, in front of the workers'
    HTTP endpoints (emulate/http.py);

and returns once every gateway routes to every worker (a peer router: once it answers a
completion). `fleet.gateways` lists the gateway addresses (a peer router's: http:// URLs). On exit every process gets SIGTERM (then SIGKILL after `stop_timeout_s`); the
workers write their served requests, which `fleet.served()` then returns (one dict per
request: worker, prompt_tokens, cached_tokens, queue_s, ttft_s, ... in emulated seconds).
Process logs are in `workdir/*.log`. Gateway and workers serve `emulation_model_dir`'s
model (a real tokenizer with a long context, no weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from prefixgate.emulate.service import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_TRANSFER_BYTES_PER_S,
    ServiceModel,
)
from prefixgate.launch.processes import ProcessExited, ProcessGroup
from prefixgate.wire.rpc import free_port


@dataclass(frozen=True)
class FleetConfig:
    num_workers: int = 8
    num_gateways: int = 1
    capacity_blocks: int = 4000  # per worker
    block_size: int = 512  # tokens (the trace's)
    service: ServiceModel = ServiceModel()  # each worker's speed (emulate/service.py)
    time_scale: float = 1.0  # emulated seconds per wall second
    redis: bool = False
    redis_url: str = ""  # use this Redis instead of a private one (implies redis)
    model: str = "smollm2-135m"  # whose tokenizer the fleet serves
    max_context_tokens: int = 1 << 18
    gateway_flags: tuple[str, ...] = ()
    peer_router: tuple[str, ...] = ()  # an HTTP router's command instead of gateways
    publish_at: str = "prefill"  # the workers' --publish-at
    # The workers' block transfer: link bytes per emulated second, KV bytes per token of
    # the emulated model (emulate/transfer.py); 0 for either: no transfers.
    transfer_bytes_per_s: float = DEFAULT_TRANSFER_BYTES_PER_S
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    cache_dir: str = ""
    startup_timeout_s: float = 60.0
    stop_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.num_gateways < 1:
            raise ValueError("a fleet needs at least one worker and one gateway")


class Fleet:
    def __init__(self, config: FleetConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = Path(workdir)
        self.gateways: list[str] = []
        self.workers: list[str] = []
        self.http_workers: list[str] = []  # with a peer router: the workers' HTTP URLs
        self.redis_url = config.redis_url
        self._group: ProcessGroup | None = None
        self._redis = None
        self._records: list[Path] = []

    async def __aenter__(self) -> Fleet:
        from prefixgate.emulate.model import emulation_model_dir

        cfg = self.config
        self.workdir.mkdir(parents=True, exist_ok=True)
        cache = Path(cfg.cache_dir) if cfg.cache_dir else None
        model = str(await asyncio.to_thread(emulation_model_dir, cfg.model,
                                            cfg.max_context_tokens, cache))
        common = ["--model", model, "--block-size", str(cfg.block_size), "--log-level", "WARNING"]
        if cfg.cache_dir:
            common += ["--cache-dir", cfg.cache_dir]
        # Token traces carry prompts up to the context: raise the request limits to it.
        limits = ["--max-prompt-tokens", str(cfg.max_context_tokens),
                  "--max-request-bytes", str(4 * cfg.max_context_tokens + (1 << 16))]
        # The fleet's flags are explicit (a user's PREFIXGATE_* variables must not leak
        # in); its own session: a Ctrl-C reaches the fleet through stop(), in order.
        group = self._group = ProcessGroup(self.workdir, scrub_env=True, new_session=True)
        try:
            if (cfg.redis or cfg.redis_url) and not self.redis_url:
                from prefixgate.launch.redis_server import RedisServer

                self._redis = RedisServer(self.workdir / "redis")
                (self.workdir / "redis").mkdir(exist_ok=True)
                await asyncio.to_thread(self._redis.start)
                self.redis_url = self._redis.url
            for i in range(cfg.num_workers):
                port = free_port()
                records = self.workdir / f"worker-{i}.served.jsonl"
                self._records.append(records)
                args = ["worker", "--emulate", *common, *limits,
                        "--port", str(port),
                        "--worker-id", f"worker-{i}", "--num-blocks", str(cfg.capacity_blocks),
                        "--prefill-tokens-per-s", str(cfg.service.prefill_tokens_per_s),
                        "--decode-s-per-token", str(cfg.service.decode_s_per_token),
                        "--time-scale", str(cfg.time_scale), "--emulate-records", str(records),
                        "--publish-at", cfg.publish_at,
                        "--transfer-bytes-per-s", str(cfg.transfer_bytes_per_s),
                        "--kv-bytes-per-token", str(cfg.kv_bytes_per_token),
                        "--drain-seconds", "1"]
                if cfg.peer_router:
                    http_port = free_port()
                    args += ["--http-port", str(http_port)]
                    self.http_workers.append(f"http://127.0.0.1:{http_port}")
                if self.redis_url:
                    args += ["--redis-url", self.redis_url, "--lease-ms", "5000"]
                group.start_prefixgate(f"worker-{i}", *args)
                self.workers.append(f"127.0.0.1:{port}")
            for i in range(cfg.num_gateways if not cfg.peer_router else 0):
                port = free_port()
                args = ["gateway", *common, *limits, "--port", str(port),
                        "--drain-seconds", "1",
                        *cfg.gateway_flags]
                if self.redis_url:
                    args += ["--redis-url", self.redis_url]
                else:
                    args += ["--worker", ",".join(self.workers)]
                group.start_prefixgate(f"gateway-{i}", *args)
                self.gateways.append(f"127.0.0.1:{port}")
            for i in range(cfg.num_gateways if cfg.peer_router else 0):
                port = free_port()
                command = [a.replace("{free_port}", str(free_port())) if "{free_port}" in a
                           else a for a in cfg.peer_router]
                group.start(f"router-{i}", [
                    *command, "--host", "127.0.0.1", "--port", str(port),
                    "--worker-urls", *self.http_workers])
                self.gateways.append(f"http://127.0.0.1:{port}")
            await (self._wait_peer_routers() if cfg.peer_router else self._wait_routing())
        except BaseException:
            await self.stop()
            raise
        return self

    async def _wait_routing(self) -> None:
        """Until every gateway lists every worker as routable."""
        from prefixgate.wire.client import ChatClient

        deadline = time.monotonic() + self.config.startup_timeout_s
        for address in self.gateways:
            client = ChatClient(address)
            try:
                while True:
                    self._check_alive()
                    with contextlib.suppress(Exception):
                        models = await client.list_models(timeout_s=2)
                        if models.models[0].num_workers >= self.config.num_workers:
                            break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"fleet: gateway {address} did not see "
                                           f"{self.config.num_workers} workers in time "
                                           f"(logs in {self.workdir})")
                    await asyncio.sleep(0.2)
            finally:
                await client.close()

    async def _wait_peer_routers(self) -> None:
        """Until every peer router answers a one-token completion."""
        import httpx

        deadline = time.monotonic() + self.config.startup_timeout_s
        async with httpx.AsyncClient(timeout=5) as http:
            for url in self.gateways:
                while True:
                    self._check_alive()
                    with contextlib.suppress(httpx.HTTPError, ValueError, LookupError):
                        # The model by name: smg 1.13 routes "" to no worker.
                        model = (await http.get(url + "/v1/models")).json()["data"][0]["id"]
                        r = await http.post(url + "/v1/completions",
                                            json={"model": model, "prompt": "300",
                                                  "max_tokens": 1})
                        if r.status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"fleet: router {url} did not answer in time "
                                           f"(logs in {self.workdir})")
                    await asyncio.sleep(0.5)

    def _check_alive(self) -> None:
        assert self._group is not None
        try:
            self._group.check_alive()
        except ProcessExited as exc:
            raise RuntimeError(f"fleet: {exc}") from None

    async def stop(self) -> None:
        """SIGTERM every process (gateways first), wait, SIGKILL the stragglers."""
        if self._group is not None:
            await asyncio.to_thread(self._group.stop, self.config.stop_timeout_s,
                                    ("gateway", "router"))
        if self._redis is not None:
            await asyncio.to_thread(self._redis.stop)
            self._redis = None

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ------------------------------------------------------------------ results

    def served(self) -> list[dict]:
        """Every request the workers finished (after the fleet stopped), but the peer
        routers' one-token readiness probes."""
        out = []
        for path in self._records:
            if path.is_file():
                out += [json.loads(line) for line in path.read_text().splitlines() if line]
        if self.config.peer_router:
            out = [r for r in out if r["prompt_tokens"] > 1]
        return out
