"""The overflow planner's work is linear in the prompt (issue 13: one over-long request
with thousands of turn starts stalled its worker for seconds)."""

from __future__ import annotations

from prefixgate.radix import BlockHasher
from prefixgate.wire.protocol import SamplingConfig
from prefixgate.workerapi.api import FinishReason, Request
from tests.helpers import shifting_engine


def test_many_turn_starts_hash_linearly(tiny_spec, tiny_model, monkeypatch) -> None:
    # 32,100 tokens, 4,000 turn starts; turns differ (identical turns would make every
    # layout the same cached run: then the bound is MAX_LAYOUTS x the context instead).
    engine, prefix, prompt = shifting_engine(tiny_spec, tiny_model, 100, 4000)
    turn = prompt[100:100 + len(prefix) + 3]
    sampling = SamplingConfig(max_tokens=1, context_overflow="keep-system-drop-oldest")
    try:
        # The conversation's previous turn, so one earlier layout is cached.
        engine.run_to_completion(Request("prev", tuple(prompt[:-8 * len(turn)]), sampling))
        hashed = []
        hash_blocks = BlockHasher.hash_blocks

        def counting(self, token_ids, parent_hash=None):
            hashed.append(len(token_ids))
            return hash_blocks(self, token_ids, parent_hash)

        monkeypatch.setattr(BlockHasher, "hash_blocks", counting)
        _, final = engine.run_to_completion(Request("long", tuple(prompt), sampling))
        assert final.finish_reason is FinishReason.LENGTH and final.dropped_tokens > 30_000
        assert final.cached_tokens > 1000  # the shifted layout was found
        assert sum(hashed) < 4 * len(prompt)  # was ~ turn starts x prompt
    finally:
        engine.shutdown()
