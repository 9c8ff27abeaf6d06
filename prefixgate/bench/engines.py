"""`prefixgate bench engines`: what the gateway costs a turn in front of a vLLM server,
against what it costs in front of a prefixgate worker, in the same run.

Two backends, each measured directly and through its own gateway process (one output
token per request; the same prompts, of `--prompt-tokens` tokens in the multi-turn shape:
one of a few conversations sent before plus `--new-tokens` new ids, packed):

* prefixgate: an emulated worker (`prefixgate worker --emulate`: the real WorkerService,
  no model), its turns made as long as vLLM's (it prefills the new tokens at the pace
  vLLM was measured at first), so that what a gateway does while a turn runs (status
  pushes, event batches) weighs alike on both; direct = its `Generate` over gRPC;
  gateway = `prefixgate gateway --worker` `Chat` (packed prompt);
* vllm: a real vLLM server (started from `--vllm-python`, or given by `--vllm` as
  URL,EVENTS[,REPLAY]); direct = its `/v1/completions` over HTTP with the body the
  adapter sends (token ids, streamed with usage); gateway = `prefixgate gateway
  --vllm-worker` `Chat` (the adapter in the gateway's process: HTTP to vLLM, its KV events
  mapped into the index, its /metrics polled);
* vllm_worker: the same vLLM server behind `prefixgate worker --engine vllm` (the
  Kubernetes form: the adapter in its own process); gateway = `prefixgate gateway --worker`
  to it. Its direct path is vllm's.

Per backend: `added_ms` = gateway latency - direct latency (p50, p99; requests alternate
between the four paths so drift hits all alike); `gateway_cpu_ms_per_request`, the gateway
process's CPU per request (/proc, 10 ms ticks: use enough requests);
`gateway_idle_cpu_ms_per_s`, what it spends per second with no turn (following status and
events; for vLLM, polling /metrics), sampled for `IDLE_S` first; and
`gateway_turn_cpu_ms_per_request`, the run's CPU less that idle rate over the run, per
request: what a turn costs. vLLM
computes on this machine's CPU, so its latencies are noisy where the emulated worker's are
not: the CPU figures are the comparison that holds. Target: a turn costs the gateway no
more in front of vLLM than in front of a prefixgate worker (`cpu_ratio_vllm_over_prefixgate`
of the per-turn figures <= 1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGETS = {"cpu_ratio_vllm_over_prefixgate": 1.0}
PATHS = ("prefixgate_direct", "prefixgate_gateway", "vllm_direct", "vllm_gateway",
         "vllm_worker_gateway")
IDLE_S = 5.0  # seconds each gateway's CPU is sampled with no turn running


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help="the model vLLM serves (its checkpoint folder) and the gateways'")
    parser.add_argument("--vllm-python", default="",
                        help="python of an environment with vLLM: start a vLLM server from it")
    parser.add_argument("--vllm", default="",
                        help="or a running vLLM server as URL,EVENTS[,REPLAY] (started with "
                             "prefix caching, prompt token details and KV events)")
    parser.add_argument("--vllm-block-size", type=int, default=32,
                        help="block size of the vLLM server started here (its CPU backend "
                             "wants a multiple of 32)")
    parser.add_argument("--block-size", type=int, default=16, help="the gateways' block size")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=32,
                        help="tokens each request adds to a conversation sent before")
    parser.add_argument("--conversations", type=int, default=2,
                        help="conversations the requests extend (their KV must fit vLLM's)")
    parser.add_argument("--requests", type=int, default=100, help="requests per path and size")
    parser.add_argument("--seed", type=int, default=0)


class _VLLMDirect:
    """The direct path to vLLM: the adapter's request body, over one pooled session."""

    def __init__(self, url: str, served_model: str) -> None:
        from prefixgate.engines.vllm_http import VLLMClient

        self.client = VLLMClient(url)
        self.model = served_model

    def request(self, data: bytes) -> dict:
        from prefixgate.radix import packed

        return {"model": self.model, "prompt": packed(data).tolist(), "max_tokens": 1,
                "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True, "temperature": 0}

    async def one(self, i: int, body: dict) -> float | None:
        from prefixgate.engines.vllm_http import VLLMError

        t0 = time.perf_counter()
        try:
            async for _ in self.client.completions(body, 120):
                pass
        except VLLMError:
            return None
        return time.perf_counter() - t0

    async def ready(self) -> None:
        pass

    async def close(self) -> None:
        await self.client.close()


def _start_vllm(procs, args: argparse.Namespace, model_dir, served: str) -> str:
    """Start vLLM in `procs`; its URL,EVENTS,REPLAY once it answers."""
    import json
    import urllib.request

    from prefixgate.launch.vllm import VLLMServer
    from prefixgate.wire.rpc import free_port

    port = free_port()
    # The event sockets as `up` makes them: ipc:// in a private (0700) directory, never
    # TCP on every interface (the events carry every prompt's token ids).
    server = VLLMServer("vllm", "127.0.0.1", port, 0, 0,
                        ipc_dir=tempfile.mkdtemp(prefix="bench-vllm-events-"))
    endpoint, replay_endpoint = server.bind_events()
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": endpoint, "replay_endpoint": replay_endpoint}
    procs.start("vllm", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                         "--model", str(model_dir), "--served-model-name", served,
                         "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
                         str(max(args.prompt_tokens) * 2), "--block-size",
                         str(args.vllm_block_size), "--dtype", "float32", "--enforce-eager",
                         "--enable-prefix-caching", "--enable-prompt-tokens-details",
                         "--kv-cache-memory-bytes", str(1 << 30),
                         "--kv-events-config", json.dumps(config)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if procs.procs["vllm"].poll() is not None:
            raise SystemExit(f"bench engines: vLLM exited before answering: see "
                             f"{procs.log_path('vllm')}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return f"{url},{server.events},{server.replay}"
        except OSError:
            time.sleep(1)
    raise SystemExit("bench engines: vLLM did not answer within 600 s")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from prefixgate.bench.gateway import _Client, _Prompts, _wait_serving
    from prefixgate.emulate.model import emulation_model_dir
    from prefixgate.engines.vllm import VLLMConfig
    from prefixgate.launch.processes import ProcessGroup
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.wire.rpc import free_port

    if not args.vllm and not args.vllm_python:
        raise SystemExit("bench engines: give --vllm-python PATH (a python with vLLM) or "
                         "--vllm URL,EVENTS of a running server")
    spec = resolve_model(args.model)
    vocab_size = ChatTokenizer(spec).vocab_size
    emulated_dir = emulation_model_dir(args.model)
    quiet = ["--log-level", "WARNING"]
    # The children's output goes to files: vLLM prints to stdout, where the JSON goes.
    logdir = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    print(f"bench engines: logs of the servers in {logdir}", file=sys.stderr)
    procs = ProcessGroup(logdir, new_session=True)
    load_before = os.getloadavg()
    results = []
    try:
        vllm = args.vllm or _start_vllm(procs, args, spec.model_dir, spec.name)
        cfg = VLLMConfig.parse(vllm)
        # The emulated worker takes as long over a turn as vLLM does (its prefill of the
        # new tokens at vLLM's measured pace): a gateway's work that goes with a turn's
        # length (status pushes, event batches while it runs) then weighs alike on both.
        vllm_s = asyncio.run(_vllm_turn_s(cfg.url, spec.name, vocab_size, args))
        prefill_rate = args.new_tokens / max(1e-3, vllm_s)
        print(f"bench engines: a vLLM turn takes {vllm_s * 1e3:.0f} ms; the emulated worker "
              f"prefills at {prefill_rate:.0f} tokens/s to match", file=sys.stderr)
        wport, eport, vport = free_port(), free_port(), free_port()
        aport, cport = free_port(), free_port()
        procs.start_prefixgate("worker", "worker", "--emulate", "--model", str(emulated_dir),
                               "--port", str(wport), "--worker-id", "bench-worker",
                               "--block-size", str(args.block_size), "--num-blocks", "1000000",
                               "--prefill-tokens-per-s", str(prefill_rate),
                               "--decode-s-per-token", "0", *quiet)
        ge = procs.start_prefixgate("gateway-prefixgate", "gateway", "--model", str(emulated_dir),
                                    "--worker", f"127.0.0.1:{wport}", "--port", str(eport),
                                    "--block-size", str(args.block_size), "--http-port", "-1",
                                    *quiet)
        gv = procs.start_prefixgate("gateway-vllm", "gateway", "--model", args.model,
                                    "--vllm-worker", vllm, "--port", str(vport),
                                    "--block-size", str(args.block_size), "--http-port", "-1",
                                    *quiet)
        procs.start_prefixgate("vllm-worker", "worker", "--engine", "vllm", "--model", args.model,
                               "--port", str(aport), "--block-size", str(args.block_size),
                               "--vllm-url", cfg.url, "--vllm-events", cfg.events,
                               *(["--vllm-replay", cfg.replay] if cfg.replay else []), *quiet)
        gw = procs.start_prefixgate("gateway-vllm-worker", "gateway", "--model", args.model,
                                    "--worker", f"127.0.0.1:{aport}", "--port", str(cport),
                                    "--block-size", str(args.block_size), "--http-port", "-1",
                                    *quiet)
        for port in (wport, eport, vport, aport, cport):
            _wait_serving(procs, f"127.0.0.1:{port}")
        steps = len(args.prompt_tokens) * len(PATHS) * args.requests
        with tqdm(total=steps, desc="bench engines", file=sys.stderr) as progress:
            for num_tokens in args.prompt_tokens:
                prompts = _Prompts("turn", random.Random(args.seed), num_tokens, vocab_size,
                                   args.conversations, args.new_tokens)

                def clients() -> dict:  # made on the run's event loop (grpc.aio needs one)
                    return {"prefixgate_direct": _Client(f"127.0.0.1:{wport}", 1, False),
                            "prefixgate_gateway": _Client(f"127.0.0.1:{eport}", 1, True),
                            "vllm_direct": _VLLMDirect(cfg.url, spec.name),
                            "vllm_gateway": _Client(f"127.0.0.1:{vport}", 1, True),
                            "vllm_worker_gateway": _Client(f"127.0.0.1:{cport}", 1, True)}
                r = asyncio.run(_measure(clients, {"prefixgate": ge.pid, "vllm": gv.pid,
                                                   "vllm_worker": gw.pid},
                                         args, prompts, progress))
                results.append({"prompt_tokens": num_tokens, **r})
    finally:
        procs.stop(20, first=["gateway"])
    return _report(args, results, load_before)


async def _vllm_turn_s(url: str, served: str, vocab_size: int, args: argparse.Namespace
                       ) -> float:
    """vLLM's median time for one request of the run's shape (a known prefix plus
    `new_tokens` new ones, one output token), on the direct path."""
    import statistics

    from prefixgate.bench.gateway import _Prompts

    prompts = _Prompts("turn", random.Random(args.seed + 1), min(args.prompt_tokens),
                       vocab_size, 1, args.new_tokens)
    direct = _VLLMDirect(url, served)
    try:
        await direct.one(0, direct.request(prompts.bases[0]))
        times = [await direct.one(0, direct.request(prompts.next())) for _ in range(10)]
    finally:
        await direct.close()
    return statistics.median(t for t in times if t is not None)


async def _measure(make_clients, pids: dict[str, int], args: argparse.Namespace, prompts,
                   progress) -> dict[str, Any]:
    from prefixgate.bench.gateway import _cpu_s, _quantiles

    clients = make_clients()
    try:
        for client in clients.values():
            await client.ready()
        for base in prompts.bases:  # the conversations so far: cached and indexed
            for client in clients.values():
                await client.one(0, client.request(base))
        await asyncio.sleep(1.0)  # vLLM's events of those reach its gateway's index
        # What each gateway spends with no turn at all (following its workers' status and
        # events; for vLLM, polling /metrics), per second: subtracted from the run's CPU
        # so that a slower backend's longer run does not count as per-turn cost.
        idle0 = {name: _cpu_s(pid) for name, pid in pids.items()}
        await asyncio.sleep(IDLE_S)
        idle1 = {name: _cpu_s(pid) for name, pid in pids.items()}
        samples: dict[str, list[float | None]] = {name: [] for name in clients}
        order = list(clients.items())
        cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
        run_s = time.perf_counter()
        for i in range(args.requests):
            data = prompts.next()
            for name, client in order[:: 1 if i % 2 else -1]:
                samples[name].append(await client.one(0, client.request(data)))
                progress.update()
        cpu1 = {name: _cpu_s(pid) for name, pid in pids.items()}
        run_s = time.perf_counter() - run_s
    finally:
        for client in clients.values():
            await client.close()
    q = {name: _quantiles(s) for name, s in samples.items()}
    out: dict[str, Any] = {"latency_ms": q}
    out["run_s"] = round(run_s, 3)
    for backend in ("prefixgate", "vllm", "vllm_worker"):
        g, d = q[f"{backend}_gateway"], q[f"{backend.split('_')[0]}_direct"]
        cpu_s = sum(cpu1[backend]) - sum(cpu0[backend])
        idle_per_s = (sum(idle1[backend]) - sum(idle0[backend])) / IDLE_S
        out[backend] = {
            "added_ms": {k: round(g[k] - d[k], 3) for k in ("p50", "p99")},
            "gateway_cpu_ms_per_request": round(cpu_s * 1e3 / args.requests, 3),
            "gateway_idle_cpu_ms_per_s": round(idle_per_s * 1e3, 3),
            "gateway_turn_cpu_ms_per_request": round(
                max(0.0, cpu_s - idle_per_s * run_s) * 1e3 / args.requests, 3),
        }
    base = max(1e-9, out["prefixgate"]["gateway_turn_cpu_ms_per_request"])
    out["cpu_ratio_vllm_over_prefixgate"] = round(
        out["vllm"]["gateway_turn_cpu_ms_per_request"] / base, 3)
    out["cpu_ratio_vllm_worker_over_prefixgate"] = round(
        out["vllm_worker"]["gateway_turn_cpu_ms_per_request"] / base, 3)
    return out


def _report(args: argparse.Namespace, results: list[dict[str, Any]],
            load_before: tuple[float, ...]) -> dict[str, Any]:
    worst = max((r["cpu_ratio_vllm_over_prefixgate"] for r in results), default=0.0)
    worst_worker = max((r["cpu_ratio_vllm_worker_over_prefixgate"] for r in results),
                       default=0.0)
    return {
        "benchmark": "engines",
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")
                   and k not in ("json", "log_level", "command", "bench", "vllm_python")},
        "cpus": os.cpu_count(),
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()]},
        "targets": {"limits": TARGETS, "worst_cpu_ratio_in_gateway": worst,
                    "worst_cpu_ratio_worker_form": worst_worker,
                    "met_in_gateway": worst <= TARGETS["cpu_ratio_vllm_over_prefixgate"],
                    "met_worker_form": worst_worker <= TARGETS["cpu_ratio_vllm_over_prefixgate"]},
        "results": results,
    }
