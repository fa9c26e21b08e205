#!/usr/bin/env bash
# Install everything the tests need, then run the whole suite (CPU; GPU tests skip) on two
# pytest-xdist workers (PDSERVE_TEST_WORKERS; 0: one process). Extra arguments go to pytest,
# e.g. scripts/test.sh -k engine -x
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/setup-env.sh
. scripts/setup-env.sh
export PYTHONUNBUFFERED=1
rc=0
workers=${PDSERVE_TEST_WORKERS:-2}
xdist=()
[ "$workers" = 0 ] || xdist=(-n "$workers" --dist loadscope --no-loadscope-reorder)  # units, order: tests/conftest.py
python -m pytest "${xdist[@]}" "$@" || rc=$?
if [ "$rc" = 5 ]; then echo "pytest collected no tests: failing" >&2; fi
exit "$rc"
