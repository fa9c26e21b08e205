#!/usr/bin/env bash
# pdserve on a multi-node Ray cluster over real links, and the faults a network shows: a node's
# link down mid-stream, a node's processes killed mid-stream, a slow link
# (tests/integration/deploy/multinode_scenario.py; docs/operations.md, "Multi-node over real
# links"). Four network namespaces joined by veth pairs and a bridge are the hosts: `ray start
# --head` / `ray start --address` in them, `pdserve up --address` on the head, the prefill
# worker on one host and a decode worker on each of two others (UCX over TCP on the veths).
# Needs root and iproute2 (`ip`, and `tc` for the slow link); .ci/run runs it as its own step
# (see docs/benchmarks.md, "Deployment", for how long it takes).
#
#   scripts/multinode.sh [OUT.json]    the figures (placement, hand-off time and GB/s across
#                                      the veth and within one host, fault timings)
#
# Exit 0 passed, 1 failed; where namespaces cannot be made (not root, no iproute2, a
# container without CAP_NET_ADMIN) it says why and exits 0 as a skip.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
. scripts/setup-env.sh   # the locked .venv (and Debian's redis-server, as root)
out=${1:-build/multinode.json}
mkdir -p "$(dirname "$out")"
if { ! command -v ip || ! command -v tc; } >/dev/null && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2) >/dev/null
fi
rc=0
timeout 2400 python tests/integration/deploy/multinode_scenario.py --out "$out" || rc=$?
case $rc in
  0) echo "[multinode] passed; figures in $out" ;;
  3) echo "[multinode] SKIPPED: network namespaces cannot be made here (see the line above)" ;;
  *) echo "[multinode] FAILED (exit $rc)" >&2; exit 1 ;;
esac
