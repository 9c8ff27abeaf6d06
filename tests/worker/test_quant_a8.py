"""The q4_1-a8 format (q4_1's weights, activations quantized to 8 bits per block of 32,
integer dot products: cpu_quant.q4_1_a8_linear / q8_0_a8_linear, the decode layers with
a8): the kernels against their torch reference on every path this CPU runs (AVX2 here,
and the AVX-512 build's code on SIMDe where the CPU lacks AVX-512), the error that the
activation quantization allows against the float32-activation product, the kernel and
prefill paths of a layer agreeing, the one-call decode layers against transformers'
forward of the same modules, and SmolLM2's greedy tokens against q4_1's."""

from __future__ import annotations

import pytest
import torch

from prefixgate.worker.kernels import cpu_quant
from prefixgate.worker.model_loader import (
    QUANT_KERNEL_MAX_ROWS,
    QuantLinear,
    WeightsConfig,
    load_model,
)
from tests.worker import test_quant

# The SIMDe AVX-512 build's fixtures (built once per module there).
emulated_avx512 = test_quant.emulated_avx512
on_emulated_avx512 = test_quant.on_emulated_avx512

pytestmark = pytest.mark.skipif(
    not cpu_quant.available(),
    reason=f"no q4_1 kernels here: {cpu_quant.kernel_reason()}")


def _inputs(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """m rows (row-strided, as the decode layers' are not), with an all-zero block (scale
    0) and an outlier block (one element 50x the rest) in the first row."""
    x = torch.randn(m, 2 * k, generator=g)[:, ::2]
    x[0, :32] = 0
    x[0, 40] = 50.0
    return x


def _check_against_reference(kind: str, threads: int) -> None:
    """Products equal quantize_activations(x) @ dequantized.T (the same codes; float32
    summation order: 1e-5 of the sum of |terms|), and differ from x @ dequantized.T by no
    more than the activation quantization allows: per block, half its step d times the
    block's sum of |w|."""
    g = torch.Generator().manual_seed(0)
    q8 = kind == "q8_0"
    n, k = 130, 96
    w = torch.randn(n, k, generator=g) * 0.1
    packed = (cpu_quant.pack_q8_0 if q8 else cpu_quant.pack_q4_1)(w)
    ref_w = cpu_quant.unpack_reference(packed, k, q8).double()
    linear = cpu_quant.q8_0_a8_linear if q8 else cpu_quant.q4_1_a8_linear
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2, 3, 4, 5, 8, 9, 33):
            x = _inputs(m, k, g)
            got = linear(x, packed, n).double()
            xq = cpu_quant.quantize_activations(x.contiguous()).double()
            magnitude = xq.abs() @ ref_w.abs().T
            assert ((got - xq @ ref_w.T).abs() <= 1e-5 * magnitude + 1e-6).all(), (kind, m)
            step = (x.reshape(m, k // 32, 32).abs().amax(-1) / 127).double()  # [m, blocks]
            bound = (step / 2) @ ref_w.abs().reshape(n, k // 32, 32).sum(-1).T
            exact = x.double() @ ref_w.T
            assert ((got - exact).abs() <= bound + 1e-5 * magnitude + 1e-6).all(), (kind, m)
            # and the quantization does move the result (a test of a lossy path that
            # could not tell it from the float one would prove nothing)
            assert float((got - exact).abs().max()) > 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a8_kernels_match_the_torch_reference(kind, threads) -> None:
    """The path this host runs (AVX2 on an AVX2-only CPU)."""
    _check_against_reference(kind, threads)


def test_a8_kernels_on_the_avx512_build_on_simde(on_emulated_avx512) -> None:
    """The AVX-512 build's library (its a8 products are the same 256-bit integer code,
    compiled with the rest of that build) where the CPU cannot run it natively."""
    for kind in ("q4_1", "q8_0"):
        for threads in (1, 2):
            _check_against_reference(kind, threads)


def test_quantize_activations_moves_each_element_by_at_most_half_a_step() -> None:
    g = torch.Generator().manual_seed(1)
    x = _inputs(3, 128, g).contiguous()
    xq = cpu_quant.quantize_activations(x)
    step = x.reshape(3, 4, 32).abs().amax(-1, keepdim=True) / 127
    assert ((xq - x).reshape(3, 4, 32).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(xq[0, :32], torch.zeros(32))  # a zero block stays zero
    codes = xq.reshape(3, 4, 32) / torch.where(step == 0, torch.ones_like(step), step)
    assert float((codes - codes.round()).abs().max()) < 1e-3
    assert float(codes.abs().max()) <= 127 + 1e-3


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a8_layer_kernel_rows_and_prefill_rows_agree(kind) -> None:
    """A q4_1-a8 layer quantizes its input rows on both of its paths (the kernel up to
    QUANT_KERNEL_MAX_ROWS rows, torch's GEMM on the dequantized weight beyond), so a row's
    result does not depend on the path it took."""
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(128, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 128, generator=g) * 0.1)
    layer = QuantLinear(lin, kind, a8=True)
    assert layer.a8
    x = torch.randn(QUANT_KERNEL_MAX_ROWS + 7, 128, generator=g)
    short = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    torch.testing.assert_close(short, layer(x), atol=1e-5, rtol=1e-5)
    deq = cpu_quant.unpack_reference(layer.packed, 128, kind == "q8_0")
    torch.testing.assert_close(layer(x), cpu_quant.quantize_activations(x) @ deq.T,
                               atol=1e-5, rtol=1e-5)


def test_q4_1_a8_is_an_option_not_the_default(tiny_spec) -> None:
    from prefixgate.worker.model_loader import default_weights

    assert WeightsConfig("q4_1-a8").compute_dtype == torch.float32
    model = load_model(tiny_spec, weights=WeightsConfig("q4_1-a8"))
    assert all(m.a8 for m in model.modules() if isinstance(m, QuantLinear))
    assert default_weights("cpu", tiny_spec) == "float32"


def test_llama_step_on_q4_1_a8_matches_transformers(tiny_spec) -> None:
    """The one-call decode layers with 8-bit activations compute what transformers'
    forward over the same q4_1-a8 modules does."""
    test_quant.test_llama_step_on_q4_1_matches_transformers(tiny_spec, "q4_1-a8")


def test_llama_step_on_q4_1_a8_on_simde(tiny_spec, on_emulated_avx512) -> None:
    test_quant.test_llama_step_on_q4_1_matches_transformers(tiny_spec, "q4_1-a8")


@pytest.mark.slow
def test_smollm2_q4_1_a8_greedy_tokens_follow_q4_1(smollm2_spec, smollm2_model) -> None:
    """Through the worker's engine (prefill through the dequantized GEMM on quantized
    rows, decode steps through the one-call decode layers and the a8 head), a short
    chat's greedy reply under q4_1-a8 against q4_1's (float32 activations, which is
    float32's on SmolLM2). 8-bit activations move each logit by a few hundredths
    (the fidelity figures: docs/bench/weights-avx2.md), so the replies agree while no two
    candidates are that close and may part after; expected: the first 16 of 24 tokens
    identical (a reply that parts earlier is a regression to look at, as is a reply
    identical to q4_1's on every prompt of the fidelity run: the a8 path would then not
    be running)."""
    from prefixgate.model.tokenizer import ChatTokenizer
    from tests.helpers import make_engine
    from tests.worker.test_engine import run

    chat = [("user", "Write two sentences about the sea.")]
    prompt = ChatTokenizer(smollm2_spec).encode_messages(chat)
    replies = []
    for fmt in ("q4_1", "q4_1-a8"):
        model = load_model(smollm2_spec, weights=WeightsConfig(fmt))
        engine = make_engine(smollm2_spec, model, enable_prefix_cache=False)
        replies.append(run(engine, prompt, max_tokens=24, rid="sea")[0])
        engine.shutdown()
    same = next((i for i, (a, b) in enumerate(zip(*replies, strict=False)) if a != b), len(replies[0]))
    assert len(replies[0]) == 24 and same >= 16, (same, replies)
