#!/usr/bin/env bash
# Regenerate the three lock files together, each pin with the sha256 of every file pip may
# install it from (README, "Updating the locks"):
#   requirements.lock        pdserve's runtime dependencies (pyproject.toml, no extras)
#   requirements-test.lock   the same pins plus the `test` extra (test and bench tools)
#   requirements-build.lock  every tool that runs while pdserve installs: pip itself and
#                            pyproject.toml's [build-system] requires (setuptools, wheel,
#                            grpcio-tools), installed before pdserve is built without isolation
# The three agree on every package they share (the later two are constrained by the pins of
# requirements.lock), and grpcio-tools is the newest release of grpcio's own major.minor that
# is not newer than the locked grpcio: the stubs it generates need grpcio >= its own version.
#
#   scripts/lock.sh                       keep today's pins, add what pyproject.toml now needs
#   scripts/lock.sh --upgrade             newest versions within pyproject.toml's ranges
#   scripts/lock.sh --upgrade-package grpcio --upgrade-package grpcio-tools
#
# Extra arguments go to every pip-compile call. pip-tools runs from a venv of its own
# ($PDSERVE_LOCK_TOOLS, default .venv-lock); the resolution uses this machine's pip
# configuration (PyPI, and the local wheels torch's CPU build comes from), with
# scripts/lock-constraints.txt on top. Needs the network.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TOOLS=${PDSERVE_LOCK_TOOLS:-.venv-lock}
PIP_TOOLS_VERSION=7.7.0
if [ "$("$TOOLS/bin/python" -m pip show pip-tools 2>/dev/null | sed -n 's/^Version: //p')" \
     != "$PIP_TOOLS_VERSION" ]; then
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q "pip-tools==$PIP_TOOLS_VERSION"
fi
compile() {
  "$TOOLS/bin/pip-compile" --quiet --allow-unsafe --generate-hashes --no-emit-find-links \
    --no-emit-index-url --strip-extras --constraint=scripts/lock-constraints.txt "$@"
}
# Inputs derived here go to a git-ignored folder (pip-compile cites their paths in the locks).
work=build/lock
rm -rf "$work" && mkdir -p "$work"

echo "[lock] requirements.lock (runtime)"
compile --output-file=requirements.lock "$@" pyproject.toml

# The runtime pins as constraints of the other two locks (name==version lines, no hashes).
sed -n 's/^\([A-Za-z0-9._-]*==[^ ]*\).*/\1/p' requirements.lock > "$work/runtime-pins.txt"
grpcio=$(sed -n 's/^grpcio==//p' "$work/runtime-pins.txt")
[ -n "$grpcio" ] || { echo "[lock] requirements.lock pins no grpcio" >&2; exit 1; }
printf 'grpcio-tools>=%s.0,<=%s\n' "${grpcio%.*}" "$grpcio" > "$work/grpcio-tools.txt"

echo "[lock] requirements-test.lock (runtime + the test extra)"
compile --constraint="$work/runtime-pins.txt" --extra=test \
  --output-file=requirements-test.lock "$@" pyproject.toml
# The test extra names pdserve[bench]: pip-compile pins pdserve itself as a file:// URL (with a
# warning that it cannot be hashed). pdserve is installed from the checkout: drop that entry.
sed -i '/^# WARNING: pip install will require the following package to be hashed/,/^    # via pdserve (pyproject.toml)$/d' \
  requirements-test.lock

echo "[lock] requirements-build.lock (pip + [build-system] requires, grpcio-tools <= $grpcio)"
"$TOOLS/bin/python" -c '
import tomllib
print("pip")
for req in tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]:
    print(req)' > "$work/pyproject-build-system.in"
compile --constraint="$work/runtime-pins.txt" --constraint="$work/grpcio-tools.txt" \
  --output-file=requirements-build.lock "$@" "$work/pyproject-build-system.in"
echo "[lock] wrote requirements.lock, requirements-test.lock, requirements-build.lock"
