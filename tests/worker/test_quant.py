"""The q4_1 weight format: the quantized kernels against their torch reference (every
vector path the CPU runs: AVX-512 and AVX2 + FMA where it has AVX-512, AVX2 + FMA on an
AVX2-only CPU, and there the AVX-512 path's code too, built on SIMDe's portable AVX-512
intrinsics: kernels, the Llama step's one-call decode layers, SmolLM2's chat;
dequantization exact, products to float32 rounding), packing
that recovers GGUF blocks exactly, the worker's own Llama step (`LlamaStep`) on q4_1
weights against transformers' forward of the same weights, greedy tokens with and
without the prefix cache, and on SmolLM2: lossless against float32 (its GGUF's blocks),
paged logits within float32 rounding of the float32 path's, and a short chat's greedy
replies identical to float32's."""

from __future__ import annotations

import pytest
import torch

from prefixgate.worker.kernels import cbuild, cpu_quant
from prefixgate.worker.model_loader import (
    QUANT_KERNEL_MAX_ROWS,
    QuantLinear,
    WeightsConfig,
    default_weights,
    load_model,
)

pytestmark = pytest.mark.skipif(
    not cpu_quant.available(),
    reason=f"no q4_1 kernels here: {cpu_quant.kernel_reason()}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_kernels_match_the_torch_reference(kind, threads) -> None:
    """The path this host runs (cbuild's choice for its CPU)."""
    _check_against_reference(kind, threads)


@pytest.mark.skipif(cbuild._compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("variant", ["x86-64-v4", "x86-64-v3"])
def test_every_path_this_cpu_runs_matches_the_reference(variant, tmp_path, monkeypatch) -> None:
    """Each portable build whose instructions the CPU has (x86-64-v4: the AVX-512 path,
    x86-64-v3: AVX2 + FMA), loaded in place of this host's library."""
    needs, flags = cbuild.VARIANTS[variant]
    if not needs <= cbuild.cpu_features():
        pytest.skip(f"the CPU lacks {', '.join(sorted(needs - cbuild.cpu_features()))}")
    cbuild.compile_library(tmp_path / "lib.so", flags, cbuild._compiler())
    lib = cbuild._bind(tmp_path / "lib.so")
    path = cbuild.quant_path_name(lib.pg_quant_path())
    assert path == cbuild.VARIANT_PATH[variant]
    monkeypatch.setattr(cpu_quant, "_lib", lib)
    monkeypatch.setattr(cpu_quant, "_path", path)
    for kind in ("q4_1", "q8_0"):
        for threads in (1, 2):
            _check_against_reference(kind, threads)


@pytest.fixture(scope="module")
def emulated_avx512(tmp_path_factory):
    """The AVX-512 path's code built on SIMDe for this CPU without AVX-512
    (cbuild.EMULATED_AVX512), once per module."""
    cc, features = cbuild._compiler(), cbuild.cpu_features()
    if cc is None:
        pytest.skip("no C compiler")
    if "avx512f" in features:
        pytest.skip("the CPU has AVX-512: its x86-64-v4 build runs the AVX-512 path natively")
    if not cbuild.VARIANTS["x86-64-v3"][0] <= features:
        pytest.skip("the emulated AVX-512 build targets x86-64-v3, which this CPU lacks")
    if not cbuild.has_simde(cc):
        pytest.skip("SIMDe's headers are missing (Debian: apt-get install libsimde-dev), so "
                    "the AVX-512 path is untested on this CPU without AVX-512")
    path = tmp_path_factory.mktemp("simde") / "lib.so"
    cbuild.compile_library(path, cbuild.EMULATED_AVX512, cc)
    lib = cbuild._bind(path)
    lib.pg_set_spin_us(cpu_quant.SPIN_US)
    # It holds the AVX-512 path's code, and runs it here.
    assert cbuild.quant_path_name(lib.pg_quant_built()) == "avx512"
    assert cbuild.quant_path_name(lib.pg_quant_path()) == "avx512"
    return lib


@pytest.fixture
def on_emulated_avx512(emulated_avx512, monkeypatch):
    """cpu_quant (and so QuantLinear and the decode layers) on the emulated library."""
    cpu_quant.library()  # the host's library is loaded first, then stood in for
    monkeypatch.setattr(cpu_quant, "_lib", emulated_avx512)
    monkeypatch.setattr(cpu_quant, "_path", "avx512")
    assert cpu_quant.library() is emulated_avx512 and cpu_quant.kernel_path() == "avx512"
    return emulated_avx512


def test_the_avx512_path_on_simde_matches_the_reference(on_emulated_avx512) -> None:
    """The AVX-512 code (block offsets, the permute table, the 16-lane tails, F16C
    scales) where the CPU cannot run it natively."""
    for kind in ("q4_1", "q8_0"):
        for threads in (1, 2):
            _check_against_reference(kind, threads)


def test_the_avx512_path_on_simde_runs_the_llama_step(tiny_spec, on_emulated_avx512) -> None:
    """The one-call decode layers and the q4_1 modules on the AVX-512 code."""
    test_llama_step_on_q4_1_matches_transformers(tiny_spec)


def test_the_avx512_path_on_simde_chats_like_float32(smollm2_spec, smollm2_model,
                                                     on_emulated_avx512) -> None:
    """SmolLM2 under q4_1 on the AVX-512 code: a short chat's greedy replies are
    float32's."""
    _chat_equals_float32(smollm2_spec, smollm2_model,
                         load_model(smollm2_spec, weights=WeightsConfig("q4_1")))


def _check_against_reference(kind: str, threads: int) -> None:
    """N = 130 (not a multiple of the 64-row work slices), K = 96; row counts around the
    kernels' 4- and 8-row passes; a row-strided input. Dequantization is exact; products
    equal x @ dequantized.T to float32 rounding."""
    g = torch.Generator().manual_seed(0)
    q8 = kind == "q8_0"
    w = torch.randn(130, 96, generator=g) * 0.1
    packed = (cpu_quant.pack_q8_0 if q8 else cpu_quant.pack_q4_1)(w)
    ref_w = cpu_quant.unpack_reference(packed, 96, q8)
    # llama.cpp's quantizer error bound: half a step per weight.
    step = (w.abs().amax() / 127) if q8 else (w.amax() - w.amin()) / 15
    assert float((ref_w - w).abs().max()) <= float(step) / 2 + 1e-6
    deq = cpu_quant.dequantize_q8_0 if q8 else cpu_quant.dequantize_q4_1
    linear = cpu_quant.q8_0_linear if q8 else cpu_quant.q4_1_linear
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(deq(packed, 96), ref_w)
        for m in (1, 2, 3, 4, 5, 8, 9, 33):
            x = torch.randn(m, 2 * 96, generator=g)[:, ::2]  # strided rows: copied first
            torch.testing.assert_close(linear(x, packed, 130), x @ ref_w.T, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_packing_recovers_blocks_exactly(kind) -> None:
    """Weights that are blocks dequantized (a GGUF model's float32 weights) pack back to
    the same blocks: the format is lossless on them."""
    q8 = kind == "q8_0"
    pack = cpu_quant.pack_q8_0 if q8 else cpu_quant.pack_q4_1
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    w[0, :32] = 0.25  # a constant block: scale 0
    packed = pack(w)
    deq = cpu_quant.unpack_reference(packed, 128, q8)
    assert torch.equal(pack(deq), packed)
    layer = QuantLinear(torch.nn.Linear(128, 64, bias=False).requires_grad_(False), kind)
    layer.packed = packed
    x = torch.randn(QUANT_KERNEL_MAX_ROWS + 7, 128)
    # Kernel rows (short inputs) and the dequantized GEMM (long ones) agree.
    short = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    torch.testing.assert_close(short, layer(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x), x @ deq.T, atol=1e-5, rtol=1e-5)


def test_llama_step_on_q4_1_matches_transformers(tiny_spec, fmt: str = "q4_1") -> None:
    """The worker's step (fused q|k|v and gate|up, paged attention, decodes and a chunk in
    one step) equals transformers' forward over the same q4_1 (or `fmt`) modules, to
    1e-4."""
    from prefixgate.worker.kv_pool import KVPool
    from prefixgate.worker.model_runner import ModelRunner, pool_config_for
    from prefixgate.worker.paged_attention import StepMetadata, resolve_backend

    model = load_model(tiny_spec, weights=WeightsConfig(fmt))
    reference = load_model(tiny_spec, weights=WeightsConfig(fmt))
    pool = KVPool(pool_config_for(model, 8, 32))
    runner = ModelRunner(model, pool)
    assert runner.fast is not None
    backend = resolve_backend("auto", pool, model.config.num_attention_heads)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(3, 259, (40,), generator=g).tolist(), \
        torch.randint(3, 259, (25,), generator=g).tolist()
    ta, tb = [3, 9, 1, 20, 7, 12], [11, 4, 30, 2]
    step = StepMetadata.build(pool, [ta], [39], [39], backend)
    runner.forward(a[:39], list(range(39)), step, [38])
    step = StepMetadata.build(pool, [ta, tb], [40, 25], [1, 25], backend)
    got = runner.forward([a[39]] + b, [39, *range(25)], step, [0, 25])
    # Decodes only: all layers in one C call (kernels/cpu_llama.py) on the CPU backend.
    assert runner.fast.plan is not None and runner.fast.plan.a8 == (fmt == "q4_1-a8")
    assert (backend != "cpu" or runner.fast.plan.runs(
        StepMetadata.build(pool, [ta, tb], [41, 26], [1, 1], backend), pool))
    a, b = a + [17], b + [23]
    step = StepMetadata.build(pool, [ta, tb], [41, 26], [1, 1], backend)
    got = torch.cat([got, runner.forward([a[40], b[25]], [40, 25], step, [0, 1])])
    with torch.inference_mode():
        want = torch.stack([reference(input_ids=torch.tensor([s])).logits[0, -1]
                            for s in (a[:40], b[:25], a, b)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_q4_1_greedy_equal_with_and_without_cache(tiny_spec) -> None:
    from tests.helpers import make_engine
    from tests.worker.test_engine import assert_no_leak, prompts, run

    model = load_model(tiny_spec, weights=WeightsConfig("q4_1"))
    cached = make_engine(tiny_spec, model)
    uncached = make_engine(tiny_spec, model, enable_prefix_cache=False)
    for i, p in enumerate(prompts(3, seed=5)):
        out, _ = run(cached, p, rid=f"a{i}")
        assert out == run(uncached, p, rid=f"b{i}")[0]
        turn2 = p + out + [5, 6, 7]
        out2, final = run(cached, turn2, rid=f"c{i}")
        assert out2 == run(uncached, turn2, rid=f"d{i}")[0] and final.cached_tokens > 0
    assert_no_leak(cached)
    cached.shutdown()
    uncached.shutdown()


def test_q4_1_is_the_cpu_default_only_where_lossless(tiny_spec) -> None:
    assert default_weights("cpu", tiny_spec) == "float32"  # no GGUF: 4-bit would be lossy
    assert default_weights("cpu") == "float32"
    assert WeightsConfig("q4_1").compute_dtype == torch.float32


@pytest.mark.slow
def test_smollm2_q4_1_is_lossless_and_matches_float32(smollm2_spec, smollm2_model) -> None:
    """SmolLM2's GGUF is Q4_1 (layers) + Q8_0 (tied head): q4_1 recovers those blocks
    exactly, is the CPU default, and its paged logits equal the float32 paged path's up
    to float32 summation order (tolerance 1e-3 absolute on logits of magnitude ~30)."""
    from prefixgate.model.tokenizer import ChatTokenizer
    from tests.worker.test_weights import _paged_logits

    assert default_weights("cpu", smollm2_spec) == "q4_1"
    model = load_model(smollm2_spec, weights=WeightsConfig("auto"))
    assert isinstance(model.lm_head, QuantLinear) and model.quantization_error == 0.0
    ids = ChatTokenizer(smollm2_spec).encode_messages([
        ("user", "What is the capital of France, and why is it famous?")])
    want = _paged_logits(smollm2_model, ids)
    got = _paged_logits(model, ids)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    # Decode-sized steps take the kernels (prefill above took the dequantized GEMM).
    from prefixgate.worker.kv_pool import KVPool
    from prefixgate.worker.model_runner import ModelRunner, pool_config_for
    from prefixgate.worker.paged_attention import StepMetadata, resolve_backend

    outs = []
    for m in (smollm2_model, model):
        pool = KVPool(pool_config_for(m, 16, 8))
        runner = ModelRunner(m, pool)
        rows = []
        for i, t in enumerate(ids[:12]):
            step = StepMetadata.build(pool, [list(range(8))], [i + 1], [1],
                                      resolve_backend("auto", pool, 9))
            rows.append(runner.forward([t], [i], step, [0]))
        outs.append(torch.cat(rows))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-3, rtol=0)

    _chat_equals_float32(smollm2_spec, smollm2_model, model)


def _chat_equals_float32(smollm2_spec, smollm2_model, model) -> None:
    """A short chat's greedy replies (the worker's engine: prefill through the dequantized
    GEMM, decode steps through the one-call decode layers on the kernels' path) under
    q4_1 are float32's, token for token."""
    from prefixgate.model.tokenizer import ChatTokenizer
    from tests.helpers import make_engine
    from tests.worker.test_engine import run

    chat = [("user", "Write two sentences about the sea.")]
    replies = []
    for m in (smollm2_model, model):
        engine = make_engine(smollm2_spec, m, enable_prefix_cache=False)
        prompt = ChatTokenizer(smollm2_spec).encode_messages(chat)
        replies.append(run(engine, prompt, max_tokens=24, rid="sea")[0])
        engine.shutdown()
    assert replies[1] == replies[0] and len(replies[0]) > 8
