#!/usr/bin/env bash
# Every GPU test and benchmark of prefixgate in one command, one JSON document
# (prefixgate/bench/gpu.py: Triton paged attention and re-rotation against the torch
# reference, model steps per backend, decode at batch 1 and 32, TTFT at a 4k cached
# history, re-rotation bandwidth as a share of copy bandwidth, CUDA graphs if built).
#
#   bash scripts/gpu_check.sh [--out FILE] [--dry-run]   run (JSON: FILE, default
#                                      $OUT/gpu_check.json when $OUT is set, else
#                                      ./gpu_check.json; a copy is printed on stdout)
#   bash scripts/gpu_check.sh --fetch-wheels [DIR]        on a machine with PyPI: fetch the
#                                      wheels a bare GPU machine lacks into DIR
#                                      (default .gpu-wheels, git-ignored) for Python 3.12
#
# Needs a Python with torch, triton and transformers (a GPU image has them: $PYTHON,
# else ./.venv/bin/python when present, else python3). prefixgate runs from this checkout
# (PYTHONPATH), not installed; its other dependencies come from .gpu-wheels when that is
# here (installed with --no-index into a private directory: the GPU machine has no
# network), else must already be importable. Without a CUDA device it says so, checks
# that the GPU run would run (imports, arguments, every section at tiny shapes on the CPU,
# Triton in its interpreter) and exits 0. Ends within 8 minutes (the run is capped at 7).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# The runtime dependencies a GPU image may lack or hold at too old a version (grpcio must
# match the generated stubs; protobuf >= 7.35). torch, triton, transformers, numpy,
# tokenizers, jinja2, aiohttp, safetensors, tqdm, pyyaml: the image's own.
WHEELS=(grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
        protobuf==7.36.2 gguf==0.19.0 redis==8.1.0 python-json-logger==4.2.0 tenacity==9.2.1
        msgspec==0.22.0 pyzmq==27.3.0 xxhash==4.1.0 prometheus-client==0.26.0
        cryptography==50.0.2 cffi==2.1.1 pycparser==3.12)

if [ "${1:-}" = "--fetch-wheels" ]; then
  dir=${2:-.gpu-wheels}
  mkdir -p "$dir"
  for w in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 --platform any -d "$dir" "$w"
  done
  echo "gpu_check: $(ls "$dir" | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1)); carry it to the GPU machine" >&2
  exit 0
fi

out="${OUT:+$OUT/}gpu_check.json"
dry=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --dry-run) dry=(--dry-run); shift ;;
    *) echo "gpu_check: unknown argument $1 (see the head of $0)" >&2; exit 2 ;;
  esac
done

py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

# What cannot be imported (or clashes at import: the stubs check grpcio's and protobuf's
# versions), "; "-separated; empty when the run can start.
missing() {
  "$py" - <<'EOF'
import importlib
names = ["torch", "triton", "transformers", "safetensors", "tokenizers", "jinja2", "gguf",
         "xxhash", "numpy", "tqdm", "prometheus_client", "pythonjsonlogger", "tenacity",
         "redis", "zmq", "msgspec", "cryptography", "grpc_health.v1", "grpc_reflection.v1alpha",
         "prefixgate.v1.chat_pb2_grpc", "prefixgate.v1.worker_pb2_grpc"]
bad = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:  # an ImportError, or a version clash raised at import
        bad.append(f"{name} ({type(exc).__name__}: {str(exc)[:160]})")
print("; ".join(bad))
EOF
}

lacking=$(missing)
if [ -n "$lacking" ] && compgen -G ".gpu-wheels/*.whl" >/dev/null; then
  site=${TMPDIR:-/tmp}/prefixgate-gpu-site
  echo "gpu_check: installing $(ls .gpu-wheels/*.whl | wc -l) wheels from .gpu-wheels into $site" >&2
  "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --upgrade --target "$site" .gpu-wheels/*.whl
  export PYTHONPATH=$root:$site:$PYTHONPATH
  lacking=$(missing)
fi
if [ -n "$lacking" ]; then
  echo "gpu_check: $py cannot import: $lacking" >&2
  echo "gpu_check: on a machine with PyPI run 'bash scripts/gpu_check.sh --fetch-wheels'" \
       "and bring .gpu-wheels along" >&2
  exit 1
fi

if [ ${#dry[@]} -eq 0 ] && ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device here: checking that the GPU run would run (dry run)" >&2
  dry=(--dry-run)
fi
mkdir -p "$(dirname "$out")"
timeout 420 "$py" -m prefixgate bench gpu --json --out "$out" "${dry[@]}"
if ! "$py" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["passed"] else 1)' "$out"; then
  echo "gpu_check: a check failed (\"checks\" in $out)" >&2
  exit 1
fi
if [ ${#dry[@]} -gt 0 ]; then
  echo "gpu_check: dry run passed (no GPU figures); on a GPU machine this writes $out" >&2
else
  echo "gpu_check: wrote $out" >&2
fi
