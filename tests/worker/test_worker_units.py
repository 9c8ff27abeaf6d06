"""Sampling and incremental detokenization (tiny-random's byte-level tokenizer)."""

import torch

from prefixgate.model.detokenizer import StreamDecoder
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.wire.protocol import SamplingConfig
from prefixgate.worker.sampling import Sampler


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, -2.0, 2.9])
    assert Sampler(SamplingConfig()).sample(logits) == 1
    assert Sampler(SamplingConfig(temperature=1.0, top_k=1, seed=3)).sample(logits) == 1


def test_same_seed_same_samples() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    cfg = SamplingConfig(temperature=1.0, top_p=0.9, seed=42)
    a, b = Sampler(cfg), Sampler(cfg)
    assert [a.sample(logits) for _ in range(20)] == [b.sample(logits) for _ in range(20)]
    c = Sampler(SamplingConfig(temperature=1.0, top_p=0.9, seed=43))
    assert [c.sample(logits) for _ in range(20)] != [Sampler(cfg).sample(logits) for _ in range(20)]


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    s = Sampler(SamplingConfig(temperature=1.0, top_p=0.5, seed=0))
    assert {s.sample(logits) for _ in range(50)} == {0}
    s = Sampler(SamplingConfig(temperature=1.0, top_p=0.85, seed=0))
    assert {s.sample(logits) for _ in range(200)} == {0, 1}


def _stream(tok: ChatTokenizer, text: str, stop=()) -> tuple[list[str], StreamDecoder]:
    d = StreamDecoder(tok, stop)
    pieces = []
    for t in tok.tokenizer.encode(text, add_special_tokens=False).ids:
        pieces.append(d.push(t))
        if d.stopped:
            break
    if not d.stopped:
        pieces.append(d.flush())
    return pieces, d


def test_detokenizer_never_splits_a_character(tiny_spec) -> None:
    tok = ChatTokenizer(tiny_spec)
    text = "héllo wörld 🤖 done"
    pieces, _ = _stream(tok, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len([p for p in pieces if p]) > 5  # streamed, not all at the end


def test_detokenizer_stop_strings(tiny_spec) -> None:
    tok = ChatTokenizer(tiny_spec)
    pieces, d = _stream(tok, "The answer is 42. END of story", stop=("END",))
    assert d.stopped and "".join(pieces) == "The answer is 42. "
    # A held-back partial stop string is released when it turns out not to be one.
    pieces, d = _stream(tok, "ENDLESS", stop=("ENDX",))
    assert not d.stopped and "".join(pieces) == "ENDLESS"
