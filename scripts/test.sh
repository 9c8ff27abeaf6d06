#!/usr/bin/env bash
# The whole test suite. Redis tests need Debian's redis-server; it is installed here when
# missing and we are root, and those tests skip (saying why) otherwise.
# Extra arguments go to pytest (e.g. -m "not slow" for the quick subset).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "test: installing redis-server" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null
fi
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "test: no tests were collected: that is a failure" >&2
  exit 1
fi
exit "$rc"
