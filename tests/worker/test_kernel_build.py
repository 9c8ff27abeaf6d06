"""The CPU kernel library as files: csrc/*.c and the ABI header pg_kernels.h.

The header is the one place a signature is written (the ctypes types are read from it),
so it must declare exactly what the library exports; every build treats warnings as
errors; portable variants prebuilt for an image are found by the hash of the sources
(a stale prebuilt library is never used), and the cache key is the sources, flags,
compiler and CPU features, not the host's name."""

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
    assert set(sigs) == {"pg_set_spin_us", "pg_has_avx512", "pg_q4_1_gemm", "pg_q8_0_gemm",
                         "pg_dequantize", "pg_decode_attention", "pg_decode_layers"}
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    assert sigs["pg_set_spin_us"] == (None, [i])
    assert sigs["pg_has_avx512"] == (i, [])
    assert sigs["pg_q4_1_gemm"] == (i, [p, i64, i, i, i, p, p, i64, i])
    assert sigs["pg_decode_attention"] == (i, [p, i64, i64, p, p, i64, i, p, i64, p, p, i, i,
                                               i, i, i, f, i])
    assert len(sigs["pg_decode_layers"][1]) == 23


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
    for path in built:
        assert _exports(path) == set(cbuild.signatures()), path.name


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
    assert lib is not None and lib.pg_has_avx512() == 0 and lib.pg_q4_1_gemm(
        None, 0, 0, 32, 0, None, None, 0, 1) == -2  # no AVX-512: refused, not run
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
@pytest.mark.skipif("avx512f" not in cbuild.cpu_features(), reason="the q4_1 kernels need AVX-512")
def test_a_host_without_a_compiler_runs_q4_1_from_the_prebuilt_library(tmp_path) -> None:
    """What a worker pod does: no compiler on its PATH, the image's prebuilt libraries,
    and `--weights auto` on SmolLM2 picks q4_1."""
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
            "assert cpu_quant.available(), 'the prebuilt x86-64-v4 library is used'\n"
            "print(_gguf_is_q4_1(str(smollm2_gguf_path())))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"  # so default_weights("cpu", smollm2) is q4_1
    assert not (tmp_path / "cache" / "kernels").exists()  # nothing was built at start
