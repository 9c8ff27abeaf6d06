#!/usr/bin/env bash
# The main job: a local prefixgate (gateway + 2 workers, SmolLM2-135M-Instruct, embedded
# registry, no Redis) holding a short scripted multi-turn chat, then stopping.
# Extra arguments go to `prefixgate up` (see `prefixgate up --help`). The demo talks gRPC
# only, so the HTTP API stays off (a busy port 8000 must not stop it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/prefixgate up --model smollm2-135m --workers 2 --port 0 --http-port -1 --demo "$@"
