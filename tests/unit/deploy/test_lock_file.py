"""requirements.lock (scripts/lock.sh) pins every runtime dependency of pyproject.toml within
its range, each with sha256 hashes (pip install --require-hashes), torch as the CPU build."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).parents[3]


def pins() -> dict[str, tuple[Version, list[str]]]:
    text = (ROOT / "requirements.lock").read_text()
    found: dict[str, tuple[Version, list[str]]] = {}
    for block in re.split(r"\n(?=[a-z0-9])", text):
        first = block.split(" ", 1)[0].strip()
        if "==" not in first or first.startswith("#"):
            continue
        name, version = first.split("==")
        found[canonicalize_name(name)] = (
            Version(version),
            re.findall(r"sha256:[0-9a-f]{64}", block),
        )
    return found


def test_every_runtime_dependency_is_pinned_in_range_with_hashes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    locked = pins()
    for spec in project["dependencies"]:
        req = Requirement(spec)
        version, _ = locked[canonicalize_name(req.name)]
        assert req.specifier.contains(version, prereleases=True), (req, version)
    assert all(hashes for _, hashes in locked.values())
    assert str(locked["torch"][0]) == "2.13.0+cpu"
