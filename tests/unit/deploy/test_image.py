"""The container image's files agree with each other, without building anything: the KubeRay
manifest runs exactly the tag scripts/image.sh builds, every build argument the script passes
(cpu and gpu) is declared and documented in the Containerfile, and the SBOM script turns pip's
and dpkg's inventories into CycloneDX components (the build itself: scripts/image-smoke.sh)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from scripts.image_sbom import debian_components, python_components, sbom

REPO = Path(__file__).parents[3]
CONTAINERFILE = REPO / "deploy" / "image" / "Containerfile"


def image_sh(*args: str) -> list[str]:
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "image.sh"), *args],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return done.stdout.splitlines()


def test_kuberay_manifest_runs_the_tag_image_sh_builds() -> None:
    (tag,) = image_sh("--print-tag", "gpu")
    text = (REPO / "deploy" / "configs" / "kuberay.yaml").read_text()
    images = re.findall(r"^\s*-? ?image: (\S+)$", text, flags=re.MULTILINE)
    containers = [c for doc in yaml.safe_load_all(text) for c in _containers(doc)]
    assert [c["image"] for c in containers] == images
    assert len(images) == 3  # the head and both worker groups
    assert set(images) == {tag}


def _containers(node: object) -> list[dict[str, object]]:
    """Every container spec (a mapping with `image`) anywhere in a parsed manifest."""
    if isinstance(node, dict):
        found = [node] if "image" in node else []
        return found + [c for v in node.values() for c in _containers(v)]
    if isinstance(node, list):
        return [c for v in node for c in _containers(v)]
    return []


def test_the_tag_names_pyproject_version_and_the_locked_ray() -> None:
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    ray = re.search(r"^ray==(\S+) ", (REPO / "requirements.lock").read_text(), re.M)
    assert version and ray
    for variant in ("cpu", "gpu"):
        assert image_sh("--print-tag", variant) == [
            f"localhost/pdserve:{version[1]}-ray{ray[1]}-{variant}"
        ]


@pytest.mark.parametrize(
    "variant", ["cpu", "gpu"], ids=["cpu-image", "cuda-image"]
)  # "gpu" would mark it
def test_every_build_arg_is_declared_and_documented(variant: str) -> None:
    text = CONTAINERFILE.read_text()
    declared = set(re.findall(r"^ARG (\w+)", text, flags=re.MULTILINE))
    header = text.split("\nARG ", 1)[0]
    passed = dict(line.split("=", 1) for line in image_sh("--print-args", variant))
    assert set(passed) == declared, f"image.sh passes {set(passed)}, the file declares {declared}"
    for name in declared:
        assert re.search(rf"^#   {name} ", header, flags=re.MULTILINE), f"ARG {name} undocumented"
    assert passed["VARIANT"] == variant
    if variant == "cpu":  # the CPU image installs every package, torch too, from the hashed lock
        assert passed["TORCH"] == "locked" and passed["EXTRAS"] == ""
    else:
        assert passed["TORCH"].startswith("torch==") and passed["EXTRAS"] == "gpu"


def test_image_sh_refuses_an_unknown_variant() -> None:
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "image.sh"), "--variant", "tpu"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--variant: must be cpu or gpu, got 'tpu'" in done.stderr


def test_containerfile_runs_as_a_non_root_user_with_a_health_check() -> None:
    lines = [line for line in CONTAINERFILE.read_text().splitlines() if not line.startswith("#")]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert any(line.startswith("HEALTHCHECK ") for line in lines)


def test_sbom_lists_python_and_debian_packages_with_purls() -> None:
    report = {
        "version": "1",
        "installed": [
            {"metadata": {"name": "Ray", "version": "2.60.0", "license": "Apache 2.0"}},
            {"metadata": {"name": "typing_extensions", "version": "4.15.0"}},
        ],
    }
    doc = sbom("localhost/pdserve:0.1.0-ray2.60.0-cpu", "sha256:ab12", report,
               "python3.11\t3.11.2-6+deb12u6\tamd64\n\ntini\t0.19.0-1\tamd64\n")  # fmt: skip
    purls = [c["purl"] for c in doc["components"]]
    assert purls == [
        "pkg:pypi/ray@2.60.0",
        "pkg:pypi/typing-extensions@4.15.0",
        "pkg:deb/debian/python3.11@3.11.2-6+deb12u6?arch=amd64&distro=bookworm",
        "pkg:deb/debian/tini@0.19.0-1?arch=amd64&distro=bookworm",
    ]
    assert doc["components"][0]["licenses"] == [{"license": {"name": "Apache 2.0"}}]
    subject = doc["metadata"]["component"]
    assert (subject["name"], subject["version"]) == ("localhost/pdserve", "0.1.0-ray2.60.0-cpu")
    assert subject["hashes"] == [{"alg": "SHA-256", "content": "ab12"}]
    assert doc["dependencies"][0]["dependsOn"] == purls


def test_sbom_refuses_inputs_it_does_not_understand() -> None:
    with pytest.raises(ValueError, match="report version '2'"):
        python_components({"version": "2", "installed": []})
    with pytest.raises(ValueError, match="dpkg listing line 1: expected NAME VERSION ARCH"):
        debian_components("tini 0.19.0-1 amd64\n")
