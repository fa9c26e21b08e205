#!/usr/bin/env bash
# Write .whl/xgrammar-0.2.9.tar.xz: xgrammar and pydantic (which it imports) for the GPU
# machine's Python 3.12, which has neither (`python -m benchmarks structured` needs them;
# benchmarks/gpu_validate.sh unpacks every .whl/*.tar.xz into /tmp/site). apache-tvm-ffi, which
# xgrammar also needs, comes with the flashinfer bundle (0.1.15.post2, the version the locks
# pin). ~4 MB; needs the network here.
set -euo pipefail
R=$(git rev-parse --show-toplevel)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp -d "$W/dl" xgrammar==0.2.9 pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated_types==0.8.0 typing_inspection==0.4.5
for w in "$W"/dl/*.whl; do unzip -q -o "$w" -d "$W/site"; done
(cd "$W/site" && tar cf - . | xz -9 -T0 > "$R/.whl/xgrammar-0.2.9.tar.xz")
echo "wrote $R/.whl/xgrammar-0.2.9.tar.xz ($(du -h "$R/.whl/xgrammar-0.2.9.tar.xz" | cut -f1))"
