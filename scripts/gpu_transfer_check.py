"""Block transfer on a CUDA pool: three workers over real gRPC on loopback, one process.

    python scripts/gpu_transfer_check.py [--device cuda] [--out FILE]

tiny-random with a bfloat16 KV pool on the device (float32 on the CPU): a follow-up turn
on pulled KV gives the greedy tokens of a recompute, the pulled pages equal the holder's
bit for bit, pages of another dtype are refused (the turn is computed); PullBlocks of
eight 2k-token chains completes. Prints one JSON document (also to --out); exit status 1
when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import threading
import time

import grpc
import torch

from prefixgate.model.catalog import resolve_model
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from prefixgate.wire.token_ids import pack
from prefixgate.worker.engine import PagedEngine
from prefixgate.worker.model_loader import WeightsConfig, load_model
from prefixgate.workerapi.api import EngineConfig
from prefixgate.workerapi.events import EventLog
from prefixgate.workerapi.server import WorkerConfig, WorkerService, serve


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="")
    args = p.parse_args()
    spec = resolve_model("tiny-random")
    tok = ChatTokenizer(spec)
    kv = "bfloat16" if args.device.startswith("cuda") else "auto"
    model = load_model(spec, device=args.device,
                       weights=WeightsConfig("auto", kv).resolved(args.device, spec))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    workers = {}
    tasks = []  # the servers' tasks (a task nobody holds may be collected)

    async def start(name: str, **cfg):
        events = EventLog()
        engine = PagedEngine(model, tok, EngineConfig(
            num_blocks=2048, eos_token_ids=(), max_context_tokens=spec.max_context_tokens,
            model_fingerprint=spec.fingerprint, **cfg), event_sink=events)
        service = WorkerService(engine, spec, WorkerConfig(worker_id=name, drain_seconds=1),
                                vocab_size=tok.vocab_size, events=events)
        started = asyncio.get_running_loop().create_future()
        tasks.append(asyncio.create_task(serve(service, asyncio.Event(), started)))
        return f"127.0.0.1:{await started}", engine

    opts = [("grpc.max_receive_message_length", 1 << 28)]
    for name, cfg in (("holder", {}), ("puller", {}), ("ref", {"enable_prefix_cache": False})):
        address, engine = asyncio.run_coroutine_threadsafe(start(name, **cfg), loop).result(300)
        stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(address, options=opts))
        workers[name] = (address, engine, stub)

    def gen(name, prompt, pull=None):
        req = worker_pb2.GenerateRequest(
            request_id="r", packed_prompt_token_ids=pack(prompt).tobytes(), pull=pull,
            sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0))
        toks, final = [], None
        for ev in workers[name][2].Generate(req, timeout=300):
            if ev.HasField("chunk"):
                toks += ev.chunk.token_ids
            else:
                final = ev.final
        return toks, final

    checks, out = {}, {"device": args.device, "kv_dtype": str(workers["holder"][1].pool.config.dtype)}
    holder_addr, h_engine, _ = workers["holder"]
    p_engine = workers["puller"][1]
    prompt = [(i * 7919) % 250 + 5 for i in range(203)]
    first, _ = gen("holder", prompt)
    follow = prompt + first + [11, 12, 13]
    pull = worker_pb2.PullSpec(peer_address=holder_addr, num_blocks=len(follow) // 16)
    got, final = gen("puller", follow, pull)
    want, _ = gen("ref", follow)
    checks["tokens_equal_recompute"] = got == want
    out["transferred_tokens"] = final.usage.transferred_tokens
    checks["transferred"] = final.usage.transferred_tokens == (len(prompt) + 11) // 16 * 16
    chain = p_engine.transfer.chain(follow[:final.usage.transferred_tokens], "")
    h_ids = h_engine.on_engine_thread(lambda: h_engine.cache.tree.match(chain, touch=False).values)
    p_ids = p_engine.on_engine_thread(lambda: p_engine.cache.tree.match(chain, touch=False).values)
    same = len(h_ids) == len(p_ids) == len(chain)
    for h, q in zip(h_ids, p_ids, strict=False):
        hs, ps = slice(h * 16, h * 16 + 16), slice(q * 16, q * 16 + 16)
        same &= torch.equal(h_engine.pool.k[:, hs], p_engine.pool.k[:, ps])
        same &= torch.equal(h_engine.pool.v[:, hs], p_engine.pool.v[:, ps])
    checks["pages_bit_equal"] = bool(same)
    # Pages of another dtype than the receiver's: refused, computed instead.
    fmt = p_engine.transfer.format
    p_engine.transfer.format = dataclasses.replace(fmt, dtype="float16" if fmt.dtype != "float16"
                                                   else "float32")
    other = [(i * 31) % 250 + 3 for i in range(100)]
    want2, _ = gen("holder", other)
    got2, final2 = gen("puller", other, worker_pb2.PullSpec(peer_address=holder_addr,
                                                             num_blocks=6))
    checks["mismatch_refused_and_computed"] = got2 == want2 and final2.usage.transferred_tokens == 0
    p_engine.transfer.format = fmt
    # PullBlocks of 8 chains of 2,000 tokens (tiny-random's context is 2k).
    chains = []
    for j in range(8):
        conv = [(i * 13 + j * 101) % 250 + 7 for i in range(2001)]
        gen("holder", conv)
        chains.append(p_engine.transfer.chain(conv, ""))
    pulled = nbytes = 0
    t0 = time.monotonic()
    for chain in chains:
        r = workers["puller"][2].PullBlocks(worker_pb2.PullBlocksRequest(
            peer_address=holder_addr, block_hashes=chain), timeout=300)
        pulled += r.num_pulled_blocks
        nbytes += r.num_bytes
    elapsed = time.monotonic() - t0
    checks["pull_blocks_complete"] = pulled == sum(map(len, chains))
    out["pull_8_chains"] = {"blocks": pulled, "mb": round(nbytes / 1e6, 2),
                            "s": round(elapsed, 3), "mb_per_s": round(nbytes / elapsed / 1e6, 1)}
    out["checks"] = checks
    out["passed"] = all(checks.values())
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
