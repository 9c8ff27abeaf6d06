"""Cut a ShareGPT multi-turn trace to its first N conversations of at most K user turns
each (gzip JSONL in, gzip JSONL out), for live replays short enough for a small host.

    python scripts/cut_sharegpt.py SRC DST NUM_CONVERSATIONS MAX_USER_TURNS
"""

import gzip
import json
import sys


def main(src: str, dst: str, num_conversations: int, max_user_turns: int) -> None:
    with gzip.open(src, "rt") as f, gzip.open(dst, "wt") as out:
        for line in list(f)[:num_conversations]:
            c, turns, keep = json.loads(line), 0, []
            for m in c["conversations"]:
                turns += m["from"] == "human"
                if turns > max_user_turns:
                    break
                keep.append(m)
            out.write(json.dumps({"id": c["id"], "conversations": keep}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
