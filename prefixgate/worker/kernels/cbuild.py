"""Build a C kernel source into a shared library on first use, once per source and host.

Contract: `load(name, source, flags)` returns a `ctypes.CDLL` of `source` compiled with the
system C compiler (`$CC`, else `cc`/`gcc`) and `flags`, cached in the prefixgate cache
directory under a file name keyed by the source, flags, compiler and host (so an edited
source or another CPU builds afresh), or None when there is no compiler or the build
fails (logged; callers then keep their torch path). Concurrent builders agree: the
library is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# -march=native: the kernels use the host's vector units (AVX-512 where present); the
# cache key includes the host, so a library never runs on a CPU it was not built for.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-shared", "-fPIC", "-pthread")


def _cache_dir() -> Path:
    from prefixgate.model.catalog import default_cache_dir

    return default_cache_dir() / "kernels"


def load(name: str, source: str, flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """The compiled library of `source` (building it if needed), or None (logged)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: the %s kernel is unavailable (torch path in use)", name)
        return None
    key = hashlib.sha256("\0".join([source, *flags, cc, platform.machine(),
                                    platform.processor(), platform.node()]).encode())
    target = _cache_dir() / f"{name}_{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src, out = Path(tmp) / "k.c", Path(tmp) / "k.so"
                src.write_text(source)
                proc = subprocess.run([cc, *flags, str(src), "-o", str(out), "-lm"],
                                      capture_output=True, text=True, timeout=180)
                if proc.returncode != 0:
                    log.warning("building the %s kernel failed; using the torch path:\n%s",
                                name, proc.stderr[-2000:])
                    return None
                os.replace(out, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("the %s kernel is unavailable (%s); using the torch path", name, e)
        return None
