"""Context-overflow policy: which tokens of an over-long chat prompt to drop.

Torch-free and pure (the worker plans with it; a gateway could hash the kept prompt with
it too). A rendered chat prompt is [preamble][turn 1][turn 2]...[turn k], where a turn
starts at a user message (`turn_prefix`, e.g. the ids of "<|im_start|>user") and runs up
to the next one (so it holds the user message and the assistant's reply), and the
preamble (the system prompt, `n_keep` tokens) is everything before the first turn.

`plan_overflow(tokens, max_tokens, max_context_tokens, turn_prefix)` under the policy
"keep-system-drop-oldest": keep the preamble and drop the oldest whole turns until
kept + max_tokens <= max_context_tokens; the last turn (the new user message and the
generation prompt) is never dropped. Returns None when the prompt fits as it is; else an
`OverflowPlan`, which may still not fit (`fits` False) when only the preamble and the
last turn are left; the caller then ends the request (the context is full).

Shifted reuse needs to know where the kept turns sat before: a previous, shorter drop of
the same conversation starts its kept run at an earlier turn, so `OverflowPlan.layouts()`
lists every earlier layout the kept run may be cached under (start of the kept run in
the full prompt, and how far the kept run moves back from there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.radix import BlockHasher

POLICIES = ("fail", "keep-system-drop-oldest")


@dataclass(frozen=True)
class OverflowPlan:
    full: tuple[int, ...]  # the prompt as sent
    turn_starts: tuple[int, ...]  # user-turn starts in `full`; turn_starts[0] == n_keep
    drop_to: int  # kept turns start here in `full`; [n_keep, drop_to) is dropped
    max_context_tokens: int
    max_tokens: int

    @property
    def n_keep(self) -> int:
        return self.turn_starts[0]

    @property
    def dropped_tokens(self) -> int:
        return self.drop_to - self.n_keep

    @property
    def kept(self) -> tuple[int, ...]:
        """The prompt the model sees: preamble + kept turns."""
        return self.layout(self.drop_to)

    @property
    def fits(self) -> bool:
        return len(self.kept) + self.max_tokens <= self.max_context_tokens and \
            len(self.kept) < self.max_context_tokens

    def layout(self, start: int) -> tuple[int, ...]:
        """The preamble followed by `full` from turn start `start` on."""
        return self.full[:self.n_keep] + self.full[start:]

    def layouts(self) -> list[tuple[int, int]]:
        """(start, delta) of every layout the kept run may be cached under: start is an
        earlier turn start (a shorter drop; n_keep: nothing dropped), delta = drop_to -
        start is how many positions the kept run moves back from that layout. The
        current layout (delta 0) comes last."""
        return [(s, self.drop_to - s) for s in self.turn_starts if s <= self.drop_to]


def find_turn_starts(tokens: Sequence[int], turn_prefix: Sequence[int]) -> list[int]:
    """Positions where `turn_prefix` occurs in `tokens` (non-overlapping, in order)."""
    if not turn_prefix:
        return []
    first, n = turn_prefix[0], len(turn_prefix)
    prefix = list(turn_prefix)
    out, i = [], 0
    while True:
        try:
            i = tokens.index(first, i) if isinstance(tokens, list | tuple) else \
                list(tokens).index(first, i)
        except ValueError:
            return out
        if list(tokens[i:i + n]) == prefix:
            out.append(i)
            i += n
        else:
            i += 1


def plan_overflow(tokens: Sequence[int], max_tokens: int, max_context_tokens: int,
                  turn_prefix: Sequence[int]) -> OverflowPlan | None:
    """None when prompt + max_tokens fits; else drop the oldest whole turns (see module)."""
    if len(tokens) + max_tokens <= max_context_tokens:
        return None
    full = tuple(tokens)
    starts = find_turn_starts(full, turn_prefix)
    if not starts:  # no turn structure found: nothing can be dropped
        starts = [len(full)]
    drop_to = starts[0]
    for s in starts[1:]:  # never past the last turn start
        if len(full) - (drop_to - starts[0]) + max_tokens <= max_context_tokens:
            break
        drop_to = s
    return OverflowPlan(full, tuple(starts), drop_to, max_context_tokens, max_tokens)


def user_turn_prefix(tokenizer: ChatTokenizer) -> tuple[int, ...]:
    """The token ids that open a user message in the tokenizer's chat template: the
    template rendered for one user message, cut at the message text, from its last special
    token on (e.g. "<|im_start|>user"), trailing whitespace removed. Empty when no special
    token opens it (then no turn can be dropped)."""
    probe = "\x01probe\x01"
    text = tokenizer.render([("user", probe)])
    head = text[:text.index(probe)]
    specials = [t.content for t in tokenizer.tokenizer.get_added_tokens_decoder().values()]
    at = max((head.rfind(s) for s in specials if s), default=-1)
    if at < 0:
        return ()
    return tuple(tokenizer.tokenizer.encode(head[at:].rstrip(), add_special_tokens=False).ids)


def salted_parent(parent_hash: int) -> int:
    """Parent hash of the first block of an approximate (moved) chain: unrelated to every
    exact chain, the same in every process."""
    return xxhash.xxh3_64_intdigest(parent_hash.to_bytes(8, "little"), seed=0x5E1F7ED)


def layout_hashes(hasher: BlockHasher, tokens: Sequence[int], num_blocks: int,
                  gap_block: int, salted: bool) -> list[int]:
    """Hashes of the first `num_blocks` full blocks of `tokens`; with `salted`, the chain
    from block `gap_block` on is the approximate one (`salted_parent`)."""
    bs = hasher.block_size
    head = hasher.hash_blocks(list(tokens[:min(gap_block, num_blocks) * bs]))
    if num_blocks <= gap_block:
        return head
    parent = head[-1] if head else hasher.root_hash
    if salted:
        parent = salted_parent(parent)
    return head + hasher.hash_blocks(list(tokens[gap_block * bs:num_blocks * bs]),
                                     parent_hash=parent)


def shift_layouts(plan: OverflowPlan, hasher: BlockHasher, limit: int, max_layouts: int
                  ) -> list[tuple[int, list[int]]]:
    """(delta, chain) of the layouts the kept run of `plan` may be cached under (see the
    module): the undropped layout and the `max_layouts - 1` most recent drops, plain and
    salted, each chain cut to the blocks covering new positions below `limit`."""
    bs, gap = hasher.block_size, plan.n_keep // hasher.block_size
    layouts = plan.layouts()
    if len(layouts) > max_layouts:
        layouts = layouts[:1] + layouts[len(layouts) - max_layouts + 1:]
    out = []
    for start, delta in layouts:
        tokens = plan.layout(start)
        num_blocks = min(len(tokens) // bs, -(-(limit + delta) // bs))
        for salted in (False, True):
            if delta or salted:  # delta 0 plain is the exact prompt: the engine's own hit
                out.append((delta, layout_hashes(hasher, tokens, num_blocks, gap, salted)))
    return out
