"""Block transfer between two real workers: TTFT with a KV pull vs recompute, and the pull's rate.

Two `prefixgate worker` processes (the real model, `--model`, default SmolLM2 in the
worker's default weights, on the CPU) talk real gRPC on loopback. Worker 1 holds a
conversation's `--history-tokens` history in its prefix cache; its follow-up turn
(history plus `--new-tokens` new tokens) goes to idle worker 2, timed at the client from
sending to the first token, two ways, alternating, `--repeats` times each (worker 2's
cache flushed before each):

* recompute: worker 2 prefills the whole prompt (the baseline);
* transfer: the request names worker 1 as its peer (GenerateRequest.pull): worker 2
  pulls the history's blocks from worker 1 (ExportBlocks), then prefills the new tokens.

Greedy replies of both paths must be equal (checked). Transfer rate: worker 2's
`PullBlocks` of the history's chain from worker 1 (bytes / its wall time, reserve and
commit included), against a plain gRPC byte stream on loopback (`byte_stream_main`: a
grpc.aio server process streaming the same number of bytes in messages of the transfer's
chunk size, read by a client process that only counts them, with the workers' message
size options): the share of that floor the transfer reaches.

Targets: TTFT recompute / transfer >= 10 at 4k tokens; transfer rate >= 50 % of the plain
stream. The load average is reported beside the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

TARGETS = {"ttft_speedup": 10.0, "rate_share": 0.5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the workers' model")
    parser.add_argument("--weights", default="auto", help="the workers' --weights")
    parser.add_argument("--history-tokens", type=int, default=4096,
                        help="tokens of the history cached on worker 1")
    parser.add_argument("--new-tokens", type=int, default=32,
                        help="tokens the follow-up turn adds to the history")
    parser.add_argument("--repeats", type=int, default=3, help="timed turns per path")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="each worker's --torch-threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)


def _log(msg: str) -> None:
    print(f"[bench transfer] {msg}", file=sys.stderr, flush=True)


def byte_stream_main(port: int, num_bytes: int, chunk_bytes: int) -> None:
    """Serve one server-streaming method that sends `num_bytes` in messages of
    `chunk_bytes` (prebuilt: no per-message work beyond gRPC's own)."""
    import grpc

    from prefixgate.workerapi.transfer import MAX_MESSAGE_BYTES

    chunk = os.urandom(chunk_bytes)

    async def stream(request: bytes, context):
        for sent in range(0, num_bytes, chunk_bytes):
            yield chunk if sent + chunk_bytes <= num_bytes else chunk[:num_bytes - sent]

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        handler = grpc.unary_stream_rpc_method_handler(stream)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Bytes", {"Stream": handler}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def byte_stream_client_main(address: str) -> None:
    """Read the byte stream at `address` once to warm up, then print the median rate
    (bytes/s) of three more reads."""
    import grpc

    from prefixgate.workerapi.transfer import MAX_MESSAGE_BYTES

    async def read() -> float:
        async with grpc.aio.insecure_channel(
                address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]) as ch:
            call = ch.unary_stream("/bench.Bytes/Stream")
            rates = []
            for _ in range(4):
                began, total = time.monotonic(), 0
                async for msg in call(b""):
                    total += len(msg)
                rates.append(total / (time.monotonic() - began))
            return statistics.median(rates[1:])

    print(asyncio.run(read()), flush=True)


def info_bytes_per_token(stub) -> int:
    from prefixgate.v1 import worker_pb2

    return stub.GetStatus(worker_pb2.GetStatusRequest()).kv_bytes_per_token


def run(args: argparse.Namespace) -> dict[str, Any]:
    import grpc
    from tqdm import tqdm

    from prefixgate.launch.processes import ProcessGroup
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.radix import BlockHasher
    from prefixgate.v1 import common_pb2, worker_pb2, worker_pb2_grpc
    from prefixgate.wire.rpc import free_port
    from prefixgate.wire.token_ids import pack
    from prefixgate.workerapi.transfer import CHUNK_BYTES, MAX_MESSAGE_BYTES

    spec = resolve_model(args.model)
    vocab = ChatTokenizer(spec).vocab_size
    rng = random.Random(args.seed)
    history = [rng.randrange(vocab) for _ in range(args.history_tokens)]
    group = ProcessGroup(scrub_env=True)
    ports = [free_port(), free_port()]
    for i, p in enumerate(ports):
        group.start_prefixgate(
            f"w{i + 1}", "worker", "--model", args.model, "--weights", args.weights,
            "--port", str(p), "--worker-id", f"w{i + 1}", "--device", "cpu",
            "--log-level", "WARNING",
            "--kv-cache-memory", str(4 * (args.history_tokens + 1024) * 46080 // 2),
            *(["--torch-threads", str(args.torch_threads)] if args.torch_threads else []))
    addresses = [f"127.0.0.1:{p}" for p in ports]
    load_before = os.getloadavg()
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    try:
        for a in addresses:
            asyncio.run(group.wait_serving(a, timeout_s=600))
        w1, w2 = (worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(a, options=opts))
                  for a in addresses)
        info = w1.GetInfo(worker_pb2.GetInfoRequest())
        bs = info.block_size

        def turn(stub, prompt: list[int], pull=None) -> tuple[float, list[int], Any]:
            request = worker_pb2.GenerateRequest(
                request_id=f"bench-{time.monotonic_ns()}",
                packed_prompt_token_ids=pack(prompt).tobytes(), pull=pull,
                sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0))
            began, ttft, tokens, final = time.monotonic(), 0.0, [], None
            for ev in stub.Generate(request, timeout=600):
                if ev.HasField("chunk"):
                    ttft = ttft or time.monotonic() - began
                    tokens += ev.chunk.token_ids
                else:
                    final = ev.final
            return ttft, tokens, final

        _log(f"warming up; caching {len(history)} history tokens on w1")
        turn(w1, history[:64])
        turn(w2, history[:64])
        turn(w1, history)
        # Each worker probes its own copy path once after its first request, holding the
        # probed blocks pinned meanwhile: measure only once both probes are over (a flush
        # during one keeps those blocks, and the probe's copies would share the cores).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
                s.GetStatus(worker_pb2.GetStatusRequest()).transfer_rate_source
                for s in (w1, w2)):
            time.sleep(0.1)
        follow_up = history + [rng.randrange(vocab) for _ in range(args.new_tokens)]
        pull = worker_pb2.PullSpec(peer_address=addresses[0], peer_worker_id="w1",
                                   num_blocks=len(history) // bs)
        rows: dict[str, list[float]] = {"recompute": [], "transfer": []}
        replies: dict[str, list[int]] = {}
        usage: dict[str, Any] = {}
        with tqdm(total=2 * args.repeats, desc="bench transfer", file=sys.stderr) as bar:
            for _ in range(args.repeats):
                for path in ("recompute", "transfer"):
                    w2.FlushCache(worker_pb2.FlushCacheRequest())
                    ttft, tokens, final = turn(w2, follow_up,
                                               pull if path == "transfer" else None)
                    rows[path].append(ttft)
                    replies.setdefault(path, tokens)
                    usage[path] = final.usage
                    bar.update()
        if replies["recompute"] != replies["transfer"]:
            raise SystemExit(f"bench transfer: the replies differ: {replies}")

        chain = BlockHasher(bs, spec.fingerprint).hash_blocks(history)
        num_bytes = len(chain) * bs * info_bytes_per_token(w2)
        stream = f"127.0.0.1:{free_port()}"
        group.start("byte-stream", [
            sys.executable, "-c", "import sys; from prefixgate.bench.transfer import "
            "byte_stream_main as m; m(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))",
            stream.rsplit(":", 1)[1], str(num_bytes), str(CHUNK_BYTES)])
        time.sleep(2.0)  # the stream server imports grpc and listens
        pulls, plains = [], []
        # Pulls and the plain stream alternate, so both see the same load.
        for _ in range(args.repeats):
            w2.FlushCache(worker_pb2.FlushCacheRequest())
            got = w2.PullBlocks(worker_pb2.PullBlocksRequest(
                peer_address=addresses[0], peer_worker_id="w1", block_hashes=chain), timeout=600)
            pulls.append((got.num_bytes, got.seconds))
            plains.append(float(subprocess.run(
                [sys.executable, "-c", "import sys; from prefixgate.bench.transfer import "
                 "byte_stream_client_main as m; m(sys.argv[1])", stream],
                check=True, capture_output=True, text=True, timeout=300).stdout.split()[-1]))
        status = w2.GetStatus(worker_pb2.GetStatusRequest())
    finally:
        group.stop()

    pull_rate = statistics.median(b / s for b, s in pulls)
    plain = statistics.median(plains)
    ttft = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "model": spec.name, "weights": args.weights, "history_tokens": args.history_tokens,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "block_size": bs,
        "kv_bytes_per_token": status.kv_bytes_per_token,
        "ttft_s": {k: round(v, 4) for k, v in ttft.items()},
        "ttft_s_all": {k: [round(x, 4) for x in v] for k, v in rows.items()},
        "ttft_speedup": round(ttft["recompute"] / ttft["transfer"], 2),
        "usage": {k: {"prompt": u.prompt_tokens, "cached": u.cached_tokens,
                      "transferred": u.transferred_tokens} for k, u in usage.items()},
        "pull_bytes": pulls[0][0],
        "pull_mb_per_s": round(pull_rate / 1e6, 1),
        "plain_grpc_mb_per_s": round(plain / 1e6, 1),
        "rate_share": round(pull_rate / plain, 3),
        "status_transfer_mb_per_s": round(status.transfer_bytes_per_s / 1e6, 1),
        "targets": TARGETS,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
