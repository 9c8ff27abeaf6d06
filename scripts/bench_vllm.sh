#!/usr/bin/env bash
# prefixgate in front of two vLLM CPU servers, against other routers over the same two
# servers, in one run (docs/benchmarks.md, "vLLM workers"): the first $CONVS ShareGPT dev
# conversations cut after their 4th user turn, 32-token greedy replies, closed loop at
# concurrency $CONC, through
#   prefixgate      `prefixgate gateway --vllm-worker ...` (policy prefix; replayed over gRPC,
#                   whose final event carries the gateway's predicted cached tokens)
#   round-robin     the same gateway with --policy round-robin
#   vllm-router     vllm-router --policy cache_aware   (OpenAI HTTP)
#   smg             smg launch --policy cache_aware    (OpenAI HTTP)
# vLLM's own prefix cache is emptied as each run starts (POST /reset_prefix_cache: the servers
# run in vLLM's dev mode). Prints one line per run (hit rate, TTFT p50/p99, mean cached
# tokens per turn) and the index truth (share of prefixgate's turns whose predicted cached
# tokens are within one vLLM block of what vLLM reported), and writes the replays' JSON and
# Markdown under $OUT.
#
#   bash scripts/bench_vllm.sh
#
# Environment: VLLM_PYTHON (default $PREFIXGATE_VLLM_PYTHON, else the environment
# scripts/setup_vllm.sh makes), ROUTER_VENV (a venv with vllm-router==0.1.17 and
# smg==1.13.0; runs skipped without; default /work/router-venv), TRACES (default
# ../shared/traces), OUT (default bench-out/vllm), CONVS (16), CONC (4).
set -euo pipefail
cd "$(dirname "$0")/.."
TRACES=${TRACES:-../shared/traces}
OUT=${OUT:-bench-out/vllm}
CONVS=${CONVS:-16}
CONC=${CONC:-4}
VLLM_PYTHON=${VLLM_PYTHON:-${PREFIXGATE_VLLM_PYTHON:-$HOME/.cache/prefixgate/vllm-venv/bin/python}}
ROUTER_VENV=${ROUTER_VENV:-/work/router-venv}
PY=${PY:-.venv/bin/python}
MODEL=smollm2-135m
VLLM_BLOCK=32
mkdir -p "$OUT"
T=$OUT/sharegpt_dev_${CONVS}x4.jsonl.gz
$PY scripts/cut_sharegpt.py "$TRACES/sharegpt_multiturn_dev.jsonl.gz" "$T" "$CONVS" 4

PIDS=()
cleanup() {  # each server leads its own session: its engine and workers go with it
  for p in "${PIDS[@]}"; do kill -- "-$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
port() { $PY -c "from prefixgate.wire.rpc import free_port; print(free_port())"; }
wait_http() { for _ in $(seq 900); do curl -sf "$1" > /dev/null && return; sleep 1; done; echo "no answer from $1" >&2; exit 1; }
load() { cut -d' ' -f1-3 /proc/loadavg; }

# Two vLLM servers with the settings of `prefixgate up --engine vllm` (launch/vllm.py), one
# CPU each: KV events on ipc:// sockets in a private directory (never on every interface),
# prefixgate's KV connector with its ExportBlocks on loopback.
MODEL_DIR=$($PY -m prefixgate.worker.model_loader "$MODEL" 2>/dev/null | tail -1)
IPC=$(mktemp -d -t pg-vllm-XXXXXX)  # 0700
SERVERS=()
for i in 0 1; do
  p=$(port); x=$(port)
  spec=$($PY -c "
import shlex, sys
from pathlib import Path
from prefixgate.launch.vllm import VLLMLaunch, VLLMServer, vllm_argv, vllm_env
launch = VLLMLaunch(sys.argv[1], Path(sys.argv[2]), sys.argv[3], block_size=$VLLM_BLOCK)
server = VLLMServer('vllm-$i', '127.0.0.1', $p, 0, 0, $x, '$IPC')
env = vllm_env(launch, Path('$OUT').resolve() / 'pythonpath')
print(shlex.join([f'{k}={v}' for k, v in env.items()] + vllm_argv(launch, server)))
print(server.worker_spec)" "$VLLM_PYTHON" "$MODEL_DIR" "$MODEL")
  argv=$(head -1 <<< "$spec")
  env -u PREFIXGATE_VLLM_PYTHON VLLM_CPU_OMP_THREADS_BIND=$i VLLM_SERVER_DEV_MODE=1 \
    setsid bash -c "exec env $argv" > "$OUT/vllm-$i.log" 2>&1 &
  PIDS+=($!)
  SERVERS+=("$(tail -1 <<< "$spec")")
done
URLS=()
for s in "${SERVERS[@]}"; do URLS+=("${s%%,*}"); done
for u in "${URLS[@]}"; do wait_http "$u/health"; done
echo "servers up $(date -u +%T), load $(load)" > "$OUT/load.txt"

reset_caches() { for u in "${URLS[@]}"; do curl -sf -X POST "$u/reset_prefix_cache" > /dev/null; done; }
replay() {  # name target [extra replay flags]
  local name=$1 target=$2; shift 2
  timeout 1800 $PY -m prefixgate replay --trace "$T" --arrival closed --concurrency "$CONC" \
    --max-tokens 32 --no-progress --no-plots --out "$OUT" --target "$target" --label "$name" \
    --name "$name" "$@" > /dev/null
  echo "$name done $(date -u +%T), load $(load)" >> "$OUT/load.txt"
}
gateway_run() {  # name policy
  local gp; gp=$(port)
  local flags=()
  for s in "${SERVERS[@]}"; do flags+=(--vllm-worker "$s"); done
  $PY -m prefixgate gateway --model "$MODEL" --port "$gp" --policy "$2" "${flags[@]}" \
    > "$OUT/gateway-$1.log" 2>&1 &
  local gw=$!
  $PY - "127.0.0.1:$gp" <<'EOF'
import asyncio, sys
from prefixgate.wire.client import ChatClient
async def main():
    client = ChatClient(sys.argv[1])
    await client.wait_ready(60)
    for _ in range(600):
        if (await client.list_models()).models[0].num_workers >= 2:
            return await client.close()
        await asyncio.sleep(0.2)
    raise SystemExit("the gateway does not route to both servers")
asyncio.run(main())
EOF
  reset_caches
  replay "$1" "127.0.0.1:$gp"
  kill "$gw"; wait "$gw" 2>/dev/null || true
}
router_run() {  # name command...
  local name=$1; shift
  local rp; rp=$(port)
  "$@" --port "$rp" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  # Ready once it relays a completion (it may answer before it has checked its workers).
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$rp/v1/completions" -H 'Content-Type: application/json' \
      -d "{\"model\": \"$MODEL\", \"prompt\": \"Hi\", \"max_tokens\": 1}" > /dev/null && break
    sleep 1
  done
  reset_caches
  replay "$name" "http://127.0.0.1:$rp" --openai-model "$MODEL"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

RUNS=()
gateway_run prefixgate prefix; RUNS+=(prefixgate)
gateway_run round-robin round-robin; RUNS+=(round-robin)
if [[ -x $ROUTER_VENV/bin/vllm-router ]]; then
  router_run vllm-router "$ROUTER_VENV/bin/vllm-router" --host 127.0.0.1 --policy cache_aware \
    --worker-urls "${URLS[@]}"
  RUNS+=(vllm-router)
fi
if [[ -x $ROUTER_VENV/bin/smg ]]; then
  router_run smg "$ROUTER_VENV/bin/smg" launch --host 127.0.0.1 --policy cache_aware \
    --worker-urls "${URLS[@]}"
  RUNS+=(smg)
fi
echo "end $(date -u +%T), load $(load)" >> "$OUT/load.txt"

$PY - "$OUT" "$VLLM_BLOCK" "${RUNS[@]}" <<'EOF'
import json, sys
from collections import defaultdict
out, block, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for name in names:
    (run,) = json.load(open(f"{out}/{name}.json"))["runs"]
    s, ok = run["summary"], [t for t in run["turns"] if t["status"] == "ok"]
    per_turn = defaultdict(list)
    for t in ok:
        per_turn[t["turn"]].append(t["cached_tokens"])
    cached = " / ".join(f"{sum(v) / len(v):.0f}" for _, v in sorted(per_turn.items()))
    line = (f"{name}: {s['turns_ok']}/{s['turns']} turns ok, hit rate {s['hit_rate']:.1%}, "
            f"TTFT p50 {s['ttft_s']['p50'] * 1e3:.0f} ms p99 {s['ttft_s']['p99'] * 1e3:.0f} ms, "
            f"mean cached tokens per turn {cached}")
    predicted = [t for t in ok if t.get("predicted_cached_tokens", -1) >= 0]
    if predicted:
        within = sum(abs(t["predicted_cached_tokens"] - t["cached_tokens"]) <= block
                     for t in predicted)
        exact = sum(t["predicted_cached_tokens"] == t["cached_tokens"] for t in predicted)
        line += (f"; index truth: {within}/{len(predicted)} turns within one vLLM block "
                 f"({within / len(predicted):.1%}), {exact} exact")
    print(line)
EOF
cat "$OUT/load.txt"
