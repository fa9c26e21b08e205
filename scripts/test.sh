#!/usr/bin/env bash
# Install everything the tests need, then run the whole suite (CPU; GPU tests skip).
# Extra arguments go to pytest, e.g. scripts/test.sh -k engine -x
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/setup-env.sh
. scripts/setup-env.sh
export PYTHONUNBUFFERED=1
rc=0
python -m pytest "$@" || rc=$?
if [ "$rc" = 5 ]; then echo "pytest collected no tests: failing" >&2; fi
exit "$rc"
