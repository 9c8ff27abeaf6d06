""".ci/run with a vLLM install that fails or does not import: the run fails (the
real-vLLM tests would otherwise all skip and the run pass), unless
PREFIXGATE_ALLOW_NO_VLLM=1; and the tests' own check (tests/engines/vllm_server.py) fails
without vLLM, skipping only with that variable, naming it either way. The script runs as
it is, in a copy of the repository's layout whose scripts/setup_vllm.sh and
scripts/test.sh are stand-ins (the real ones install vLLM and run the whole suite)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ci(tmp_path: Path, setup: str, **env: str) -> subprocess.CompletedProcess:
    """.ci/run in a fresh layout under `tmp_path` (created)."""
    (tmp_path / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup_vllm.sh").write_text(setup)
    (tmp_path / "scripts" / "test.sh").write_text(
        'echo "suite ran with PREFIXGATE_VLLM_PYTHON=${PREFIXGATE_VLLM_PYTHON:-}"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    redis = bin_dir / "redis-server"  # present: nothing to install
    redis.write_text("#!/bin/sh\n")
    redis.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}
    return subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True,
                          text=True, timeout=60,
                          env={**clean, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env})


@pytest.mark.parametrize("setup", [
    "echo 'setup_vllm: pip failed' >&2; exit 1\n",  # the install fails
    "echo /nonexistent/bin/python\n",  # it "succeeds", but no python imports vllm
])
def test_a_missing_or_broken_vllm_fails_the_run(tmp_path: Path, setup: str) -> None:
    run = _ci(tmp_path / "plain", setup)
    assert run.returncode != 0 and "suite ran" not in run.stdout
    assert "PREFIXGATE_ALLOW_NO_VLLM=1" in run.stderr
    allowed = _ci(tmp_path / "allowed", setup, PREFIXGATE_ALLOW_NO_VLLM="1")
    assert allowed.returncode == 0, allowed.stderr
    assert "suite ran with PREFIXGATE_VLLM_PYTHON=\n" in allowed.stdout
    assert "skipped" in allowed.stderr


def test_a_working_vllm_is_handed_to_the_suite(tmp_path: Path) -> None:
    python = shutil.which("python3")
    fake = tmp_path / "vllm-env"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("")
    wrapper = tmp_path / "python"  # a python that imports this stand-in vllm package
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={fake} exec {python} "$@"\n')
    wrapper.chmod(0o755)
    run = _ci(tmp_path / "ci", f"echo {wrapper}\n")
    assert run.returncode == 0, run.stderr
    assert f"suite ran with PREFIXGATE_VLLM_PYTHON={wrapper}\n" in run.stdout


def test_the_vllm_tests_fail_without_vllm_unless_allowed(monkeypatch) -> None:
    from tests.engines.vllm_server import vllm_python

    monkeypatch.setenv("PREFIXGATE_VLLM_PYTHON", "/nonexistent/bin/python")
    monkeypatch.delenv("PREFIXGATE_ALLOW_NO_VLLM", raising=False)
    with pytest.raises(pytest.fail.Exception, match="PREFIXGATE_ALLOW_NO_VLLM=1"):
        vllm_python()
    monkeypatch.setenv("PREFIXGATE_ALLOW_NO_VLLM", "1")
    with pytest.raises(pytest.skip.Exception, match="PREFIXGATE_ALLOW_NO_VLLM=1"):
        vllm_python()
