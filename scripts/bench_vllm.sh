#!/usr/bin/env bash
# prefixgate in front of vLLM CPU servers, against other routers over the same servers, in
# one run (docs/bench/vllm-workers.md, docs/bench/vllm-mixed.md). Workloads (WORKLOAD):
#   sharegpt  the first $CONVS ShareGPT dev conversations cut after their 4th user turn,
#             closed loop at concurrency $CONC
#   mixed     ShareGPT chats plus conversations over long shared documents
#             (prefixgate/bench/mixed_trace.py: where moving KV matters), conversations
#             starting as a Poisson process at $RATE a second, $THINK s between a reply and
#             the next turn
# 32-token greedy replies, through
#   prefixgate       `prefixgate gateway --vllm-worker ...` (policy prefix, pulling a
#                    prompt's cached blocks from a busy holder through prefixgate's KV
#                    connector; replayed over gRPC, whose final event carries the gateway's
#                    predicted cached tokens)
#   prefixgate-no-transfer   the same with --no-transfer (mixed only)
#   round-robin      the same gateway with --policy round-robin
#   vllm-router      vllm-router --policy cache_aware   (OpenAI HTTP)
#   smg              smg launch --policy cache_aware    (OpenAI HTTP)
# vLLM's prefix cache is emptied as each run starts (POST /reset_prefix_cache: the servers
# run in vLLM's dev mode). $ROUNDS rounds, the routers' order rotated each round. Prints one
# line per router (turns pooled over the rounds: hit rate, tokens not recomputed, TTFT
# p50/p90/p99) and the index truth (share of prefixgate's turns whose predicted cached
# tokens are within one vLLM block of what vLLM reported), and writes the replays' JSON,
# summary.json/summary.md and a TTFT plot under $OUT.
#
#   bash scripts/bench_vllm.sh
#   WORKLOAD=mixed ROUNDS=2 bash scripts/bench_vllm.sh
#
# Environment: VLLM_PYTHON (default $PREFIXGATE_VLLM_PYTHON, else the environment
# scripts/setup_vllm.sh makes), VLLM_ROUTER and SMG (the routers' executables:
# vllm-router==0.1.17 and smg==1.13.0 from PyPI, each in a venv of its own; default
# $ROUTER_VENV/bin/...; runs skipped without), TRACES (default ../shared/traces), OUT
# (default bench-out/vllm-$WORKLOAD), SERVERS (2), CONVS (16), CONC (4), RATE (0.4),
# THINK (3), ROUNDS (1), ARMS (the runs, space-separated, of: prefixgate
# prefixgate-no-transfer prefixgate-work-cost round-robin vllm-router smg; default all
# but prefixgate-work-cost, no-transfer on mixed only).
set -euo pipefail
cd "$(dirname "$0")/.."
TRACES=${TRACES:-../shared/traces}
WORKLOAD=${WORKLOAD:-sharegpt}
OUT=${OUT:-bench-out/vllm-$WORKLOAD}
SERVERS_N=${SERVERS:-2}
CONVS=${CONVS:-16}
CONC=${CONC:-4}
RATE=${RATE:-0.4}
THINK=${THINK:-3}
ROUNDS=${ROUNDS:-1}
VLLM_PYTHON=${VLLM_PYTHON:-${PREFIXGATE_VLLM_PYTHON:-$HOME/.cache/prefixgate/vllm-venv/bin/python}}
ROUTER_VENV=${ROUTER_VENV:-/work/router-venv}
VLLM_ROUTER=${VLLM_ROUTER:-$ROUTER_VENV/bin/vllm-router}
SMG=${SMG:-$ROUTER_VENV/bin/smg}
PY=${PY:-.venv/bin/python}
MODEL=smollm2-135m
VLLM_BLOCK=32
if [[ -n ${ARMS:-} ]]; then
  read -r -a ARMS <<< "$ARMS"
  for a in "${ARMS[@]}"; do  # a router named but missing fails now, not after the others ran
    case $a in
      vllm-router) [[ -x $VLLM_ROUTER ]] || { echo "no $VLLM_ROUTER (VLLM_ROUTER)" >&2; exit 2; } ;;
      smg) [[ -x $SMG ]] || { echo "no $SMG (SMG)" >&2; exit 2; } ;;
      prefixgate|prefixgate-no-transfer|prefixgate-work-cost|round-robin) ;;
      *) echo "unknown arm $a" >&2; exit 2 ;;
    esac
  done
else
  ARMS=(prefixgate)
  [[ $WORKLOAD == mixed ]] && ARMS+=(prefixgate-no-transfer)
  ARMS+=(round-robin)
  if [[ -x $VLLM_ROUTER ]]; then ARMS+=(vllm-router); else echo "no $VLLM_ROUTER: vllm-router skipped" >&2; fi
  if [[ -x $SMG ]]; then ARMS+=(smg); else echo "no $SMG: smg skipped" >&2; fi
fi
mkdir -p "$OUT"
case $WORKLOAD in
  sharegpt)
    T=$OUT/sharegpt_dev_${CONVS}x4.jsonl.gz
    $PY scripts/cut_sharegpt.py "$TRACES/sharegpt_multiturn_dev.jsonl.gz" "$T" "$CONVS" 4
    ARRIVAL=(--arrival closed --concurrency "$CONC") ;;
  mixed)
    T=$OUT/mixed.jsonl.gz
    $PY -m prefixgate.bench.mixed_trace --sharegpt "$TRACES/sharegpt_multiturn_dev.jsonl.gz" \
      --out "$T" --model "$MODEL"
    ARRIVAL=(--arrival poisson --rate "$RATE" --think-time "$THINK" --seed 0) ;;
  *) echo "WORKLOAD must be sharegpt or mixed, not $WORKLOAD" >&2; exit 2 ;;
esac

PIDS=()
cleanup() {  # each server leads its own session: its engine and workers go with it
  for p in "${PIDS[@]}"; do kill -- "-$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
port() { $PY -c "from prefixgate.wire.rpc import free_port; print(free_port())"; }
wait_http() { for _ in $(seq 900); do curl -sf "$1" > /dev/null && return; sleep 1; done; echo "no answer from $1" >&2; exit 1; }
load() { cut -d' ' -f1-3 /proc/loadavg; }

# $SERVERS_N vLLM servers with the settings of `prefixgate up --engine vllm` (launch/vllm.py),
# the CPUs split between them (launch/vllm.cpu_binding): KV events on ipc:// sockets in a private directory (never on every interface),
# prefixgate's KV connector with its ExportBlocks on loopback.
MODEL_DIR=$($PY -m prefixgate.worker.model_loader "$MODEL" 2>/dev/null | tail -1)
IPC=$(mktemp -d -t pg-vllm-XXXXXX)  # 0700
SERVERS=()
for i in $(seq 0 $((SERVERS_N - 1))); do
  p=$(port); x=$(port)
  spec=$($PY -c "
import shlex, sys
from pathlib import Path
from prefixgate.launch.vllm import VLLMLaunch, VLLMServer, cpu_binding, vllm_argv, vllm_env
launch = VLLMLaunch(sys.argv[1], Path(sys.argv[2]), sys.argv[3], block_size=$VLLM_BLOCK)
server = VLLMServer('vllm-$i', '127.0.0.1', $p, 0, 0, $x, '$IPC')
env = vllm_env(launch, Path('$OUT').resolve() / 'pythonpath')
env['VLLM_CPU_OMP_THREADS_BIND'] = cpu_binding($i, $SERVERS_N)
print(shlex.join([f'{k}={v}' for k, v in env.items()] + vllm_argv(launch, server)))
print(server.worker_spec)" "$VLLM_PYTHON" "$MODEL_DIR" "$MODEL")
  argv=$(head -1 <<< "$spec")
  env -u PREFIXGATE_VLLM_PYTHON VLLM_SERVER_DEV_MODE=1 \
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
  timeout 1800 $PY -m prefixgate replay --trace "$T" "${ARRIVAL[@]}" \
    --max-tokens 32 --no-progress --no-plots --out "$OUT" --target "$target" --label "$name" \
    --name "$name" "$@" > /dev/null
  echo "$name done $(date -u +%T), load $(load)" >> "$OUT/load.txt"
}
gateway_run() {  # name policy [gateway flags]
  local name=$1 policy=$2; shift 2
  local gp; gp=$(port)
  local flags=("$@")
  for s in "${SERVERS[@]}"; do flags+=(--vllm-worker "$s"); done
  $PY -m prefixgate gateway --model "$MODEL" --port "$gp" --policy "$policy" "${flags[@]}" \
    > "$OUT/gateway-$name.log" 2>&1 &
  local gw=$!
  $PY - "127.0.0.1:$gp" "$SERVERS_N" <<'EOF'
import asyncio, sys
from prefixgate.wire.client import ChatClient
async def main():
    client = ChatClient(sys.argv[1])
    await client.wait_ready(60)
    for _ in range(600):
        if (await client.list_models()).models[0].num_workers >= int(sys.argv[2]):
            return await client.close()
        await asyncio.sleep(0.2)
    raise SystemExit("the gateway does not route to every server")
asyncio.run(main())
EOF
  reset_caches
  replay "$name" "127.0.0.1:$gp"
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

arm() {  # name round
  local label="$1-r$2"
  case $1 in
    prefixgate) gateway_run "$label" prefix ;;
    prefixgate-no-transfer) gateway_run "$label" prefix --no-transfer ;;
    prefixgate-work-cost) gateway_run "$label" prefix --work-weight 1 ;;
    round-robin) gateway_run "$label" round-robin ;;
    vllm-router) router_run "$label" "$VLLM_ROUTER" --host 127.0.0.1 --policy cache_aware \
                   --worker-urls "${URLS[@]}" ;;
    smg) router_run "$label" "$SMG" launch --host 127.0.0.1 --policy cache_aware \
           --worker-urls "${URLS[@]}" ;;
  esac
  RUNS+=("$label")
}
RUNS=()
for r in $(seq 1 "$ROUNDS"); do
  n=${#ARMS[@]}
  for k in $(seq 0 $((n - 1))); do arm "${ARMS[$(((k + r - 1) % n))]}" "$r"; done
done
echo "end $(date -u +%T), load $(load)" >> "$OUT/load.txt"

$PY -m prefixgate.bench.vllm_routers "$OUT" "$VLLM_BLOCK" "${RUNS[@]}"
cat "$OUT/load.txt"
