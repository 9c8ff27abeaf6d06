"""`prefixgate bench gateway`: the latency the gateway adds to a turn, idle and under a burst.

One emulated worker (`prefixgate worker --emulate`: the real WorkerService, no model,
prefill and decode made instant so the worker's own time is only its gRPC and cache work)
serves every request. Each request is timed at the client from sending to the end of its
stream (one output token), in two ways against that same worker over real gRPC:

* direct: client -> worker `Generate` with the packed prompt (the baseline);
* gateway: client -> `prefixgate gateway --processes N` `Chat` with the same packed form
  -> worker (validation, block hashing, routing, request building, relaying).

added = gateway latency - direct latency, per quantile (p50, p99), for prompts of 1k and
12k tokens (fresh random ids each request: no cache effects), in two traffic shapes:
idle (one request at a time) and burst (`--burst` requests, default 30, sent at once,
each on its own connection, so that N processes can share them; latency counted from
the burst's start). The gateway runs as 1 and as N processes (`--processes`). Both paths
share the client and the worker, so their costs cancel out of `added`; `queueing` is the
burst's added p50 minus the idle one (what the burst makes a request wait in the gateway).

Targets (issue 11): added p50 <= 1 ms at 12k-token prompts under the burst, and no queueing
behind a burst (queueing p50 <= 1 ms). The load average is reported beside the figures:
on a shared machine they are only comparable within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

TARGETS = {"added_p50_ms_12k_burst": 1.0, "queueing_p50_ms_12k": 1.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help="tokenizer the emulated fleet serves (its vocabulary bounds the ids)")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2],
                        help="gateway process counts to compare")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 12288])
    parser.add_argument("--burst", type=int, default=30, help="simultaneous requests per burst")
    parser.add_argument("--bursts", type=int, default=20, help="bursts per configuration")
    parser.add_argument("--idle", type=int, default=200,
                        help="one-at-a-time requests per configuration")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)


def _quantiles(samples: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50": round(qs[49] * 1e3, 3), "p99": round(qs[98] * 1e3, 3), "n": len(samples)}


class _Client:
    """`burst` independent connections to one address (gRPC would otherwise share one
    connection between channels to the same target, and one connection is one process)."""

    def __init__(self, address: str, burst: int, gateway: bool) -> None:
        import grpc

        from prefixgate.v1 import chat_pb2_grpc, worker_pb2_grpc

        opts = [("grpc.use_local_subchannel_pool", 1),
                ("grpc.max_send_message_length", 64 << 20)]
        self.channels = [grpc.aio.insecure_channel(address, options=opts) for _ in range(burst)]
        self.gateway = gateway
        self.stubs = [(chat_pb2_grpc.ChatServiceStub if gateway else
                       worker_pb2_grpc.WorkerServiceStub)(ch) for ch in self.channels]

    def request(self, data: bytes):
        from prefixgate.v1 import chat_pb2, common_pb2, worker_pb2

        sampling = common_pb2.SamplingParams(max_tokens=1)
        if self.gateway:
            return chat_pb2.ChatRequest(packed_prompt_token_ids=data, sampling=sampling)
        return worker_pb2.GenerateRequest(packed_prompt_token_ids=data, sampling=sampling)

    async def one(self, i: int, request, t0: float | None = None) -> float:
        """Seconds from `t0` (default: now) until request's stream ended on connection i."""
        stub = self.stubs[i % len(self.stubs)]
        call = stub.Chat if self.gateway else stub.Generate
        t0 = time.perf_counter() if t0 is None else t0
        async for _ in call(request, timeout=60):
            pass
        return time.perf_counter() - t0

    async def ready(self) -> None:
        """Every connection answers (the gateway has probed the worker)."""
        import grpc

        data = bytes(4 * 8)
        for i in range(len(self.stubs)):
            for _ in range(200):
                try:
                    await self.one(i, self.request(data))
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    await asyncio.sleep(0.05)

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()


def _prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> bytes:
    from array import array

    ids = array("I", (rng.randrange(vocab_size) for _ in range(num_tokens)))
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tobytes()


async def _measure(direct: _Client, gateway: _Client, args: argparse.Namespace,
                   num_tokens: int, vocab_size: int, progress) -> dict[str, Any]:
    rng = random.Random(args.seed)
    out: dict[str, Any] = {"prompt_tokens": num_tokens}
    samples: dict[str, list[float]] = {"direct": [], "gateway": []}
    for i in range(args.idle):  # alternate, fresh prompts: drift hits both alike
        for name, client in (("direct", direct), ("gateway", gateway))[:: 1 if i % 2 else -1]:
            samples[name].append(await client.one(i, client.request(
                _prompt(rng, num_tokens, vocab_size))))
        progress.update()
    out["idle"] = _summary(samples)
    samples = {"direct": [], "gateway": []}
    for b in range(args.bursts):
        for name, client in (("direct", direct), ("gateway", gateway))[:: 1 if b % 2 else -1]:
            reqs = [client.request(_prompt(rng, num_tokens, vocab_size))
                    for _ in range(args.burst)]
            t0 = time.perf_counter()
            samples[name] += await asyncio.gather(*(client.one(i, r, t0)
                                                    for i, r in enumerate(reqs)))
        progress.update(args.idle // max(1, args.bursts))
    out["burst"] = _summary(samples)
    out["queueing_p50_ms"] = round(out["burst"]["added_ms"]["p50"]
                                   - out["idle"]["added_ms"]["p50"], 3)
    return out


def _summary(samples: dict[str, list[float]]) -> dict[str, Any]:
    d, g = _quantiles(samples["direct"]), _quantiles(samples["gateway"])
    return {"direct_ms": d, "gateway_ms": g,
            "added_ms": {q: round(g[q] - d[q], 3) for q in ("p50", "p99")}}


def _worker(args: argparse.Namespace) -> None:
    """The emulated worker (`prefixgate worker --emulate`), in its own process."""
    import logging

    from prefixgate.cli.common import stop_event
    from prefixgate.emulate.worker import serve_emulated

    logging.basicConfig(level=logging.WARNING)

    async def main() -> None:
        await serve_emulated(args, stop_event())

    asyncio.run(main())


def _wait_port(address: str, procs: list[subprocess.Popen], timeout_s: float = 120) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"bench gateway: a process it started exited ({address})")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"bench gateway: {address} did not become healthy in {timeout_s:.0f} s")


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from prefixgate.emulate.model import emulation_model_dir
    from prefixgate.models import resolve_model
    from prefixgate.rpc import free_port
    from prefixgate.tokenizer import ChatTokenizer

    model_dir = emulation_model_dir(args.model)
    vocab_size = ChatTokenizer(resolve_model(str(model_dir))).vocab_size
    cli = [sys.executable, "-m", "prefixgate"]
    quiet = ["--log-level", "WARNING"]
    wport = free_port()
    worker = multiprocessing.get_context("spawn").Process(target=_worker, args=(
        argparse.Namespace(model=str(model_dir), cache_dir=None, host="127.0.0.1", port=wport,
                           worker_id="bench-worker", block_size=args.block_size,
                           num_blocks=1_000_000, prefill_tokens_per_s=1e15,
                           decode_s_per_token=0.0, time_scale=1.0, drain_seconds=1.0,
                           emulate_records="", redis_url=""),))
    worker.start()
    procs: list[subprocess.Popen] = []
    results: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    steps = len(args.processes) * len(args.prompt_tokens) * 2 * args.idle
    try:
        _wait_port(f"127.0.0.1:{wport}", procs)
        with tqdm(total=steps, desc="bench gateway", file=sys.stderr) as progress:
            for n in args.processes:
                gport = free_port()
                gw = subprocess.Popen([*cli, "gateway", "--model", str(model_dir),
                                       "--worker", f"127.0.0.1:{wport}", "--port", str(gport),
                                       "--block-size", str(args.block_size),
                                       "--processes", str(n), *quiet])
                procs.append(gw)
                try:
                    _wait_port(f"127.0.0.1:{gport}", procs)
                    for num_tokens in args.prompt_tokens:
                        r = asyncio.run(_one_config(f"127.0.0.1:{wport}",
                                                    f"127.0.0.1:{gport}", args, num_tokens,
                                                    vocab_size, progress))
                        results.append({"processes": n, **r})
                finally:
                    _stop([gw])
                    procs.remove(gw)
    finally:
        _stop(procs)
        worker.terminate()
        worker.join(20)
    return _report(args, results, load_before)


async def _one_config(worker: str, gateway: str, args: argparse.Namespace, num_tokens: int,
                      vocab_size: int, progress) -> dict[str, Any]:
    direct, via = _Client(worker, args.burst, False), _Client(gateway, args.burst, True)
    try:
        await direct.ready()
        await via.ready()
        return await _measure(direct, via, args, num_tokens, vocab_size, progress)
    finally:
        await direct.close()
        await via.close()


def _report(args: argparse.Namespace, results: list[dict[str, Any]],
            load_before: tuple[float, ...]) -> dict[str, Any]:
    big = max(args.prompt_tokens)
    targets = {}
    for r in results:
        if r["prompt_tokens"] != big:
            continue
        n = r["processes"]
        targets[f"{n}_processes"] = {
            "added_p50_ms_12k_burst": r["burst"]["added_ms"]["p50"],
            "queueing_p50_ms_12k": r["queueing_p50_ms"],
            "met": r["burst"]["added_ms"]["p50"] <= TARGETS["added_p50_ms_12k_burst"]
            and r["queueing_p50_ms"] <= TARGETS["queueing_p50_ms_12k"],
        }
    return {
        "benchmark": "gateway",
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")
                   and k not in ("json", "log_level", "command", "bench")},
        "cpus": os.cpu_count(),
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]},
        "targets": {"limits": TARGETS, "largest_prompt_tokens": big, **targets},
        "results": results,
    }
