"""CPU kernels: matrix products against group-quantized weights (GGUF's Q4_1 and Q8_0).

The C is csrc/quant.c (the thread pool: csrc/pool.c), its signatures csrc/pg_kernels.h;
cbuild.py builds or finds the library.

Why: decoding at batch 1 streams every weight once per token, so its speed is the weight
bytes over the memory bandwidth. Q4_1 holds 32 weights in 24 bytes here (0.75 B/weight,
float32 holds 4), Q8_0 in 36 (1.125). On a model shipped as a GGUF in those formats (the
built-in SmolLM2 is), the float32 reference weights are these blocks dequantized, so the
blocks carry exactly the reference values: the products below equal the float32 ones up
to float32 summation order.

Layouts (one row per output feature, rows of `K // 32` blocks, K a multiple of 32):
  Q4_1  block = float32 d, float32 m, 16 bytes q: weight j of the block is
        d * q_j + m, q_j = low nibble of byte j (j < 16) / high nibble of byte j - 16
        (GGUF's order); a [N, K // 32 * 24] uint8 tensor.
  Q8_0  block = float32 d, 32 int8 q: weight j = d * q_j; a [N, K // 32 * 36] uint8 tensor.
(GGUF stores d and m as float16; float32 here costs 4 bytes per block and saves a
conversion per block in the inner loop.)

Contract: `q4_1_linear(x, packed, n)` / `q8_0_linear(x, packed, n)`: x [M, K] float32
(rows contiguous) -> [M, N] float32 = x @ dequantized(packed).T. `dequantize_q4_1` and
`dequantize_q8_0` return the float32 weight [N, K] (the prefill path: a long chunk
multiplies faster through torch's GEMM on a dequantized copy). `pack_q4_1` / `pack_q8_0`
(torch, no kernel) quantize a float32 weight the way llama.cpp does (Q4_1: min and
(max - min) / 15 per block; Q8_0: max |w| / 127; d and m rounded to float16 as GGUF stores
them) and return the packed tensor; on weights that are already such blocks dequantized
(a GGUF model's) this recovers the blocks exactly, which `load_model` verifies.

Threads: work (64-row slices of N) is spread over `torch.get_num_threads()` threads of a
pool the library keeps (started on first use). Between calls a pool thread spins for
about `SPIN_US` microseconds, then sleeps on a futex: a decode step makes ~150 calls a
few tens of microseconds apart, so a short spin keeps each wake-up off the critical path,
while a thread that is not needed soon gives its core back (on a loaded machine spinning
steals the slices the working threads need). No OpenMP: a second runtime beside torch's
would spin against it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from prefixgate.worker.kernels import cbuild

log = logging.getLogger(__name__)

BLOCK = 32
Q4_1_BYTES = 24
Q8_0_BYTES = 36
# How long an idle pool thread spins before it sleeps. 200 us covers the gap between two
# kernel calls of a decode step (Python and torch work of a few to ~100 us); the gap
# between steps (sampling, scheduling, gRPC) is longer, and there the threads sleep.
SPIN_US = int(os.environ.get("PREFIXGATE_KERNEL_SPIN_US", "200"))

_lib: ctypes.CDLL | None = None
_avx512 = False
_tried = False
_lock = threading.Lock()


def _build() -> ctypes.CDLL | None:
    lib = cbuild.load()  # csrc/*.c; signatures from csrc/pg_kernels.h
    if lib is not None:
        lib.pg_set_spin_us(SPIN_US)
    return lib


def library() -> ctypes.CDLL | None:
    """The CPU kernel library (csrc/: this module's kernels, the decode attention of
    cpu_decode.py, the decode layers of cpu_llama.py, one thread pool), loaded or built
    on the first call (cbuild.py); None without it."""
    global _lib, _avx512, _tried
    with _lock:
        if not _tried:
            _tried = True
            _lib = _build()
            _avx512 = _lib is not None and bool(_lib.pg_has_avx512())
    return _lib


def available() -> bool:
    """Whether the quantized kernels run here: the library builds and the CPU has
    AVX-512 (without it the library holds only the decode attention)."""
    library()
    return _avx512


def _lib_or_raise() -> ctypes.CDLL:
    if not available():
        raise RuntimeError("the CPU quantized-weight kernels are unavailable: no C compiler "
                           "or no AVX-512 (see the log)")
    assert _lib is not None
    return _lib


def _gemm(fn_name: str, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    lib = _lib_or_raise()
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        x = x.float().contiguous()
    m, k = x.shape
    out = torch.empty((m, n), dtype=torch.float32)
    rc = getattr(lib, fn_name)(x.data_ptr(), x.stride(0), m, k, n, packed.data_ptr(),
                               out.data_ptr(), n, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    return out


def q4_1_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return _gemm("pg_q4_1_gemm", x, packed, n)


def q8_0_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return _gemm("pg_q8_0_gemm", x, packed, n)


def _dequantize(packed: torch.Tensor, k: int, q8: bool, out: torch.Tensor | None
                ) -> torch.Tensor:
    lib = _lib_or_raise()
    n = packed.shape[0]
    if out is None:
        out = torch.empty((n, k), dtype=torch.float32)
    assert out.shape == (n, k) and out.dtype == torch.float32 and out.is_contiguous()
    lib.pg_dequantize(packed.data_ptr(), out.data_ptr(), k, n, int(q8), torch.get_num_threads())
    return out


def dequantize_q4_1(packed: torch.Tensor, k: int, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """The float32 weight [N, K], into `out` when given (a reused buffer)."""
    return _dequantize(packed, k, False, out)


def dequantize_q8_0(packed: torch.Tensor, k: int, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    return _dequantize(packed, k, True, out)


# --- packing (torch only) -------------------------------------------------------------

def _blocks(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"in_features {k} is not a multiple of {BLOCK}")
    return w.detach().float().reshape(n, k // BLOCK, BLOCK)


def _f16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).float()


def pack_q4_1(w: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> Q4_1 blocks [N, K // 32 * 24] uint8 (llama.cpp's quantizer)."""
    blocks = _blocks(w)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    m = _f16(lo)
    d = _f16((hi - m) / 15)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round((blocks - m[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # byte j: weight j (low), j + 16 (high)
    head = torch.stack([d, m], -1).contiguous().view(torch.uint8)  # [N, nb, 8]
    return torch.cat([head, nibbles], -1).reshape(w.shape[0], -1).contiguous()


def pack_q8_0(w: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> Q8_0 blocks [N, K // 32 * 36] uint8 (llama.cpp's quantizer)."""
    blocks = _blocks(w)
    d = _f16(blocks.abs().amax(-1) / 127)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int8)
    head = d[..., None].contiguous().view(torch.uint8)  # [N, nb, 4]
    return torch.cat([head, q.view(torch.uint8)], -1).reshape(w.shape[0], -1).contiguous()


def unpack_reference(packed: torch.Tensor, k: int, q8: bool) -> torch.Tensor:
    """The float32 weight the blocks stand for, in torch (the kernels' reference)."""
    n = packed.shape[0]
    size = Q8_0_BYTES if q8 else Q4_1_BYTES
    blocks = packed.reshape(n, k // BLOCK, size)
    if q8:
        d = blocks[..., :4].contiguous().view(torch.float32)
        q = blocks[..., 4:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, k)
    dm = blocks[..., :8].contiguous().view(torch.float32)
    nib = blocks[..., 8:]
    q = torch.cat([nib & 15, nib >> 4], -1).float()
    return (q * dm[..., :1] + dm[..., 1:]).reshape(n, k)
