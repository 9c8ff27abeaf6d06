"""The CPU kernel library: the C sources in csrc/, built into one shared library.

Contract: `load()` returns the library (a `ctypes.CDLL`) with every function that the ABI
header `csrc/pg_kernels.h` declares given its restype and argtypes from that header (the
one place a signature is written: `signatures()` reads it), or None when it cannot be
had (logged; callers keep their torch path). The first library found is used:

  1. prebuilt (the worker image builds them, `python -m prefixgate.worker.kernels.cbuild
     --prebuild`): one library per portable variant in `PREBUILT_DIR` (or
     $PREFIXGATE_KERNEL_DIR), named by the variant and the hash of the sources; the best
     variant this CPU runs (`best_variant`: x86-64-v4, the q4_1 kernels' AVX-512 path;
     x86-64-v3, their AVX2 + FMA path; baseline, no q4_1 kernels) whose hash matches
     these sources;
  2. built here on first use with `-march=native` (the host's vector units) by the system
     C compiler ($CC, else cc/gcc), cached in the prefixgate cache directory under a key
     of the sources, the header, the flags, the compiler's version and the CPU's features
     (so an edited source, another compiler or a CPU with other features builds afresh,
     and hosts alike share a build).

Which q4_1 path a library holds is decided by its target flags (csrc/pg_internal.h:
PG_QUANT_PATH) and reported by the library (`pg_quant_built`, and `pg_quant_path`: that
path if this CPU's cpuid has its instructions); `QUANT_PATHS` names them, and
`expected_quant_path(features)` is the one a CPU with those features should get (with a
compiler that knows its instructions). cpu_quant.py logs the outcome and its reason.

`EMULATED_AVX512` is a test build, never loaded by `load()`: the AVX-512 path's code
compiled for x86-64-v3 with SIMDe's portable AVX-512 intrinsics (Debian's libsimde-dev;
`has_simde`) in place of the CPU's, so a CPU without AVX-512 runs and checks that code
(tests/worker/test_quant.py); it reports the AVX-512 path (pg_quant_built and
pg_quant_path 2 where the CPU has x86-64-v3's AVX2, FMA and F16C).

Every build treats warnings as errors (-Wall -Wextra -Werror) and exports the ABI alone
(-fvisibility=hidden). Concurrent builders agree: a library is written under a temporary
name and renamed into place.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

NAME = "pg_cpu"
CSRC = Path(__file__).resolve().parent / "csrc"
HEADER = CSRC / "pg_kernels.h"
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"

WARNINGS = ("-Wall", "-Wextra", "-Werror")
FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden",
         *WARNINGS)
NATIVE = ("-march=native",)
# Portable builds for images (best first): the CPU features each needs (/proc/cpuinfo
# names) and its flags. x86-64-v4 builds the q4_1 kernels' AVX-512 path, x86-64-v3 their
# AVX2 + FMA path (many cloud AMD EPYC and Intel hosts have no AVX-512), baseline none.
VARIANTS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "x86-64-v4": (frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
                             "avx2", "fma", "bmi2", "movbe", "f16c"}), ("-march=x86-64-v4",)),
    "x86-64-v3": (frozenset({"avx2", "fma", "bmi1", "bmi2", "movbe", "f16c"}),
                  ("-march=x86-64-v3",)),
    "baseline": (frozenset(), ()),
}

# The AVX-512 path's code on SIMDe for a CPU without AVX-512 (module docstring; a test
# build: csrc/pg_internal.h, PG_SIMDE_AVX512). -Wno-psabi: GCC notes that passing SIMDe's
# 64-byte vectors by value to its inline functions has another ABI than GCC 4.5's.
EMULATED_AVX512 = ("-march=x86-64-v3", "-DPG_SIMDE_AVX512", "-Wno-psabi")

# The q4_1 kernels' vector paths, best first: the code the library reports for each
# (pg_quant_path) and the CPU features (/proc/cpuinfo names) its instructions need (both
# read the blocks' float16 scales with F16C).
QUANT_PATHS: dict[str, tuple[int, frozenset[str]]] = {
    "avx512": (2, frozenset({"avx512f", "f16c"})),
    "avx2": (1, frozenset({"avx2", "fma", "f16c"})),
}
# The prebuilt variant that holds each path.
VARIANT_PATH = {"x86-64-v4": "avx512", "x86-64-v3": "avx2", "baseline": None}

_CTYPES = {"void": None, "int": ctypes.c_int, "float": ctypes.c_float,
           "int64_t": ctypes.c_int64}


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.c"))


def source_hash() -> str:
    """Hash of every C source and header (what a library was built from)."""
    h = hashlib.sha256()
    for path in sorted([*CSRC.glob("*.c"), *CSRC.glob("*.h")]):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def signatures(header: Path = HEADER) -> dict[str, tuple[object, list[object]]]:
    """name -> (restype, argtypes) of every `PG_API` declaration in the header. Any
    pointer is a void pointer; other types must be in _CTYPES (ValueError otherwise)."""
    text = re.sub(r"/\*.*?\*/", " ", header.read_text(), flags=re.S)
    out: dict[str, tuple[object, list[object]]] = {}
    for ret, name, params in re.findall(r"PG_API\s+([\w\s*]+?)\s*\b(pg_\w+)\s*\(([^)]*)\)\s*;",
                                        text):
        args = [] if params.strip() == "void" else [p.strip() for p in params.split(",")]
        out[name] = (_ctype(ret, name), [_ctype(re.sub(r"\w+$", "", a), name) for a in args])
    if not out:
        raise ValueError(f"{header} declares no PG_API function")
    return out


def _ctype(decl: str, where: str) -> object:
    decl = " ".join(decl.replace("const", " ").split())
    if "*" in decl:
        return ctypes.c_void_p
    if decl not in _CTYPES:
        raise ValueError(f"{HEADER.name}: {where}: type {decl!r} has no ctypes mapping")
    return _CTYPES[decl]


def cpu_features() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty where unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def has_simde(cc: str) -> bool:
    """Whether the compiler finds SIMDe's AVX-512 header (what EMULATED_AVX512 needs)."""
    proc = subprocess.run([cc, "-E", "-x", "c", "-", "-o", os.devnull],
                          input="#include <simde/x86/avx512.h>\n", capture_output=True,
                          text=True, timeout=120)
    return proc.returncode == 0


def compile_library(target: Path, arch_flags: Sequence[str], cc: str) -> None:
    """Build csrc/*.c into `target` (atomically); CalledProcessError with the compiler's
    output when it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / "lib.so"
        proc = subprocess.run([cc, *FLAGS, *arch_flags, f"-I{CSRC}",
                               *map(str, sources()), "-o", str(out), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout,
                                                proc.stderr)
        os.replace(out, target)


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in signatures().items():
        fn = getattr(lib, name)  # AttributeError: the library lacks an ABI function
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def expected_quant_path(features: frozenset[str]) -> str | None:
    """The best q4_1 path (QUANT_PATHS) a CPU with these features runs, or None."""
    return next((name for name, (_, needs) in QUANT_PATHS.items() if needs <= features), None)


def quant_path_name(code: int) -> str | None:
    """QUANT_PATHS' name for a library's pg_quant_path / pg_quant_built code (0: None)."""
    return next((name for name, (c, _) in QUANT_PATHS.items() if c == code), None)


def best_variant(features: frozenset[str], available: Sequence[str] = tuple(VARIANTS)
                 ) -> str | None:
    """The best of `available` variants a CPU with these features runs."""
    return next((v for v, (needs, _) in VARIANTS.items() if v in available and needs <= features),
                None)


def _prebuilt() -> Path | None:
    folder = Path(os.environ.get("PREFIXGATE_KERNEL_DIR") or PREBUILT_DIR)
    digest = source_hash()
    found = [v for v in VARIANTS if (folder / f"{NAME}-{v}-{digest}.so").is_file()]
    variant = best_variant(cpu_features(), found)
    return None if variant is None else folder / f"{NAME}-{variant}-{digest}.so"


def _cache_dir() -> Path:
    from prefixgate.model.catalog import default_cache_dir

    return default_cache_dir() / "kernels"


def _native(cc: str) -> Path:
    """The -march=native library in the cache (built if missing)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256("\0".join([source_hash(), *FLAGS, *NATIVE, version,
                                    platform.machine(), *sorted(cpu_features())]).encode())
    target = _cache_dir() / f"{NAME}_{key.hexdigest()[:16]}.so"
    if not target.exists():
        compile_library(target, NATIVE, cc)
    return target


def load() -> ctypes.CDLL | None:
    """The kernel library (module docstring), or None (logged)."""
    path = _prebuilt()
    how = "prebuilt"
    try:
        if path is None:
            how = "built here with -march=native"
            cc = _compiler()
            if cc is None:
                log.info("no C compiler and no prebuilt kernels: the CPU kernels are "
                         "unavailable (torch path in use)")
                return None
            path = _native(cc)
        lib = _bind(path)
        log.info("CPU kernel library %s (%s)", path, how)
        return lib
    except subprocess.CalledProcessError as e:
        log.warning("building the CPU kernels failed; using the torch path:\n%s",
                    (e.stderr or "")[-2000:])
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("the CPU kernels are unavailable (%s); using the torch path", e)
    return None


def prebuild(folder: Path, cc: str | None = None) -> list[Path]:
    """Build every portable variant into `folder` (the worker image does, at build time;
    a compiler that lacks a variant's -march fails the build)."""
    cc = cc or _compiler()
    if cc is None:
        raise SystemExit("prebuild: no C compiler ($CC, cc or gcc)")
    built = []
    for variant, (_, flags) in VARIANTS.items():
        path = folder / f"{NAME}-{variant}-{source_hash()}.so"
        compile_library(path, flags, cc)
        lib = _bind(path)  # every ABI function is there
        holds = quant_path_name(lib.pg_quant_built())
        if holds != VARIANT_PATH[variant]:  # e.g. a compiler that drops an -march level
            raise SystemExit(f"prebuild: {path.name} holds q4_1 path {holds}, "
                             f"not {VARIANT_PATH[variant]}")
        built.append(path)
    return built


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Build the CPU kernel library ahead of use.")
    parser.add_argument("--prebuild", type=Path, nargs="?", const=PREBUILT_DIR, default=None,
                        help=f"build every portable variant into this folder (default "
                             f"{PREBUILT_DIR})")
    opts = parser.parse_args()
    if opts.prebuild is None:
        parser.error("nothing to do: give --prebuild [FOLDER]")
    for variant, p in zip(VARIANTS, prebuild(opts.prebuild), strict=True):
        print(p, "q4_1 path:", VARIANT_PATH[variant] or "none")
