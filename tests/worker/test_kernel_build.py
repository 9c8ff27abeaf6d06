"""The CPU kernel library as files: csrc/*.c and the ABI header pg_kernels.h.

The header is the one place a signature is written (the ctypes types are read from it),
so it must declare exactly what the library exports; every build treats warnings as
errors; portable variants prebuilt for an image are found by the hash of the sources
(a stale prebuilt library is never used), and the cache key is the sources, flags,
compiler and CPU features, not the host's name. The q4_1 kernels' path follows the CPU:
the variant chosen for an AVX-512, an AVX2-only and an older CPU (their /proc/cpuinfo
flags), the library's own report, and the reason logged when there is none."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest

from prefixgate.worker.kernels import cbuild

needs_cc = pytest.mark.skipif(cbuild._compiler() is None, reason="no C compiler")


def _exports(path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True,
                         text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if " T " in line}


def test_header_signatures() -> None:
    sigs = cbuild.signatures()
    assert set(sigs) == {"pg_set_spin_us", "pg_quant_path", "pg_quant_built", "pg_q4_1_gemm",
                         "pg_q8_0_gemm", "pg_q4_1_a8_gemm", "pg_q8_0_a8_gemm",
                         "pg_dequantize", "pg_decode_attention", "pg_decode_layers"}
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    assert sigs["pg_set_spin_us"] == (None, [i])
    assert sigs["pg_quant_path"] == sigs["pg_quant_built"] == (i, [])
    assert sigs["pg_q4_1_gemm"] == sigs["pg_q4_1_a8_gemm"] == sigs["pg_q8_0_a8_gemm"] == (
        i, [p, i64, i, i, i, p, p, i64, i])
    assert sigs["pg_decode_attention"] == (i, [p, i64, i64, p, p, i64, i, p, i64, p, p, i, i,
                                               i, i, i, f, i])
    assert len(sigs["pg_decode_layers"][1]) == 24


def test_a_type_without_a_mapping_is_refused(tmp_path) -> None:
    header = tmp_path / "h.h"
    header.write_text("PG_API int pg_f(double x);\n")
    with pytest.raises(ValueError, match="double"):
        cbuild.signatures(header)


@needs_cc
@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm")
def test_every_variant_builds_warning_free_and_exports_the_header_alone(tmp_path) -> None:
    built = cbuild.prebuild(tmp_path)
    assert [p.name.split("-")[1] for p in built] == ["x86", "x86", "baseline"]
    for path, variant in zip(built, cbuild.VARIANTS, strict=True):
        assert _exports(path) == set(cbuild.signatures()), path.name
        # Which path each holds (callable on any CPU: it only reports the build).
        held = cbuild.quant_path_name(ctypes.CDLL(str(path)).pg_quant_built())
        assert held == {"x86-64-v4": "avx512", "x86-64-v3": "avx2", "baseline": None}[variant]


@needs_cc
def test_warnings_are_errors(tmp_path, monkeypatch) -> None:
    (tmp_path / "w.c").write_text("int pg_unused(void) { int x; return 0; }\n")
    monkeypatch.setattr(cbuild, "sources", lambda: [tmp_path / "w.c"])
    with pytest.raises(subprocess.CalledProcessError) as info:
        cbuild.compile_library(tmp_path / "w.so", (), cbuild._compiler())
    assert "unused variable" in info.value.stderr and "-Werror" in info.value.cmd


@needs_cc
def test_prebuilt_library_is_used_only_for_these_sources(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PREFIXGATE_KERNEL_DIR", str(tmp_path))
    (baseline,) = [p for p in cbuild.prebuild(tmp_path) if "baseline" in p.name]
    monkeypatch.setattr(cbuild, "cpu_features", lambda: frozenset())  # a CPU of no extras
    assert cbuild._prebuilt() == baseline
    lib = cbuild.load()
    assert lib is not None and lib.pg_quant_path() == 0 and lib.pg_q4_1_gemm(
        None, 0, 0, 32, 0, None, None, 0, 1) == -2  # no quantized path: refused, not run
    assert lib.pg_q4_1_a8_gemm(None, 0, 0, 32, 0, None, None, 0, 1) == -2
    assert lib.pg_q8_0_a8_gemm(None, 0, 0, 32, 0, None, None, 0, 1) == -2
    assert lib.pg_decode_layers(*[0] * 24) == -2
    monkeypatch.setattr(cbuild, "source_hash", lambda: "0" * 16)  # other sources
    assert cbuild._prebuilt() is None


@needs_cc
def test_cache_key_ignores_the_host_name(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cbuild, "_cache_dir", lambda: tmp_path)
    cc = cbuild._compiler()
    first = cbuild._native(cc)
    monkeypatch.setattr(platform, "node", lambda: "another-pod-name")
    assert cbuild._native(cc) == first
    monkeypatch.setattr(cbuild, "cpu_features", lambda: frozenset({"sse2"}))
    assert cbuild._native(cc) != first  # a CPU with other features: another build


@needs_cc
@pytest.mark.skipif(cbuild.expected_quant_path(cbuild.cpu_features()) is None,
                    reason="the CPU runs neither q4_1 path (AVX-512, AVX2 + FMA + F16C)")
def test_a_host_without_a_compiler_runs_q4_1_from_the_prebuilt_library(tmp_path) -> None:
    """What a worker pod does: no compiler on its PATH, the image's prebuilt libraries,
    and `--weights auto` on SmolLM2 picks q4_1, on the path its CPU runs (x86-64-v4's
    AVX-512 or x86-64-v3's AVX2)."""
    import os
    import sys

    from tests.helpers import REPO

    cbuild.prebuild(tmp_path / "prebuilt")
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "PATH")}
    env.update(PATH=str(tmp_path), PREFIXGATE_KERNEL_DIR=str(tmp_path / "prebuilt"),
               PREFIXGATE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    code = ("from prefixgate.worker.kernels import cbuild, cpu_quant\n"
            "from prefixgate.model.catalog import smollm2_gguf_path\n"
            "from prefixgate.worker.model_loader import _gguf_is_q4_1\n"
            "assert cbuild._compiler() is None\n"
            "assert cpu_quant.available(), cpu_quant.kernel_reason()\n"
            "print(cpu_quant.kernel_path(), _gguf_is_q4_1(str(smollm2_gguf_path())))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    expected = cbuild.expected_quant_path(cbuild.cpu_features())
    assert out.stdout.split() == [expected, "True"]  # default_weights("cpu", smollm2): q4_1
    assert not (tmp_path / "cache" / "kernels").exists()  # nothing was built at start


# /proc/cpuinfo flags of the two kinds of x86-64 server CPU (abridged to what matters).
AVX512_CPU = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe",
                        "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
AVX2_CPU = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
OLD_CPU = frozenset({"sse4_2", "avx"})


def test_the_variant_and_path_follow_the_cpu(tmp_path, monkeypatch) -> None:
    """An AVX-512 CPU loads x86-64-v4 (the AVX-512 path), an AVX2 one x86-64-v3 (AVX2 +
    FMA), an older one baseline (no q4_1); a CPU gets the best variant present."""
    monkeypatch.setenv("PREFIXGATE_KERNEL_DIR", str(tmp_path))
    digest = cbuild.source_hash()
    for variant in cbuild.VARIANTS:
        (tmp_path / f"{cbuild.NAME}-{variant}-{digest}.so").touch()
    for cpu, variant, path in [(AVX512_CPU, "x86-64-v4", "avx512"),
                               (AVX2_CPU, "x86-64-v3", "avx2"), (OLD_CPU, "baseline", None)]:
        monkeypatch.setattr(cbuild, "cpu_features", lambda cpu=cpu: cpu)
        assert cbuild._prebuilt() == tmp_path / f"{cbuild.NAME}-{variant}-{digest}.so"
        assert cbuild.expected_quant_path(cpu) == path == cbuild.VARIANT_PATH[variant]
    (tmp_path / f"{cbuild.NAME}-x86-64-v4-{digest}.so").unlink()
    monkeypatch.setattr(cbuild, "cpu_features", lambda: AVX512_CPU)
    assert cbuild._prebuilt().name.startswith(f"{cbuild.NAME}-x86-64-v3-")
    assert cbuild.expected_quant_path(AVX2_CPU - {"f16c"}) is None  # the scales need F16C


def test_the_reason_names_the_path_or_the_fallback() -> None:
    from prefixgate.worker.kernels.cpu_quant import explain

    assert "AVX-512" in explain(AVX512_CPU, True, "avx512", "avx512")
    assert "no AVX-512" in explain(AVX2_CPU, True, "avx2", "avx2")
    assert "built without it" in explain(AVX512_CPU, True, "avx2", "avx2")  # old compiler
    assert "lacks avx2, f16c, fma" in explain(OLD_CPU, True, None, None)
    assert "no C compiler" in explain(AVX2_CPU, False, None, None)
    assert "did not target it" in explain(AVX2_CPU, True, None, None)
    assert "instructions this CPU lacks" in explain(AVX2_CPU, True, "avx512", None)


@needs_cc
def test_this_host_runs_the_path_its_cpu_has() -> None:
    """The library built here reports the path /proc/cpuinfo promises: avx2 on an
    AVX2-only host, avx512 on an AVX-512 one (the log says which and why)."""
    from prefixgate.worker.kernels import cpu_quant

    expected = cbuild.expected_quant_path(cbuild.cpu_features())
    assert cpu_quant.kernel_path() == expected, cpu_quant.kernel_reason()
    assert cpu_quant.available() == (expected is not None)
