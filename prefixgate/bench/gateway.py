"""`prefixgate bench gateway`: the latency the gateway adds to a turn, idle and under a burst.

One emulated worker (`prefixgate worker --emulate`: the real WorkerService, no model,
prefill and decode made instant so the worker's own time is only its gRPC and cache work)
serves every request. Each request is timed at the client from sending to the end of its
stream (one output token), in two ways against that same worker over real gRPC:

* direct: client -> worker `Generate` with the packed prompt (the baseline);
* gateway: client -> `prefixgate gateway --processes N` `Chat` with the same packed form
  -> worker (validation, block hashing, routing, request building, relaying);
* relay: client -> a grpc.aio `Chat` server that only relays (`relay_main`: builds the
  worker request, calls `Generate`, re-wraps the replies; no validation, hashing, routing,
  index, feeds or metrics) -> worker: the floor of a Python gRPC gateway, one process.
  `--relay-impls` adds the same relay on uvloop's event loop (`relay_uvloop`) and on
  grpcio's thread-pool server with blocking client calls (`relay_sync`): which Python gRPC
  stack has the lowest floor.

added = gateway (or relay) latency - direct latency, per quantile (p50, p99), for prompts of 1k and
12k tokens, of two kinds: `fresh` (random ids, every block new to the gateway's index: its
worst case) and `turn` (one of `--burst` conversations seen before plus `--new-tokens` new
ones, as a multi-turn chat's next turn), in two traffic shapes: idle (one request at a
time) and burst (`--burst` requests, default 30, sent at once, each on its own connection,
so that N processes can share them; latency counted from the burst's start). The gateway runs as 1 and as N processes (`--processes`). Both paths
share the client and the worker, so their costs cancel out of `added`; `queueing` is the
burst's added p50 minus the idle one (what the burst makes a request wait in the gateway).
`gateway_cpu_ms_per_request` is the CPU time all gateway processes used per request
(/proc): unlike latencies it does not depend on what else the machine runs, and a burst
of B requests on N processes queues for about B / N times it (`burst_cpu_ms_per_process`,
where each process has a core of its own; the median request waits about half of it).

CPU per request is also split: `*_sys_cpu_ms_per_request` is the kernel's share
(loopback TCP sends and receives, wake-ups). `--sustain-rates R1 R2 ...` offers turns
open loop at each rate to the gateway and to the worker directly and reports the highest
rate the gateway sustains before its p99 latency doubles against the lowest rate's
(`sustain.gateway.sustained_turns_per_s`).

Targets (issue 11): added p50 <= 1 ms at 12k-token prompts under the burst, and no queueing
behind a burst (queueing p50 <= 1 ms). The load average is reported beside the figures:
on a shared machine they are only comparable within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from typing import Any

TARGETS = {"added_p50_ms_12k_burst": 1.0, "queueing_p50_ms_12k": 1.0}
RELAY_IMPLS = ("aio", "uvloop", "sync")
KINDS = ("turn", "fresh")


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
    parser.add_argument("--new-tokens", type=int, default=512,
                        help="multi-turn shape: tokens each turn adds to a prompt seen before")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                        help="prompt kinds to measure (turn: a known conversation's next "
                             "turn; fresh: every block new)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--relay", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure a gRPC relay with no gateway logic (the floor)")
    parser.add_argument("--relay-impls", nargs="+", choices=RELAY_IMPLS, default=["aio"],
                        help="relays to measure (paths 'relay' for aio, 'relay_<impl>' for "
                             "the others): aio = grpc.aio server and client on asyncio; "
                             "uvloop = the same on uvloop's event loop; sync = grpcio's "
                             "thread-pool server with blocking client calls")
    parser.add_argument("--sustain-rates", type=float, nargs="*", default=[],
                        help="also offer turns at these rates (turns/s, open loop, rising) "
                             "to the gateway and directly to the worker, and report the "
                             "highest rate the gateway sustains before its p99 latency "
                             "doubles against the lowest rate's")
    parser.add_argument("--sustain-seconds", type=float, default=4.0,
                        help="how long each sustain rate is offered")
    parser.add_argument("--plot", default="",
                        help="write a PNG: added latency idle and under the burst, by prompt, "
                             "kind and number of gateway processes")


def _quantiles(samples: list[float | None]) -> dict[str, float]:
    ok = [x for x in samples if x is not None]
    qs = statistics.quantiles(ok, n=100, method="inclusive") if len(ok) > 1 else [0.0] * 99
    return {"p50": round(qs[49] * 1e3, 3), "p99": round(qs[98] * 1e3, 3), "n": len(ok),
            "errors": len(samples) - len(ok)}


def _cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds used by process `pid` and its children so far (Linux
    /proc; 0 elsewhere). Unlike latency, this does not depend on the machine's load.
    System time is the kernel's share: loopback TCP sends and receives, wake-ups."""
    ticks = os.sysconf("SC_CLK_TCK")
    user = system = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            user += int(fields[11]) / ticks
            system += int(fields[12]) / ticks
            todo += [int(c) for c in open(f"/proc/{p}/task/{p}/children").read().split()]
        except (OSError, ValueError, IndexError):
            pass
    return user, system


def _cpu_ms(out: dict[str, Any], before: dict[str, tuple[float, float]],
            pids: dict[str, int], requests: int) -> None:
    """Record each path's CPU per request since `before`: total, and the kernel's share."""
    for name, pid in pids.items():
        user, system = _cpu_s(pid)
        u0, s0 = before[name]
        n = max(1, requests)
        out[f"{name}_cpu_ms_per_request"] = round((user - u0 + system - s0) * 1e3 / n, 3)
        out[f"{name}_sys_cpu_ms_per_request"] = round((system - s0) * 1e3 / n, 3)


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

    async def one(self, i: int, request, t0: float | None = None) -> float | None:
        """Seconds from `t0` (default: now) until request's stream ended on connection i;
        None when it failed (counted as an error, not as a latency)."""
        import grpc

        stub = self.stubs[i % len(self.stubs)]
        call = stub.Chat if self.gateway else stub.Generate
        t0 = time.perf_counter() if t0 is None else t0
        try:
            async for _ in call(request, timeout=60):
                pass
        except grpc.aio.AioRpcError:
            return None
        return time.perf_counter() - t0

    async def ready(self) -> None:
        """Every connection answers (the gateway has probed the worker)."""
        data = bytes(4 * 8)
        for i in range(len(self.stubs)):
            for _ in range(200):
                if await self.one(i, self.request(data)) is not None:
                    break
                await asyncio.sleep(0.05)

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()


def _prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> bytes:
    """`num_tokens` random ids, packed (the wire form)."""
    from prefixgate.radix import tokens_to_bytes

    return tokens_to_bytes([rng.randrange(vocab_size) for _ in range(num_tokens)])


class _Prompts:
    """Packed prompts of `num_tokens`: fresh, or a turn of one of `conversations` known
    prefixes followed by `new_tokens` fresh ids (the prefixes are sent once up front)."""

    def __init__(self, kind: str, rng: random.Random, num_tokens: int, vocab_size: int,
                 conversations: int, new_tokens: int) -> None:
        self.kind, self.rng, self.vocab_size = kind, rng, vocab_size
        self.num_tokens = num_tokens
        self.new_tokens = min(new_tokens, num_tokens) if kind == "turn" else num_tokens
        self.bases = [_prompt(rng, num_tokens - self.new_tokens, vocab_size)
                      for _ in range(conversations if kind == "turn" else 0)]
        self.i = 0

    def next(self) -> bytes:
        self.i += 1
        new = _prompt(self.rng, self.new_tokens, self.vocab_size)
        return self.bases[self.i % len(self.bases)] + new if self.bases else new


async def _measure(clients: dict[str, _Client], pids: dict[str, int],
                   args: argparse.Namespace, prompts: _Prompts, progress) -> dict[str, Any]:
    """`clients`: "direct", "gateway" and optionally "relay"; `pids`: the server process
    whose CPU is counted for each path other than direct."""
    out: dict[str, Any] = {"prompt_tokens": prompts.num_tokens, "kind": prompts.kind,
                           "new_tokens_per_request": prompts.new_tokens}
    for base in prompts.bases:  # the conversations so far: known to index and worker
        for client in clients.values():
            await client.one(0, client.request(base))
    order = list(clients.items())
    samples: dict[str, list[float | None]] = {name: [] for name in clients}
    cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
    for i in range(args.idle):  # alternate: drift hits every path alike
        for name, client in order[:: 1 if i % 2 else -1]:
            samples[name].append(await client.one(i, client.request(prompts.next())))
        progress.update()
    out["idle"] = _summary(samples)
    _cpu_ms(out["idle"], cpu0, pids, args.idle)
    samples = {name: [] for name in clients}
    cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
    for b in range(args.bursts):
        for name, client in order[:: 1 if b % 2 else -1]:
            reqs = [client.request(prompts.next()) for _ in range(args.burst)]
            t0 = time.perf_counter()
            samples[name] += await asyncio.gather(*(client.one(i, r, t0)
                                                    for i, r in enumerate(reqs)))
        progress.update(args.idle // max(1, args.bursts))
    out["burst"] = _summary(samples)
    _cpu_ms(out["burst"], cpu0, pids, args.bursts * args.burst)
    out["queueing_p50_ms"] = round(out["burst"]["added_ms"]["p50"]
                                   - out["idle"]["added_ms"]["p50"], 3)
    return out


def _summary(samples: dict[str, list[float | None]]) -> dict[str, Any]:
    q = {name: _quantiles(s) for name, s in samples.items()}
    d = q["direct"]
    out: dict[str, Any] = {f"{name}_ms": v for name, v in q.items()}
    out["added_ms"] = {k: round(q["gateway"][k] - d[k], 3) for k in ("p50", "p99")}
    for name in q:
        if name.startswith("relay"):
            out[f"{name}_added_ms"] = {k: round(q[name][k] - d[k], 3) for k in ("p50", "p99")}
    return out


def relay_main(worker: str, port: int, impl: str = "aio") -> None:
    """The `relay` paths: a ChatService on 127.0.0.1:`port` that only relays to `worker`
    (builds the worker request, calls `Generate`, re-wraps the replies; the floor a Python
    gRPC gateway costs per turn; see the module docstring), on grpc.aio (`impl` "aio", or
    "uvloop": the same on uvloop's loop) or on grpcio's thread-pool server ("sync")."""
    import grpc

    from prefixgate.v1 import chat_pb2, chat_pb2_grpc, worker_pb2, worker_pb2_grpc

    big = 64 << 20

    def worker_request(request):
        return worker_pb2.GenerateRequest(packed_prompt_token_ids=request.packed_prompt_token_ids,
                                          sampling=request.sampling)

    def chat_event(ev):
        if ev.HasField("chunk"):
            c = ev.chunk
            return chat_pb2.ChatEvent(delta=chat_pb2.ChatDelta(
                text=c.text, token_ids=c.token_ids, index=c.index))
        return chat_pb2.ChatEvent(final=chat_pb2.ChatFinal(usage=ev.final.usage))

    if impl == "sync":
        from concurrent.futures import ThreadPoolExecutor

        class SyncRelay(chat_pb2_grpc.ChatServiceServicer):
            def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub) -> None:
                self.stub = stub

            def Chat(self, request, context):  # noqa: N802 (the RPC's name)
                for ev in self.stub.Generate(worker_request(request)):
                    yield chat_event(ev)

        channel = grpc.insecure_channel(worker, options=[("grpc.max_send_message_length", big)])
        server = grpc.server(ThreadPoolExecutor(max_workers=64),
                             options=[("grpc.max_receive_message_length", big)])
        chat_pb2_grpc.add_ChatServiceServicer_to_server(
            SyncRelay(worker_pb2_grpc.WorkerServiceStub(channel)), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    class Relay(chat_pb2_grpc.ChatServiceServicer):
        def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub) -> None:
            self.stub = stub

        async def Chat(self, request, context):  # noqa: N802 (the RPC's name)
            async for ev in self.stub.Generate(worker_request(request)):
                yield chat_event(ev)

    async def serve() -> None:
        channel = grpc.aio.insecure_channel(worker, options=[("grpc.max_send_message_length", big)])
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", big)])
        chat_pb2_grpc.add_ChatServiceServicer_to_server(
            Relay(worker_pb2_grpc.WorkerServiceStub(channel)), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    if impl == "uvloop":
        import uvloop

        uvloop.run(serve())
    else:
        asyncio.run(serve())


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from prefixgate.emulate.model import emulation_model_dir
    from prefixgate.launch.processes import ProcessGroup
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.wire.rpc import free_port

    model_dir = emulation_model_dir(args.model)
    vocab_size = ChatTokenizer(resolve_model(str(model_dir))).vocab_size
    quiet = ["--log-level", "WARNING"]
    procs = ProcessGroup()
    wport = free_port()
    procs.start_prefixgate("worker", "worker", "--emulate", "--model", str(model_dir),
                           "--port", str(wport), "--worker-id", "bench-worker",
                           "--block-size", str(args.block_size), "--num-blocks", "1000000",
                           "--prefill-tokens-per-s", "1e15", "--decode-s-per-token", "0",
                           *quiet)
    if args.relay and "uvloop" in args.relay_impls:
        import importlib.util

        if importlib.util.find_spec("uvloop") is None:
            raise SystemExit("bench gateway: --relay-impls uvloop needs uvloop "
                             "(pip install uvloop); it is not a prefixgate dependency")
    relays: dict[str, tuple[int, Any]] = {}  # path -> (port, process)
    for impl in (args.relay_impls if args.relay else []):
        rport = free_port()
        name = "relay" if impl == "aio" else f"relay_{impl}"
        relays[name] = (rport, procs.start(name, [
            sys.executable, "-c", "import sys; from prefixgate.bench.gateway import "
            "relay_main; relay_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])",
            f"127.0.0.1:{wport}", str(rport), impl]))
    results: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    paths = 2 + len(relays)
    steps = len(args.processes) * len(args.prompt_tokens) * len(args.kinds) * paths * args.idle
    try:
        _wait_serving(procs, f"127.0.0.1:{wport}")
        with tqdm(total=steps, desc="bench gateway", file=sys.stderr) as progress:
            for n in args.processes:
                gport = free_port()
                gw = procs.start_prefixgate(
                    "gateway", "gateway", "--model", str(model_dir),
                    "--worker", f"127.0.0.1:{wport}", "--port", str(gport),
                    "--block-size", str(args.block_size), "--processes", str(n),
                    "--http-port", "-1", *quiet)
                try:
                    _wait_serving(procs, f"127.0.0.1:{gport}")
                    for num_tokens in args.prompt_tokens:
                        for kind in args.kinds:
                            prompts = _Prompts(kind, random.Random(args.seed), num_tokens,
                                               vocab_size, args.burst, args.new_tokens)
                            servers = {"gateway": (f"127.0.0.1:{gport}", gw.pid)}
                            for name, (rport, relay) in relays.items():
                                servers[name] = (f"127.0.0.1:{rport}", relay.pid)
                            r = asyncio.run(_one_config(f"127.0.0.1:{wport}", servers, args,
                                                        prompts, progress))
                            results.append({"processes": n, **r})
                finally:
                    procs.stop(20, only=["gateway"])
    finally:
        procs.stop(20)
    report = _report(args, results, load_before)
    if args.plot:
        plot(report, args.plot)
    return report


def _wait_serving(procs, address: str, timeout_s: float = 120) -> None:
    from prefixgate.launch.processes import ProcessExited

    try:
        asyncio.run(procs.wait_serving(address, timeout_s))
    except (ProcessExited, TimeoutError) as exc:
        raise SystemExit(f"bench gateway: {exc}") from None


def plot(result: dict, path: str) -> None:
    """PNG of a `run` result: added latency p50 (bars) and p99 (ticks), idle and under the
    burst, for each prompt size and kind, one bar per gateway process count; the target
    line at 1 ms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    procs = sorted({r["processes"] for r in rows})
    groups = sorted({(r["prompt_tokens"], r["kind"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    width = 0.8 / len(procs)
    for ax, shape in zip(axes, ("idle", "burst"), strict=True):
        for j, n in enumerate(procs):
            by = {(r["prompt_tokens"], r["kind"]): r[shape]["added_ms"] for r in rows
                  if r["processes"] == n}
            xs = [i + (j - (len(procs) - 1) / 2) * width for i in range(len(groups))]
            ax.bar(xs, [by[g]["p50"] for g in groups], width,
                   label=f"{n} process{'es' if n > 1 else ''}")
            ax.scatter(xs, [by[g]["p99"] for g in groups], marker="_", s=200, color="black",
                       zorder=3, label="p99" if j == 0 else None)
        floor = {(r["prompt_tokens"], r["kind"]): r[shape]["relay_added_ms"] for r in rows
                 if r["processes"] == procs[0] and "relay_added_ms" in r[shape]}
        if floor:  # the relay with no gateway logic, drawn over the bars
            ax.scatter(range(len(groups)), [floor[g]["p50"] for g in groups], marker="D",
                       color="dimgray", zorder=4, label="relay only (p50): the floor")
        ax.axhline(TARGETS["added_p50_ms_12k_burst"], color="red", ls="--", lw=1,
                   label="target (p50, 12k, burst)")
        ax.set_xticks(range(len(groups)), [f"{t // 1024}k {k}" for t, k in groups])
        ax.set_yscale("log")
        ax.set_title(f"added by the gateway, {shape}"
                     + (f" (bursts of {result['config']['burst']})" if shape == "burst" else ""))
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("ms (p50 bars, p99 ticks)")
    axes[1].legend(fontsize=8)
    load = result["load_average"]["before"][0]
    fig.suptitle(f"prefixgate bench gateway ({result['cpus']} CPUs, load average {load:.1f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def _one_config(worker: str, servers: dict[str, tuple[str, int]],
                      args: argparse.Namespace, prompts: _Prompts, progress) -> dict[str, Any]:
    """`servers`: path name -> (address, pid) of the Chat servers measured beside direct."""
    clients = {"direct": _Client(worker, args.burst, False)}
    clients.update({name: _Client(address, args.burst, True)
                    for name, (address, _) in servers.items()})
    try:
        for client in clients.values():
            await client.ready()
        out = await _measure(clients, {name: pid for name, (_, pid) in servers.items()},
                             args, prompts, progress)
        if args.sustain_rates:
            out["sustain"] = {name: await _sustain(clients[name], args, prompts)
                              for name in ("direct", "gateway")}
        return out
    finally:
        for client in clients.values():
            await client.close()


async def _sustain(client: _Client, args: argparse.Namespace,
                   prompts: _Prompts) -> dict[str, Any]:
    """Offer turns at each of `--sustain-rates` (open loop: turn i is sent at i / rate
    seconds whether or not earlier ones finished, and timed from then, so queueing in
    front of the server counts) for `--sustain-seconds`; per rate the achieved rate and the
    latency quantiles, and the highest rate whose p99 stays within twice the lowest
    rate's (with at least 95 % of the offered rate achieved and no errors)."""
    rows = []
    pool = [client.request(prompts.next()) for _ in range(64)]  # made before the clock runs
    for rate in sorted(args.sustain_rates):
        n = max(1, int(rate * args.sustain_seconds))
        t0 = time.perf_counter() + 0.05
        loop = asyncio.get_running_loop()

        async def one(i: int, t0: float, rate: float) -> float | None:
            start = t0 + i / rate
            await asyncio.sleep(max(0.0, start - time.perf_counter()))
            return await client.one(i, pool[i % len(pool)], start)

        tasks = [loop.create_task(one(i, t0, rate)) for i in range(n)]
        samples = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        q = _quantiles(samples)
        rows.append({"offered_per_s": rate, "achieved_per_s": round(q["n"] / wall, 1), **q})
    sustained = 0.0
    for r in rows:  # the rates below the first one that fails
        if (r["errors"] or r["p99"] > 2 * rows[0]["p99"]
                or r["achieved_per_s"] < 0.95 * r["offered_per_s"]):
            break
        sustained = r["offered_per_s"]
    return {"rates": rows, "sustained_turns_per_s": sustained}


def _report(args: argparse.Namespace, results: list[dict[str, Any]],
            load_before: tuple[float, ...]) -> dict[str, Any]:
    big = max(args.prompt_tokens)
    targets = {}
    for r in results:
        if r["prompt_tokens"] != big:
            continue
        n = r["processes"]
        cpu_ms = r["burst"]["gateway_cpu_ms_per_request"]
        targets[f"{n}_processes_{r['kind']}"] = {
            "gateway_cpu_ms_per_request": cpu_ms,
            # What a burst costs each process: the queue's bound where each process has a
            # core of its own (the median request waits about half of it).
            "burst_cpu_ms_per_process": round(args.burst * cpu_ms / n, 3),
            "added_p50_ms_12k_burst": r["burst"]["added_ms"]["p50"],
            "queueing_p50_ms_12k": r["queueing_p50_ms"],
            "met": r["burst"]["added_ms"]["p50"] <= TARGETS["added_p50_ms_12k_burst"]
            and r["queueing_p50_ms"] <= TARGETS["queueing_p50_ms_12k"],
        }
        for name in [k[: -len("_cpu_ms_per_request")] for k in r["burst"]
                     if k.startswith("relay") and k.endswith("_cpu_ms_per_request")
                     and not k.endswith("_sys_cpu_ms_per_request")]:  # the floor, same run
            targets[f"{n}_processes_{r['kind']}"].update({
                f"{name}_cpu_ms_per_request": r["burst"][f"{name}_cpu_ms_per_request"],
                f"{name}_added_p50_ms_12k_burst": r["burst"][f"{name}_added_ms"]["p50"]})
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
