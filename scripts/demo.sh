#!/usr/bin/env bash
# The main job: a local prefixgate (gateway + 2 workers, SmolLM2-135M-Instruct, embedded
# registry, no Redis) holding a short scripted multi-turn chat, then stopping.
# Extra arguments go to `prefixgate up` (see `prefixgate up --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/prefixgate up --model smollm2-135m --workers 2 --port 0 --demo "$@"
