"""CPU kernels: matrix products against group-quantized weights (GGUF's Q4_1 and Q8_0).

The C is csrc/quant.c (the thread pool: csrc/pool.c), its signatures csrc/pg_kernels.h;
cbuild.py builds or finds the library. It runs on one of two vector paths, the one the
library was built for (cbuild.py picks the build for the CPU's features): AVX-512 (16
lanes) or AVX2 + FMA (8 lanes; many cloud AMD EPYC and Intel hosts have no AVX-512),
both with F16C;
with neither (or no library) the kernels are unavailable and `--weights auto` keeps
float32. `kernel_path()` names the path, `kernel_reason()` says why (also logged once).

Why: decoding at batch 1 streams every weight once per token, so its speed is the weight
bytes over the memory bandwidth. Q4_1 holds 32 weights in 20 bytes (0.625 B/weight,
float32 holds 4), Q8_0 in 34 (1.0625): GGUF's own blocks, byte for byte. On a model
shipped as a GGUF in those formats (the built-in SmolLM2 is), the float32 reference
weights are these blocks dequantized, so the blocks carry exactly the reference values:
the products below equal the float32 ones up
to float32 summation order.

Layouts (GGUF's block_q4_1 / block_q8_0; one row per output feature, rows of `K // 32`
blocks, K a multiple of 32):
  Q4_1  block = float16 d, float16 m, 16 bytes q: weight j of the block is
        d * q_j + m, q_j = low nibble of byte j (j < 16) / high nibble of byte j - 16;
        a [N, K // 32 * 20] uint8 tensor.
  Q8_0  block = float16 d, 32 int8 q: weight j = d * q_j; a [N, K // 32 * 34] uint8 tensor.
(Float16 scales, converted by F16C in the kernels: at batch 1 the weight bytes are the
step's cost, and float32 scales would stream 20 % more of them per Q4_1 block.)

Contract: `q4_1_linear(x, packed, n)` / `q8_0_linear(x, packed, n)`: x [M, K] float32
(rows contiguous) -> [M, N] float32 = x @ dequantized(packed).T. `q4_1_a8_linear` /
`q8_0_a8_linear` (the q4_1-a8 format): the same with x quantized to 8 bits per block of
32 first, as llama.cpp does (its Q8_1: d = max |x| / 127, int8 codes, and the block's
d * sum of codes for Q4_1's minimum), the products integer dot products (maddubs):
= quantize_activations(x) @ dequantized(packed).T up to float32 summation order, half
the instructions per block of the float path, lossy against it (each activation moves
by up to half its block's step; the fidelity bar decides where that is acceptable). `dequantize_q4_1` and
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
Q4_1_BYTES = 20
Q8_0_BYTES = 34
# How long an idle pool thread spins before it sleeps. 200 us covers the gap between two
# kernel calls of a decode step (Python and torch work of a few to ~100 us); the gap
# between steps (sampling, scheduling, gRPC) is longer, and there the threads sleep.
SPIN_US = int(os.environ.get("PREFIXGATE_KERNEL_SPIN_US", "200"))

_lib: ctypes.CDLL | None = None
_path: str | None = None
_reason = ""
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
    global _lib, _path, _reason, _tried
    with _lock:
        if not _tried:
            _tried = True
            _lib = _build()
            built = runs = None
            if _lib is not None:
                built = cbuild.quant_path_name(_lib.pg_quant_built())
                runs = cbuild.quant_path_name(_lib.pg_quant_path())
            _path = runs
            _reason = explain(cbuild.cpu_features(), _lib is not None, built, runs)
            if runs is None:
                log.info("q4_1 kernels unavailable: %s; the float32 weights serve "
                         "(--weights auto picks float32, --weights q4_1 refuses)", _reason)
            else:
                log.info("q4_1 kernels: %s path (%s)", runs, _reason)
    return _lib


def available() -> bool:
    """Whether the quantized kernels run here: the library loads and holds a vector path
    this CPU runs (AVX-512 or AVX2 + FMA; without one it holds only the decode
    attention)."""
    library()
    return _path is not None


def kernel_path() -> str | None:
    """The quantized kernels' vector path here ("avx512", "avx2"), or None."""
    library()
    return _path


def kernel_reason() -> str:
    """Why `kernel_path()` is what it is (the CPU's features, the library's build)."""
    library()
    return _reason


def explain(features: frozenset[str], loaded: bool, built: str | None, runs: str | None
            ) -> str:
    """Why a host runs the `runs` path (None: none) given the CPU's `features`, whether
    the library `loaded`, and the path it was `built` for (cbuild.QUANT_PATHS names)."""
    best = cbuild.expected_quant_path(features)
    if runs == "avx512":
        return "the CPU has AVX-512 (avx512f, f16c)"
    if runs == "avx2":
        if best == "avx512":
            return ("the CPU has AVX-512, but the library was built without it (a compiler "
                    "or prebuilt variant without x86-64-v4); AVX2 + FMA instead")
        return "the CPU has AVX2, FMA and F16C, no AVX-512 (avx512f)"
    if not loaded:
        return ("the CPU kernel library is unavailable (no C compiler and no prebuilt "
                "library, or its build failed: see the log)")
    if best is None:
        missing = sorted(cbuild.QUANT_PATHS["avx2"][1] - features)
        return (f"the CPU has neither AVX-512 nor AVX2 + FMA + F16C (lacks "
                f"{', '.join(missing)})")
    if built is None:
        return (f"the library was built without a quantized path (the CPU runs {best}, "
                f"the compiler or prebuilt variant did not target it)")
    return f"the library holds the {built} path, whose instructions this CPU lacks (cpuid)"


def _lib_or_raise() -> ctypes.CDLL:
    if not available():
        raise RuntimeError(f"the CPU quantized-weight kernels are unavailable: {_reason}")
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


def q4_1_a8_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """`q4_1_linear` with x's rows quantized to 8 bits per block of 32 first
    (`quantize_activations`: llama.cpp's Q8_1), integer dot products: lossy."""
    return _gemm("pg_q4_1_a8_gemm", x, packed, n)


def q8_0_a8_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return _gemm("pg_q8_0_a8_gemm", x, packed, n)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 as the 8-bit activation kernels see it (torch; their reference
    and the prefill path of the q4_1-a8 format): per block of 32, d = max |x| / 127,
    codes round(x * (1 / d)) (ties to even), returned dequantized (codes * d). Each
    element moves at most d / 2."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))
    return (torch.round(blocks * inv) * d).reshape(m, k)


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
    """float32 [N, K] -> Q4_1 blocks [N, K // 32 * 20] uint8 (llama.cpp's quantizer)."""
    blocks = _blocks(w)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    m = _f16(lo)
    d = _f16((hi - m) / 15)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round((blocks - m[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # byte j: weight j (low), j + 16 (high)
    head = torch.stack([d, m], -1).to(torch.float16).contiguous().view(torch.uint8)  # [N, nb, 4]
    return torch.cat([head, nibbles], -1).reshape(w.shape[0], -1).contiguous()


def pack_q8_0(w: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> Q8_0 blocks [N, K // 32 * 34] uint8 (llama.cpp's quantizer)."""
    blocks = _blocks(w)
    d = _f16(blocks.abs().amax(-1) / 127)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int8)
    head = d[..., None].to(torch.float16).contiguous().view(torch.uint8)  # [N, nb, 2]
    return torch.cat([head, q.view(torch.uint8)], -1).reshape(w.shape[0], -1).contiguous()


def unpack_reference(packed: torch.Tensor, k: int, q8: bool) -> torch.Tensor:
    """The float32 weight the blocks stand for, in torch (the kernels' reference)."""
    n = packed.shape[0]
    size = Q8_0_BYTES if q8 else Q4_1_BYTES
    blocks = packed.reshape(n, k // BLOCK, size)
    if q8:
        d = blocks[..., :2].contiguous().view(torch.float16).float()
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, k)
    dm = blocks[..., :4].contiguous().view(torch.float16).float()
    nib = blocks[..., 4:]
    q = torch.cat([nib & 15, nib >> 4], -1).float()
    return (q * dm[..., :1] + dm[..., 1:]).reshape(n, k)
