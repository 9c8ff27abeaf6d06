"""The gateway's trace writer: neutral module, written off the caller's thread, closed."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from prefixgate.telemetry.trace_recorder import TraceRecorder


def test_gateway_imports_no_replay() -> None:
    code = ("import sys; import prefixgate.gateway.server, prefixgate.gateway.redis_feed; "
            "bad = [m for m in sys.modules if m.startswith('prefixgate.replay')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_recorder_writes_on_its_own_thread_and_close_drains(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    rec = TraceRecorder(path, 16)
    writers: set[str] = set()
    real_write = rec._file.write

    def spy(line: str) -> int:
        writers.add(threading.current_thread().name)
        return real_write(line)

    rec._file.write = spy  # type: ignore[method-assign]
    for i in range(200):
        rec.record(arrival_unix_s=float(i), conversation_id=f"c{i}", num_prompt_tokens=32,
                   block_hashes=[i, i + 1], output_tokens=1, worker_id="w", cached_tokens=0)
    rec.close()
    rec.close()  # idempotent
    rec.record(arrival_unix_s=0.0, conversation_id="late", num_prompt_tokens=1,
               block_hashes=[], output_tokens=0, worker_id="w", cached_tokens=0)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["conversation_id"] for x in lines] == [f"c{i}" for i in range(200)]
    assert writers == {"trace-recorder"}


def test_recorder_write_error_stops_recording_without_raising(tmp_path, caplog) -> None:
    """A failing write is logged once and ends recording: no later line is tried, nothing
    reaches the caller (the gateway's event loop), and close() still returns."""
    rec = TraceRecorder(tmp_path / "t.jsonl", 16)
    tried: list[str] = []

    def fail(line: str) -> int:
        tried.append(line)
        raise OSError("disk full")

    rec._file.write = fail  # type: ignore[method-assign]
    for i in range(3):
        rec.record(arrival_unix_s=0.0, conversation_id=f"c{i}", num_prompt_tokens=1,
                   block_hashes=[], output_tokens=0, worker_id="w", cached_tokens=0)
    rec.close()
    rec.record(arrival_unix_s=0.0, conversation_id="late", num_prompt_tokens=1,
               block_hashes=[], output_tokens=0, worker_id="w", cached_tokens=0)
    assert len(tried) == 1 and '"conversation_id":"c0"' in tried[0]
    errors = [r for r in caplog.records if "trace recording" in r.getMessage()]
    assert len(errors) == 1 and "disk full" in errors[0].getMessage()
    assert (tmp_path / "t.jsonl").read_text() == ""
