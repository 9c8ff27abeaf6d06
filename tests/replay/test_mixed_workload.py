"""The mixed chat + shared-document workload (prefixgate/bench/mixed_trace.py) and the
routers' side-by-side summary (prefixgate/bench/vllm_routers.py)."""

from __future__ import annotations

import json

import pytest

from prefixgate.bench.mixed_trace import MixedTraceConfig, generate, write
from prefixgate.bench.vllm_routers import summarize_runs
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.replay.traces import read_trace

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
         "pi rho sigma tau upsilon phi chi psi omega").split()


def _sharegpt(n: int) -> list[dict]:
    out = []
    for i in range(n):
        conv = []
        for k in range(4):
            q = " ".join(WORDS[(i + k + j) % len(WORDS)] for j in range(6 + k))
            a = " ".join(WORDS[(i * 3 + k + j) % len(WORDS)] for j in range(60 + 10 * k))
            conv += [{"from": "human", "value": f"{q}?"}, {"from": "gpt", "value": a}]
        out.append({"id": f"s{i}", "conversations": conv})
    return out


@pytest.fixture(scope="module")
def tok(tiny_spec):
    return ChatTokenizer(tiny_spec)


def test_documents_are_shared_heads_and_chats_stay_within_limits(tok, tmp_path) -> None:
    config = MixedTraceConfig(num_chats=5, max_chat_turns=3, max_prompt_tokens=2048,
                              num_documents=3, document_tokens=(300, 600),
                              num_document_conversations=12, max_question_tokens=64)
    convs = generate(_sharegpt(40), config, tok)
    assert convs == generate(_sharegpt(40), config, tok)  # deterministic
    chats = [c for c in convs if c["id"].startswith("chat-")]
    docs = [c for c in convs if c["id"].startswith("doc")]
    assert len(chats) == 5 and len(docs) == 12
    # The kinds are interleaved, not one block after the other.
    kinds = [c["id"].startswith("doc") for c in convs]
    assert any(a != b for a, b in zip(kinds, kinds[1:], strict=False)) and kinds != sorted(kinds)
    by_doc: dict[str, set[str]] = {}
    for c in docs:
        system = [m["value"] for m in c["conversations"] if m["from"] == "system"]
        assert len(system) == 1
        by_doc.setdefault(c["id"].split("-")[0], set()).add(system[0])
        n = len(tok.encode_text(system[0]))
        assert 300 - 8 <= n <= 600 + 8  # the document's size, within re-tokenizing slack
    assert all(len(texts) == 1 for texts in by_doc.values())  # one text per document
    assert len({t for texts in by_doc.values() for t in texts}) == len(by_doc)
    for c in chats:
        msgs: list[tuple[str, str]] = []
        for m in c["conversations"]:
            if m["from"] == "human":
                msgs.append(("user", m["value"]))
                assert len(tok.encode_messages(msgs)) <= config.max_prompt_tokens
            else:
                msgs.append(("assistant", m["value"]))
        assert 2 <= sum(m["from"] == "human" for m in c["conversations"]) <= 3
    # What the replay reads: a chat trace with the documents as system messages.
    trace = read_trace(write(tmp_path / "mixed.jsonl.gz", convs))
    assert trace.is_chat and trace.num_turns == sum(
        sum(m["from"] == "human" for m in c["conversations"]) for c in convs)
    assert all(c.system for c in trace.conversations if c.conversation_id.startswith("doc"))


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="document_tokens"):
        MixedTraceConfig(document_tokens=(4000, 5000), max_prompt_tokens=3000).check()
    with pytest.raises(ValueError, match="at least one document"):
        MixedTraceConfig(num_documents=0, num_document_conversations=3).check()


def _run(path, label: str, turns: list[dict]) -> None:
    (path / f"{label}.json").write_text(json.dumps({"runs": [{"label": label,
                                                              "turns": turns}]}))


def _turn(ttft: float, prompt: int, cached: int, pulled: int = 0, predicted: int = -1,
          status: str = "ok") -> dict:
    return {"status": status, "ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached,
            "transferred_tokens": pulled, "predicted_cached_tokens": predicted,
            "predicted_transferred_tokens": pulled if predicted >= 0 else 0}


def test_summary_pools_rounds_and_compares_with_the_best_other_router(tmp_path) -> None:
    _run(tmp_path, "prefixgate-r1", [_turn(0.5, 1000, 200, 600, 200), _turn(1.0, 100, 0)])
    _run(tmp_path, "prefixgate-r2", [_turn(0.7, 1000, 800, 0, 800),
                                     _turn(9.0, 100, 0, status="timeout")])
    _run(tmp_path, "smg-r1", [_turn(2.0, 1000, 800), _turn(4.0, 100, 0)])
    _run(tmp_path, "round-robin-r1", [_turn(3.0, 1000, 0), _turn(3.0, 100, 0)])
    s = summarize_runs(tmp_path, ["prefixgate-r1", "smg-r1", "round-robin-r1",
                                  "prefixgate-r2"], 32)
    ours = s["routers"]["prefixgate"]
    assert ours["rounds"] == 2 and ours["turns"] == 4 and ours["turns_ok"] == 3
    assert ours["hit_rate"] == pytest.approx(1000 / 2100)
    assert ours["not_recomputed"] == pytest.approx(1600 / 2100)
    assert ours["index_truth"] == {"turns": 2, "within_one_block": 2}
    assert ours["ttft_s"]["max"] == 1.0  # the failed turn's time is not a TTFT
    c = s["comparison"]
    assert c["best_other"] == "round-robin"  # the lowest p99: 3.0 against smg's ~3.98
    assert c["ttft_p99_ratio"] == pytest.approx(ours["ttft_s"]["p99"] / 3.0)
    assert "index_truth" not in s["routers"]["smg"]
