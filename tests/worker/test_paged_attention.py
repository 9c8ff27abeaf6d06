"""Attention that never pads, differentially: every backend against transformers' own
forward (fp32, <= 1e-4), a mixed step against the same sequences run alone, the step
metadata contract, and the CPU decode kernel against the torch path (fp32 and bf16 KV)."""

from __future__ import annotations

import pytest
import torch

from prefixgate.worker.kernels import cpu_decode
from prefixgate.worker.kv_pool import KVPool
from prefixgate.worker.model_runner import ModelRunner, pool_config_for
from prefixgate.worker.paged_attention import BACKENDS, StepMetadata, torch_attention

CPU_BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_decode.available(), reason="no C compiler for the CPU decode kernel"))]


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (n,), generator=g).tolist()


class Seq:
    """A sequence run step by step on a runner, with a scattered block table."""

    def __init__(self, tokens: list[int], blocks: list[int]) -> None:
        self.tokens, self.blocks, self.done = tokens, blocks, 0


def _step(runner: ModelRunner, work: list[tuple[Seq, int]], backend: str) -> torch.Tensor:
    """Compute the next `n` tokens of each sequence in one step; logits of each's last."""
    ids: list[int] = []
    pos: list[int] = []
    last: list[int] = []
    for seq, n in work:
        ids += seq.tokens[seq.done:seq.done + n]
        pos += range(seq.done, seq.done + n)
        last.append(len(ids) - 1)
    step = StepMetadata.build(runner.pool, [s.blocks for s, _ in work],
                              [s.done + n for s, n in work], [n for _, n in work], backend)
    out = runner.forward(ids, pos, step, last)
    for seq, n in work:
        seq.done += n
    return out


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_mixed_steps_match_transformers(backend, tiny_model, tiny_reference_model) -> None:
    """Prefill chunks, decodes of different context lengths first in the batch, a whole
    prompt and a chunk after computed tokens, over scattered blocks of 8: every sampled
    row equals transformers' full forward of that prefix."""
    pool = KVPool(pool_config_for(tiny_model, 8, 64))
    runner = ModelRunner(tiny_model, pool)
    a = Seq(_tokens(45, 1), [7, 3, 30, 12, 5, 60])
    b = Seq(_tokens(30, 2), [1, 2, 40, 41])
    c = Seq(_tokens(31, 3), [9, 20, 21, 22, 50])
    schedule = [
        [(a, 17), (b, 22)],  # two prefill chunks
        [(b, 1), (a, 1), (c, 30)],  # two decodes, then a whole prompt
        [(a, 1), (b, 1), (c, 1)],  # decodes only, contexts 19, 24 and 31
        [(b, 1), (a, 21)],  # a decode and a chunk after 19 computed tokens
    ]
    got, want = [], []
    for work in schedule:
        got += _step(runner, work, backend)
        want += [(seq, seq.done) for seq, _ in work]
    with torch.inference_mode():
        for row, (seq, n) in zip(got, want, strict=True):
            ref = tiny_reference_model(input_ids=torch.tensor([seq.tokens[:n]])).logits[0, -1]
            torch.testing.assert_close(row, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_mixed_step_equals_the_same_sequences_alone(backend, tiny_model) -> None:
    """Decodes batched with a prefill chunk give the logits they give in steps of their
    own (no padding, nothing leaks between sequences)."""
    def run(together: bool) -> list[torch.Tensor]:
        pool = KVPool(pool_config_for(tiny_model, 16, 64))
        runner = ModelRunner(tiny_model, pool)
        seqs = [Seq(_tokens(80, 10 + i), list(range(6 * i, 6 * i + 6))) for i in range(4)]
        for s in seqs[:3]:
            _step(runner, [(s, 20 + 9 * seqs.index(s))], backend)
        _step(runner, [(seqs[3], 30)], backend)
        work = [(s, 1) for s in seqs[:3]] + [(seqs[3], 40)]
        if together:
            return list(_step(runner, work, backend))
        return [row for item in work for row in _step(runner, [item], backend)]
    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_step_metadata_contract(tiny_model) -> None:
    pool = KVPool(pool_config_for(tiny_model, 4, 32))
    step = StepMetadata.build(pool, [[3, 1], [7], [2, 9, 4]], [6, 1, 10], [1, 1, 5])
    assert step.cu_seqlens_q.tolist() == [0, 1, 2, 7]
    assert step.context_lens.tolist() == [6, 1, 10]
    assert step.block_tables.tolist() == [[3, 1, 0], [7, 0, 0], [2, 9, 4]]
    assert step.cu_seqlens_q.dtype == step.context_lens.dtype == step.block_tables.dtype \
        == torch.int32
    # Each new token's slot: its position's block * 4 + offset (positions 5; 0; 5..9).
    assert step.slot_mapping.tolist() == [1 * 4 + 1, 7 * 4, 9 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3,
                                          4 * 4, 4 * 4 + 1]
    assert (step.num_decodes, step.max_query_len, step.max_context_len) == (2, 5, 10)
    assert set(BACKENDS) >= {"torch", "cpu"}


@pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_matches_torch(dtype) -> None:
    """GQA 4:1, head_dim 48, blocks of 16, contexts from 1 to 3 blocks + a partial one."""
    g = torch.Generator().manual_seed(0)
    num_slots, kvh, heads, d = 64 * 16, 2, 8, 48
    pool = KVPool(pool_config_for_shape(kvh, d, 16, 64, dtype))
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    tables = torch.randperm(64, generator=g)[:20].view(5, 4).tolist()
    lens = [1, 16, 17, 40, 64]
    step = StepMetadata.build(pool, tables, lens, [1] * 5)
    q = torch.randn(5, heads, d, generator=g)
    got = cpu_decode.decode_attention(q, pool.k[0], pool.v[0], step.block_tables,
                                      step.context_lens, 16, d ** -0.5)
    want = torch_attention(q, pool.k[0], pool.v[0], step, d ** -0.5)
    assert num_slots == pool.config.num_tokens
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


def pool_config_for_shape(kvh: int, d: int, block_size: int, num_blocks: int,
                          dtype: torch.dtype):
    from prefixgate.worker.kv_pool import KVPoolConfig

    return KVPoolConfig(num_layers=1, num_kv_heads=kvh, head_dim=d, block_size=block_size,
                        num_blocks=num_blocks, dtype=dtype)
