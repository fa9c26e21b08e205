#!/usr/bin/env bash
# A CycloneDX SBOM of pdserve's installed environment, and a vulnerability audit of the
# locked runtime dependencies (docs/operations.md, "Supply chain").
#
#   scripts/sbom.sh [OUT_DIR]        default OUT_DIR: sbom/
#     OUT_DIR/pdserve-env.cdx.json   every package installed in $PDSERVE_VENV (default .venv),
#                                    from cyclonedx-py (CycloneDX's own Python tool)
#     OUT_DIR/pip-audit.json         known vulnerabilities of requirements.lock (pip-audit, PyPA),
#                                    as JSON; also printed as a table
#   PDSERVE_SBOM_TOOLS   venv of the two tools (default .venv-sbom), kept apart so they are
#                        not in the SBOM themselves
#   PDSERVE_AUDIT_STRICT=1  exit 1 when a vulnerability is found (default: report, exit 0)
#
# Needs the network: the tools come from PyPI, and pip-audit asks PyPI's JSON API for the
# known vulnerabilities of each pinned version. Where either cannot be reached (a mirror of
# the package index only, as on the developer machines) the script says so and exits 2;
# the SBOM is written all the same.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${PDSERVE_VENV:-.venv}
TOOLS=${PDSERVE_SBOM_TOOLS:-.venv-sbom}
OUT=${1:-sbom}
mkdir -p "$OUT"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[sbom] no environment at $VENV (scripts/setup-env.sh makes one)" >&2
  exit 2
fi
if [ ! -x "$TOOLS/bin/cyclonedx-py" ] || [ ! -x "$TOOLS/bin/pip-audit" ]; then
  echo "[sbom] installing cyclonedx-bom and pip-audit into $TOOLS"
  python3 -m venv "$TOOLS"
  if ! "$TOOLS/bin/python" -m pip install -q "cyclonedx-bom>=7.2,<8" "pip-audit>=2.9,<3"; then
    echo "[sbom] could not install the tools (no network?)" >&2
    exit 2
  fi
fi

"$TOOLS/bin/cyclonedx-py" environment "$VENV/bin/python" \
  --output-format JSON --output-file "$OUT/pdserve-env.cdx.json"
echo "[sbom] wrote $OUT/pdserve-env.cdx.json ($("$VENV/bin/python" -c \
  "import json,sys; print(len(json.load(open(sys.argv[1]))['components']), 'components')" \
  "$OUT/pdserve-env.cdx.json"))"

# --disable-pip: audit the pinned versions as they are (hashes checked, nothing installed).
rc=0
"$TOOLS/bin/pip-audit" --requirement requirements.lock --disable-pip --require-hashes \
  --format json --output "$OUT/pip-audit.json" --progress-spinner off || rc=$?
summary=0
"$TOOLS/bin/python" - "$OUT/pip-audit.json" <<'PY' || summary=$?
import json, sys
data = json.load(open(sys.argv[1]))
deps = data.get("dependencies", data) if isinstance(data, dict) else data
found = [(d["name"], d["version"], v["id"], ",".join(v.get("fix_versions", [])) or "-")
         for d in deps for v in d.get("vulns", [])]
skipped = [d["name"] for d in deps if d.get("skip_reason")]
if deps and len(skipped) == len(deps):
    print(f"[sbom] pip-audit could look up none of the {len(deps)} locked packages: PyPI's "
          "vulnerability data is not reachable from here (nothing was audited)")
    sys.exit(2)
print(f"[sbom] audited {len(deps) - len(skipped)} of {len(deps)} locked packages: "
      f"{len(found)} known vulnerabilities"
      + (f"; not found on PyPI: {', '.join(skipped)}" if skipped else ""))
for name, version, vid, fixes in found:
    print(f"  {name} {version}: {vid} (fixed in {fixes})")
PY
if [ "$summary" = 2 ]; then
  exit 2
fi
if [ "$rc" != 0 ] && [ "${PDSERVE_AUDIT_STRICT:-0}" = 1 ]; then
  exit 1
fi
