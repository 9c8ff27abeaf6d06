#!/usr/bin/env bash
# The emulated-fleet benchmark of docs/benchmarks.md ("Emulated fleet"): real gateways and
# sglang-router in front of the same emulated workers, and the simulator on the same
# settings. Writes JSON, Markdown and plots under $OUT (default bench-out/fleet).
#
#   bash scripts/bench_fleet.sh [mooncake|sharegpt|transfer|all]
#
# transfer: block transfer on both traces (docs/benchmarks.md, "Moving KV instead of
# work"): the cost rule with its pull option (prefix), without it (prefix:transfer=0, the
# rule before), every turn on its best-cached worker (prefix:load_weight=0:transfer=0, the
# bound on tokens not recomputed without transfer) and sglang-router, in one run per
# trace, each on a fresh fleet; and the simulator on the same settings. Transfer stands for
# 100 Gb/s between GPUs for an 8B model (the --transfer-bytes-per-s and
# --kv-bytes-per-token defaults).
#
# Environment: TRACES (default ../shared/traces), OUT, TIME_SCALE (default 20, the issue's),
# SGLANG_PYTHON (a python with sglang-router 0.3.2, default /work/peers/sglang-venv/bin/
# python; the sglang runs are skipped without it), SHAREGPT_CONVERSATIONS (default 100).
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
TRACES=${TRACES:-../shared/traces}
OUT=${OUT:-bench-out/fleet}
S=${TIME_SCALE:-20}
SGLANG_PYTHON=${SGLANG_PYTHON:-/work/peers/sglang-venv/bin/python}
N_CHAT=${SHAREGPT_CONVERSATIONS:-100}
PG=(nice -n 10 .venv/bin/python -m prefixgate replay --no-progress)
mkdir -p "$OUT"
uptime | tee "$OUT/uptime.txt"

if [[ $WHAT == mooncake || $WHAT == all ]]; then
  # 8 workers x 4,000 blocks of 512 tokens, 20k prefill tokens/s, 30 ms/token.
  M=(--trace "$TRACES/mooncake_synthetic_trace.jsonl" --capacity-tokens 2048000
     --prefill-tokens-per-s 20000 --decode-s-per-token 0.03 --max-tokens 1000
     --time-scale "$S")
  "${PG[@]}" "${M[@]}" --simulate --sim-workers 8 --sim-policies prefix --gateways 1,2,4 \
    --out "$OUT" --name mooncake-sim > /dev/null
  "${PG[@]}" "${M[@]}" --simulate --sim-workers 8 --sim-policies prefix --gateways 2,4 \
    --fleet-redis --out "$OUT" --name mooncake-sim-redis > /dev/null
  uptime | tee -a "$OUT/uptime.txt"
  "${PG[@]}" "${M[@]}" --fleet 8 --gateways 1,2,4 --out "$OUT" --name mooncake-gateways \
    > /dev/null
  "${PG[@]}" "${M[@]}" --fleet 8 --gateways 2,4 --fleet-redis --out "$OUT" \
    --name mooncake-redis > /dev/null
  if [[ -x $SGLANG_PYTHON ]]; then
    uptime | tee -a "$OUT/uptime.txt"
    "${PG[@]}" "${M[@]}" --fleet 8 --gateways 1,2 --sim-policies none \
      --peer-router "$SGLANG_PYTHON -m sglang_router.launch_router --policy cache_aware --prometheus-port {free_port}" \
      --peer-label "sglang-router 0.3.2 cache_aware" --out "$OUT" --name mooncake-sglang \
      > /dev/null
  fi
  runs=("$OUT/mooncake-gateways.json" "$OUT/mooncake-redis.json")
  [[ -f $OUT/mooncake-sglang.json ]] && runs+=("$OUT/mooncake-sglang.json")
  "${PG[@]}" --combine "$(IFS=,; echo "${runs[*]}")" --out "$OUT" --name mooncake
fi

if [[ $WHAT == sharegpt || $WHAT == all ]]; then
  # The race case: closed loop, no think time, turns sent without a conversation id (as
  # agents and OpenAI-style clients do: a follow-up is found by its cached prefix alone);
  # workers publish when a request finishes (the widest window for the race: engines that
  # publish with the reply; prefixgate's publishes at prefill end since abee3f4); with and
  # without routing predictions, 1 and 2 gateways over WatchEvents, 2 over Redis. The
  # simulator's follow-ups arrive the turnaround measured in this fleet after their reply
  # and its Redis events 12 ms late (docs/traces.md, "Turnaround and event delay"); each
  # fleet run's summary.turnaround re-measures the former.
  C=(--trace "$TRACES/sharegpt_multiturn_dev.jsonl.gz" --max-conversations "$N_CHAT"
     --arrival closed --concurrency 8 --think-time 0 --publish-at finish --no-conversation-ids
     --time-scale "$S")
  P=(--sim-policies prefix,prefix:prediction_ttl_s=0)
  "${PG[@]}" "${C[@]}" --simulate --sim-workers 8 "${P[@]}" --gateways 1,2 \
    --out "$OUT" --name sharegpt-sim > /dev/null
  "${PG[@]}" "${C[@]}" --simulate --sim-workers 8 "${P[@]}" --gateways 2 --fleet-redis \
    --out "$OUT" --name sharegpt-sim-redis > /dev/null
  uptime | tee -a "$OUT/uptime.txt"
  "${PG[@]}" "${C[@]}" --fleet 8 --gateways 1,2 "${P[@]}" --out "$OUT" \
    --name sharegpt-watch > /dev/null
  "${PG[@]}" "${C[@]}" --fleet 8 --gateways 2 --fleet-redis "${P[@]}" --out "$OUT" \
    --name sharegpt-redis > /dev/null
  "${PG[@]}" --combine "$OUT/sharegpt-watch.json,$OUT/sharegpt-redis.json" \
    --out "$OUT" --name sharegpt
fi

if [[ $WHAT == transfer ]]; then
  X=(--sim-policies prefix,prefix:transfer=0,prefix:load_weight=0:transfer=0)
  PEER=()
  [[ -x $SGLANG_PYTHON ]] && PEER=(--peer-router "$SGLANG_PYTHON -m sglang_router.launch_router --policy cache_aware --prometheus-port {free_port}"
                                   --peer-label "sglang-router 0.3.2 cache_aware")
  M=(--trace "$TRACES/mooncake_synthetic_trace.jsonl" --capacity-tokens 2048000
     --prefill-tokens-per-s 20000 --decode-s-per-token 0.03 --max-tokens 1000
     --time-scale "$S")
  C=(--trace "$TRACES/sharegpt_multiturn_dev.jsonl.gz" --max-conversations "$N_CHAT"
     --arrival closed --concurrency 8 --think-time 0 --publish-at finish --no-conversation-ids
     --time-scale "$S")
  for t in mooncake sharegpt; do
    if [[ $t == mooncake ]]; then A=("${M[@]}"); else A=("${C[@]}"); fi
    "${PG[@]}" "${A[@]}" --simulate --sim-workers 8 "${X[@]}" --out "$OUT" \
      --name "transfer-$t-sim" > /dev/null
    uptime | tee -a "$OUT/uptime.txt"
    "${PG[@]}" "${A[@]}" --fleet 8 "${X[@]}" "${PEER[@]}" --out "$OUT" \
      --name "transfer-$t" > /dev/null
  done
fi
uptime | tee -a "$OUT/uptime.txt"
