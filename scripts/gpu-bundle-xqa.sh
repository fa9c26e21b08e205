#!/usr/bin/env bash
# Add flashinfer's XQA sources (data/csrc/xqa, ~1 MB) to the slim flashinfer bundle that
# ../shared/gpu/prepare-device-packages.sh writes into .whl/ (it drops every csrc subfolder, so
# decode_attention = "xqa" cannot build on the GPU machine without this). Run once after it.
set -euo pipefail
R=$(git rev-parse --show-toplevel)
B="$R/.whl/flashinfer-0.7.4-slim.tar.xz"
[ -f "$B" ] || { echo "no $B: run ../shared/gpu/prepare-device-packages.sh first"; exit 1; }
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
tar xJf "$B" -C "$W"
if [ -f "$W/flashinfer/data/csrc/xqa/mha.cu" ]; then echo "XQA sources already in $B"; exit 0; fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp -d "$W/dl" flashinfer-python==0.7.4
unzip -q "$W"/dl/flashinfer_python-0.7.4-*.whl 'flashinfer/data/csrc/xqa/*' -d "$W"
(cd "$W" && tar cf - flashinfer tvm_ffi apache_tvm_ffi-*.dist-info flashinfer_python-*.dist-info \
  | xz -9 -T0 > "$B.new") && mv "$B.new" "$B"
echo "added XQA sources to $B ($(du -h "$B" | cut -f1))"
