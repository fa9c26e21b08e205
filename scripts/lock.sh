#!/usr/bin/env bash
# Regenerate requirements.lock: pdserve's runtime dependencies (pyproject.toml, no extras)
# resolved and pinned, each with the sha256 of every file pip may install it from.
# pip-tools runs from a venv of its own ($PDSERVE_LOCK_TOOLS, default .venv-lock); the
# resolution uses this machine's pip configuration (PyPI, and the local wheels torch's CPU
# build comes from), with scripts/lock-constraints.txt on top. Needs the network.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TOOLS=${PDSERVE_LOCK_TOOLS:-.venv-lock}
if [ ! -x "$TOOLS/bin/pip-compile" ]; then
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q "pip-tools>=7.5,<8"
fi
"$TOOLS/bin/pip-compile" --allow-unsafe --constraint=scripts/lock-constraints.txt \
  --generate-hashes --no-emit-find-links --no-emit-index-url --output-file=requirements.lock \
  --strip-extras pyproject.toml
