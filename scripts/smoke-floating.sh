#!/usr/bin/env bash
# The floating install, checked: what `pip install pdserve` gets from a wheel, with every
# dependency and every build tool the newest within pyproject.toml's ranges (no lock). It
# builds pdserve's wheel from a copy of the checkout (in an isolated build environment, as
# pip does for a user), installs it into a venv of its own, imports every module of every
# package from outside the checkout, and sends one request through a local cluster on the
# embedded defaults. A release upstream that breaks the floating path fails here, by name,
# while the suite keeps running on the locks (.ci/run runs both).
#
#   PDSERVE_FLOAT_VENV   the venv (default .venv-float; made afresh each run)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
VENV=${PDSERVE_FLOAT_VENV:-.venv-float}
case $VENV in /*) ;; *) VENV=$REPO/$VENV ;; esac
work=$(mktemp -d)
log=$work/smoke.log
state=$work/state
cleanup() {
  PDSERVE_STATE_FILE=$state/cluster.json "$VENV/bin/pdserve" down >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
say() { echo "[smoke-floating] $*"; }
run() {  # one logged command; on failure the log's tail and the step that failed
  echo "+ $*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    tail -40 "$log" >&2
    say "FAILED at: $*" >&2
    exit 1
  fi
}
t0=$SECONDS
rm -rf "$VENV"
python3 -m venv "$VENV"
py=$VENV/bin/python
say "installing the newest pip and torch==2.13.0 (the CPU wheel) into $VENV"
run "$py" -m pip install --upgrade pip
run "$py" -m pip install torch==2.13.0
say "building pdserve's wheel (isolated build, floating build tools) from a copy of the checkout"
mkdir -p "$work/src" "$work/dist"
git ls-files -z --cached --others --exclude-standard | (cd "$REPO" && tar -c --null -T -) \
  | tar -x -C "$work/src"
run "$py" -m pip wheel --no-deps -w "$work/dist" "$work/src"
say "installing it with its dependencies resolved afresh"
run "$py" -m pip install "$work"/dist/pdserve-*.whl
run "$py" -m pip check
grep -E '^(grpcio|grpcio-tools|protobuf|setuptools) ' <("$py" -m pip list 2>/dev/null) \
  | tr -s ' ' | sed 's/^/[smoke-floating]   /' || true
cd "$work"
say "importing every module of every package (from outside the checkout)"
run "$py" - <<'EOF'
import importlib
import pkgutil
import tomllib
import zipfile
from pathlib import Path

wheel = next(Path("dist").glob("pdserve-*.whl"))
names = sorted({n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()
                if n.endswith("/__init__.py")})
# Modules that need an extra (bench: locust, matplotlib; gpu: flashinfer) are skipped by the
# import error naming that extra's package.
optional = {"locust", "matplotlib", "flashinfer", "gevent", "geventhttpclient", "httpx2", "psutil",
            "triton"}
count = 0
for name in names:
    package = importlib.import_module(name)
    assert "/site-packages/" in package.__file__, f"{name} was imported from {package.__file__}"
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        if info.name.endswith(".__main__"):  # `python -m` entry points run when imported
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] in optional:
                continue
            raise
        count += 1
from pdserve.v1 import serving_pb2_grpc

print(f"imported {count} modules of {len(names)} packages ({', '.join(names)}); stubs by "
      f"grpcio-tools {serving_pb2_grpc.GRPC_GENERATED_VERSION}")
EOF
tail -1 "$log" | sed 's/^/[smoke-floating] /'
say "one request through a local cluster (embedded defaults)"
export PDSERVE_STATE_FILE=$state/cluster.json
run "$VENV/bin/pdserve" up --detach
run "$VENV/bin/pdserve" generate "The lighthouse keeper writes the weather" --max-tokens 16
grep -v '^+' "$log" | tail -4 | sed 's/^/[smoke-floating]   /'
run "$VENV/bin/pdserve" down
say "passed in $((SECONDS - t0)) s"
