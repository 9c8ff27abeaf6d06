"""The Triton paged-attention backend against the torch backend, in the Triton interpreter
(TRITON_INTERPRET=1, set in conftest): decode batches and variable-length prefill chunks
after cached context, GQA and plain multi-head, ragged lengths across block boundaries,
float32 and bfloat16 KV, a head_dim that is not a power of two. Shapes are kept small:
the interpreter runs every program in Python."""

from __future__ import annotations

import pytest
import torch

from prefixgate.worker.kv_pool import KVPool, KVPoolConfig
from prefixgate.worker.paged_attention import BACKENDS, StepMetadata, torch_attention

triton_kernels = pytest.importorskip("prefixgate.worker.kernels.paged_attention_triton")


def _case(heads: int, kv_heads: int, head_dim: int, block_size: int,
          seqs: list[tuple[int, int]], kv_dtype: torch.dtype, seed: int = 0):
    """`seqs`: (query_len, context_len) per sequence, decodes first. Random pool contents,
    block tables drawn from a shuffled pool (so neighbours in a sequence are not
    neighbours in memory)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for _, c in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    pool = KVPool(KVPoolConfig(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim,
                               block_size=block_size, num_blocks=num_blocks, dtype=kv_dtype))
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in blocks_per_seq:
        tables.append(order[at:at + n])
        at += n
    step = StepMetadata.build(pool, tables, [c for _, c in seqs], [q for q, _ in seqs])
    num_tokens = sum(q for q, _ in seqs)
    # A [1, H, T, D] query seen as [T, H, D], as transformers hands it over (strided).
    query = torch.randn(1, heads, num_tokens, head_dim, generator=g)[0].transpose(0, 1)
    return pool, step, query


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "seqs", "kv_dtype"), [
    # decodes only: GQA 3:1, contexts 1, a full block, one past it, several blocks
    (6, 2, 32, 16, [(1, 1), (1, 16), (1, 17), (1, 70)], torch.float32),
    # mixed: two decodes, a chunk after cached context, a whole prompt, a 1-token prefill
    (4, 2, 16, 8, [(1, 9), (1, 33), (20, 37), (23, 23), (1, 5)], torch.float32),
    # plain multi-head, head_dim not a power of two, a chunk spanning two query tiles
    (2, 2, 24, 16, [(1, 40), (70, 75)], torch.float32),
    # bfloat16 KV, GQA 4:1
    (8, 2, 16, 16, [(1, 31), (1, 48), (17, 50)], torch.bfloat16),
])
def test_triton_backend_matches_torch(heads, kv_heads, head_dim, block_size, seqs, kv_dtype
                                      ) -> None:
    pool, step, query = _case(heads, kv_heads, head_dim, block_size, seqs, kv_dtype)
    scale = head_dim ** -0.5
    got = triton_kernels.triton_attention(query, pool.k[0], pool.v[0], step, scale)
    want = torch_attention(query, pool.k[0], pool.v[0], step, scale)
    assert got.shape == want.shape and got.dtype == query.dtype and got.is_contiguous()
    # Both upcast the KV to float32 and reduce in float32: only summation order differs.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_triton_registers_as_a_backend() -> None:
    assert BACKENDS["triton"] is triton_kernels.triton_attention
