#!/usr/bin/env bash
# The container image, checked end to end (.ci/run's image step): build it with
# scripts/image.sh (CPU variant; OCI archive and SBOM written), run it under podman as an
# operator would (`pdserve up` on 0.0.0.0 with an API key, ports published on the host's
# loopback, a larger /dev/shm for Ray), wait for its HEALTHCHECK to report healthy, then send
# one request through gRPC (`pdserve generate`) and one through the OpenAI HTTP API from the
# host, and check the process runs as the non-root user.
#
#   scripts/image-smoke.sh [OUT_DIR]    OUT_DIR (default build/image/out) gets the archive,
#                                       the SBOM and pdserve-TAG.json (size, build seconds)
#
# As root with apt it installs podman, buildah, runc and debootstrap when missing. It skips
# (exit 0, the reason printed) only where podman cannot run a container at all (not root, or
# no podman and no apt); every other failure fails the step.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-build/image/out}
say() { echo "[image-smoke] $*"; }
skip() { say "SKIPPED: $*"; exit 0; }

[ "$(id -u)" = 0 ] || skip "podman here needs root (rootless podman needs subuid ranges this script does not set up)"
need=()
for tool in podman buildah runc debootstrap; do command -v "$tool" >/dev/null || need+=("$tool"); done
if [ "${#need[@]}" -gt 0 ]; then
  command -v apt-get >/dev/null || skip "no ${need[*]} and no apt-get to install them"
  say "installing ${need[*]} (apt)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
     --no-install-recommends podman buildah runc debootstrap uidmap netavark aardvark-dns \
     iptables) >/dev/null
fi
# shellcheck disable=SC1091
. scripts/setup-env.sh   # the host's client (pdserve generate) from the locked .venv

t0=$SECONDS
scripts/image.sh --variant cpu --out "$OUT"
tag=$(scripts/image.sh --print-tag cpu)
export CONTAINERS_CONF=$PWD/build/image/containers.conf   # runc, ulimits (image.sh wrote it)

name=pdserve-smoke-$$
key=$(python -c 'import secrets; print(secrets.token_hex(24))')
cleanup() {
  podman logs "$name" >build/image/smoke-container.log 2>&1 || true
  podman rm -f -t 10 "$name" >/dev/null 2>&1 || true
}
trap cleanup EXIT
say "running $tag"
podman run -d --name "$name" --shm-size=2g \
  -p 127.0.0.1::50051 -p 127.0.0.1::8000 -e PDSERVE_API_KEYS="$key smoke" \
  "$tag" pdserve up --host 0.0.0.0 >/dev/null
grpc_port=$(podman port "$name" 50051/tcp | sed 's/.*://')
http_port=$(podman port "$name" 8000/tcp | sed 's/.*://')

deadline=$((SECONDS + 600))
health=""
until [ "$health" = healthy ]; do
  if [ "$(podman inspect -f '{{.State.Running}}' "$name")" != true ]; then
    podman logs --tail 40 "$name" >&2 || true
    say "FAILED: the container exited" >&2
    exit 1
  fi
  if [ $SECONDS -ge $deadline ]; then
    podman logs --tail 40 "$name" >&2 || true
    say "FAILED: not healthy within 600 s (health: $health)" >&2
    exit 1
  fi
  podman healthcheck run "$name" >/dev/null 2>&1 || true
  health=$(podman inspect -f '{{.State.Health.Status}}' "$name" 2>/dev/null \
    || podman inspect -f '{{.State.Healthcheck.Status}}' "$name")
  [ "$health" = healthy ] || sleep 3
done
say "healthy after $((SECONDS - t0)) s (build included)"

uid=$(podman exec "$name" id -u)
[ "$uid" != 0 ] || { say "FAILED: the image runs as root" >&2; exit 1; }

say "gRPC: pdserve generate --target 127.0.0.1:$grpc_port"
PDSERVE_API_KEY=$key python -m deploy.cli generate "The lighthouse keeper" --max-tokens 12 \
  --target "127.0.0.1:$grpc_port" | tee build/image/smoke-grpc.txt
tr -s '\n' ' ' <build/image/smoke-grpc.txt | grep -q "+ 12 tokens · finish: length" \
  || { say "FAILED: the gRPC answer did not end by its length (12 tokens)" >&2; exit 1; }

say "HTTP: POST /v1/completions on 127.0.0.1:$http_port"
python - "$http_port" "$key" <<'PY'
import json, sys, urllib.request

port, key = sys.argv[1:]
body = json.dumps({"model": "tiny-v3-seed0", "prompt": "Once upon a time", "max_tokens": 12,
                   "temperature": 0}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                             headers={"content-type": "application/json",
                                      "authorization": f"Bearer {key}"})
with urllib.request.urlopen(req, timeout=120) as r:
    answer = json.load(r)
choice = answer["choices"][0]
assert 1 <= answer["usage"]["completion_tokens"] <= 12 and choice["text"], answer
assert choice["finish_reason"] in ("stop", "length"), answer  # eos, or the 12 tokens
print(f"[image-smoke]   {choice['text']!r} ({answer['usage']})")
PY
info=$(ls "$OUT"/pdserve-*-cpu.json)
say "passed: $(cat "$info" | tr -d '\n ')"
