"""Recording served turns as a replayable trace (`prefixgate gateway --record-trace`).

Contract
--------
`TraceRecorder(path, block_size)`: `record(...)` appends one JSON line per finished turn;
`close()` writes what is queued, closes the file and is idempotent. The gateway calls
`record` on its event loop, so `record` only queues: one writer thread owns the file and
writes and flushes each line (a crash loses at most the lines not yet written). Lines:

    {"v": 1, "time_s": 1763780000.123, "conversation_id": "c1", "prompt_tokens": 412,
     "block_size": 16, "hash_ids": [u64, ...], "output_tokens": 37, "worker": "worker-0",
     "cached_tokens": 384}

`time_s` is the turn's arrival (Unix seconds); `hash_ids` are the prompt's chained block
hashes as the gateway routed it (prefixgate.radix.BlockHasher with the workers' block size,
model fingerprint and the request's namespace: full blocks only). The prompt's text and
token ids are never written, only these hashes. `prefixgate.replay.traces` reads the file
back (format "prefixgate"). Never raises into the gateway: a write error is logged once and
recording stops. Torch-free and replay-free: the gateway imports it.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)
RECORD_VERSION = 1
_CLOSE = None  # queue sentinel


class TraceRecorder:
    def __init__(self, path: str | Path, block_size: int) -> None:
        self.path = Path(path)
        self.block_size = block_size
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._queue: queue.SimpleQueue[dict | None] = queue.SimpleQueue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="trace-recorder",
                                        daemon=True)
        self._writer.start()

    def record(self, *, arrival_unix_s: float, conversation_id: str, num_prompt_tokens: int,
               block_hashes: Sequence[int], output_tokens: int, worker_id: str,
               cached_tokens: int) -> None:
        """Queue one turn's line (no I/O on the caller's thread)."""
        if self._closed:
            return
        self._queue.put({
            "v": RECORD_VERSION, "time_s": round(arrival_unix_s, 6),
            "conversation_id": conversation_id, "prompt_tokens": num_prompt_tokens,
            "block_size": self.block_size, "hash_ids": list(block_hashes),
            "output_tokens": output_tokens, "worker": worker_id, "cached_tokens": cached_tokens,
        })

    def _write_loop(self) -> None:
        f = self._file
        while (rec := self._queue.get()) is not _CLOSE:
            if f is None:
                continue  # a write failed: drain and drop
            try:
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
                f.flush()
            except OSError as exc:
                log.error("trace recording to %s stopped: %s", self.path, exc)
                self._closed = True
                f = None
        try:
            self._file.close()
        except OSError:
            pass

    def close(self, timeout_s: float = 5.0) -> None:
        """Write the queued lines and close the file (blocks up to `timeout_s`)."""
        if not self._writer.is_alive():
            return
        self._closed = True
        self._queue.put(_CLOSE)
        self._writer.join(timeout_s)
