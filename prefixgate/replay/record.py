"""Recording the gateway's traffic as a replayable trace (`prefixgate gateway --record-trace`).

Contract: `TraceRecorder(path, block_size).record(...)` appends one JSON line per finished
turn and flushes it, so a crash loses at most the turn being written:

    {"v": 1, "time_s": 1763780000.123, "conversation_id": "c1", "prompt_tokens": 412,
     "block_size": 16, "hash_ids": [u64, ...], "output_tokens": 37, "worker": "worker-0",
     "cached_tokens": 384}

`time_s` is the turn's arrival (Unix seconds); `hash_ids` are the prompt's chained block
hashes as the gateway routed it (prefixgate.radix.BlockHasher with the workers' block size,
model fingerprint and the request's namespace: full blocks only). The prompt's text and
token ids are never written, only these hashes. `prefixgate.replay.traces` reads the file
back (format "prefixgate"). Never raises into the gateway: a write error is logged once and
recording stops.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)
RECORD_VERSION = 1


class TraceRecorder:
    def __init__(self, path: str | Path, block_size: int) -> None:
        self.path = Path(path)
        self.block_size = block_size
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def record(self, *, arrival_unix_s: float, conversation_id: str, num_prompt_tokens: int,
               block_hashes: Sequence[int], output_tokens: int, worker_id: str,
               cached_tokens: int) -> None:
        if self._file is None:
            return
        line = json.dumps({
            "v": RECORD_VERSION, "time_s": round(arrival_unix_s, 6),
            "conversation_id": conversation_id, "prompt_tokens": num_prompt_tokens,
            "block_size": self.block_size, "hash_ids": list(block_hashes),
            "output_tokens": output_tokens, "worker": worker_id, "cached_tokens": cached_tokens,
        }, separators=(",", ":"))
        try:
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as exc:
            log.error("trace recording to %s stopped: %s", self.path, exc)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
