"""scripts/gpu_check.sh's dry run: on a machine without a GPU (CI's) it checks that the GPU
run would run (imports, arguments, every section of `prefixgate bench gpu` at tiny shapes
on the CPU, the Triton kernels in their interpreter, correctness checks included) and
exits 0 with one JSON document; a GPU machine runs the same code at full size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO


def test_gpu_check_dry_run(tmp_path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}
    env.update(PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["dry_run"] and doc["passed"], doc.get("checks")
    assert set(doc) >= {"env", "attention", "reindex", "steps", "engine", "cuda_graphs"}
    assert doc["engine"]["greedy_cache_equal"] and set(doc["engine"]["decode"]) >= {
        "batch1_tok_s"}
    assert json.loads(proc.stdout) == doc  # the same document on stdout


def test_gpu_check_refuses_unknown_arguments() -> None:
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--bogus"], cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "unknown argument --bogus" in proc.stderr
