"""The SBOM of pdserve's container image, as CycloneDX 1.5 JSON (scripts/image.sh runs it).

Its inputs are read from inside the image by the image's own tools: pip's inventory of the
venv (`python -m pip inspect --local`, pip's stable JSON report, version 1) and dpkg's list of
the system's Debian packages (`dpkg-query -W -f '${Package}\\t${Version}\\t${Architecture}\\n'`).
Each becomes a component with its package URL (`pkg:pypi/...`, `pkg:deb/debian/...`) and, for
Python distributions, the license their metadata declares. Standard library only.

    python3 scripts/image_sbom.py --image TAG --image-id ID --pip-inspect FILE --dpkg FILE
        --out FILE.cdx.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import uuid
from pathlib import Path
from typing import Any


def python_components(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One library component per installed distribution of `pip inspect`'s report."""
    if str(report.get("version")) != "1":
        raise ValueError(f"pip inspect: report version {report.get('version')!r}, expected '1'")
    components = []
    for dist in report["installed"]:
        meta = dist["metadata"]
        name = meta["name"]
        normalized = re.sub(r"[-_.]+", "-", name).lower()
        component: dict[str, Any] = {
            "type": "library",
            "bom-ref": f"pkg:pypi/{normalized}@{meta['version']}",
            "name": name,
            "version": meta["version"],
            "purl": f"pkg:pypi/{normalized}@{meta['version']}",
        }
        license_ = meta.get("license_expression") or meta.get("license")
        if license_ and len(license_) < 100 and "\n" not in license_:
            component["licenses"] = [{"license": {"name": license_}}]
        components.append(component)
    return components


def debian_components(listing: str) -> list[dict[str, Any]]:
    """One component per line `NAME<TAB>VERSION<TAB>ARCH` of dpkg-query's listing."""
    components = []
    for number, line in enumerate(listing.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            raise ValueError(
                f"dpkg listing line {number}: expected NAME VERSION ARCH, got {line!r}"
            )
        name, version, arch = parts
        purl = f"pkg:deb/debian/{name}@{version}?arch={arch}&distro=bookworm"
        components.append({"type": "library", "bom-ref": purl, "name": name,
                           "version": version, "purl": purl})  # fmt: skip
    return components


def sbom(image: str, image_id: str, pip_report: dict[str, Any], dpkg: str) -> dict[str, Any]:
    """The CycloneDX document: the image as its subject, every package as a component."""
    name, _, version = image.rpartition(":")
    components = python_components(pip_report) + debian_components(dpkg)
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{uuid.uuid4()}",
        "version": 1,
        "metadata": {
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "tools": {
                "components": [
                    {"type": "application", "name": "pdserve image_sbom.py"},
                    {"type": "application", "name": "pip inspect"},
                    {"type": "application", "name": "dpkg-query"},
                ]
            },
            "component": {
                "type": "container",
                "bom-ref": image,
                "name": name,
                "version": version,
                "hashes": [{"alg": "SHA-256", "content": image_id.removeprefix("sha256:")}],
            },
        },
        "components": components,
        "dependencies": [{"ref": image, "dependsOn": [c["bom-ref"] for c in components]}],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", required=True, help="the image's tag")
    parser.add_argument("--image-id", required=True, help="the image's id (sha256)")
    parser.add_argument("--pip-inspect", required=True, type=Path)
    parser.add_argument("--dpkg", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    doc = sbom(args.image, args.image_id, json.loads(args.pip_inspect.read_text()),
               args.dpkg.read_text())  # fmt: skip
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    kinds = [c["purl"].split("/")[0] for c in doc["components"]]
    print(
        f"[image] SBOM: {kinds.count('pkg:pypi')} Python distributions, "
        f"{kinds.count('pkg:deb')} Debian packages -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
