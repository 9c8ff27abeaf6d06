"""`prefixgate bench transfer` end to end on tiny-random: two worker processes, one JSON
document on stdout, the transfer path's reply equal to the recompute's (the bench checks)
and every history token transferred."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO, cli_env


def test_bench_transfer_smoke(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "prefixgate", "bench", "transfer", "--json", "--model",
         "tiny-random", "--history-tokens", "512", "--repeats", "1"],
        env=cli_env(PREFIXGATE_CACHE_DIR=str(tmp_path / "cache")), cwd=REPO,
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["usage"]["transfer"]["transferred"] == 512
    assert doc["usage"]["recompute"]["transferred"] == 0
    assert doc["pull_bytes"] == 512 * doc["kv_bytes_per_token"]
    assert doc["rate_share"] > 0 and doc["ttft_speedup"] > 0
