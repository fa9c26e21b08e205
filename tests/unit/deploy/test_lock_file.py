"""The three locks (scripts/lock.sh) pin every dependency within its pyproject.toml range, each
with sha256 hashes, and agree with each other; the pdserve.v1 stubs that the locked
grpcio-tools generated run on the grpcio and protobuf installed beside them.

The stub check reads the generated files as text, never imports them: a stub that needs a
newer grpcio raises at import, and this test is where that failure gets its explanation."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).parents[3]
RUNTIME_LOCK = "requirements.lock"
TEST_LOCK = "requirements-test.lock"
BUILD_LOCK = "requirements-build.lock"
REFRESH = (
    "refresh the locks together: scripts/lock.sh --upgrade-package grpcio "
    "--upgrade-package grpcio-tools --upgrade-package protobuf (README, 'Updating the locks'), "
    "then reinstall (rm -r .venv; scripts/test.sh)"
)


def pins(name: str) -> dict[str, tuple[Version, list[str]]]:
    """Package → (pinned version, its sha256 hashes) of one lock file."""
    text = (ROOT / name).read_text()
    found: dict[str, tuple[Version, list[str]]] = {}
    for block in re.split(r"\n(?=[a-z0-9])", text):
        first = block.split(" ", 1)[0].strip()
        if "==" not in first or first.startswith("#"):
            continue
        package, pinned = first.split("==")
        found[canonicalize_name(package)] = (
            Version(pinned),
            re.findall(r"sha256:[0-9a-f]{64}", block),
        )
    return found


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def assert_in_range(specs: list[str], locked: dict[str, tuple[Version, list[str]]]) -> None:
    for spec in specs:
        req = Requirement(spec)
        if canonicalize_name(req.name) == "pdserve":
            continue  # the test extra names pdserve[bench]: installed from the checkout
        assert canonicalize_name(req.name) in locked, f"{req.name} is not locked"
        pinned, _ = locked[canonicalize_name(req.name)]
        assert req.specifier.contains(pinned, prereleases=True), (req, pinned)


def test_every_runtime_dependency_is_pinned_in_range_with_hashes() -> None:
    locked = pins(RUNTIME_LOCK)
    assert_in_range(project()["project"]["dependencies"], locked)
    assert all(hashes for _, hashes in locked.values())
    assert str(locked["torch"][0]) == "2.13.0+cpu"


def test_test_lock_pins_the_test_and_bench_extras_and_agrees_with_the_runtime_lock() -> None:
    runtime, test = pins(RUNTIME_LOCK), pins(TEST_LOCK)
    extras = project()["project"]["optional-dependencies"]
    assert_in_range(extras["test"] + extras["bench"], test)
    assert all(hashes for _, hashes in test.values())
    assert "pdserve" not in test
    for package, (pinned, _) in runtime.items():
        assert test[package][0] == pinned, f"{package}: {TEST_LOCK} differs from {RUNTIME_LOCK}"


def test_build_lock_pins_pip_and_every_build_requirement_as_the_runtime_lock_does() -> None:
    runtime, build = pins(RUNTIME_LOCK), pins(BUILD_LOCK)
    assert_in_range(project()["build-system"]["requires"], build)
    assert {"pip", "setuptools", "wheel", "grpcio-tools"} <= set(build)
    assert all(hashes for _, hashes in build.values())
    for package in set(build) & set(runtime):
        assert build[package][0] == runtime[package][0], (
            f"{package}: {BUILD_LOCK} differs from {RUNTIME_LOCK}"
        )


def grpc_tools_mismatch(tools: Version, grpcio: Version) -> str | None:
    """Why stubs made by grpcio-tools `tools` cannot run on grpcio `grpcio` (None: they can).
    Generated code needs grpcio >= the version of the tools that made it; the locks keep both
    on one release line."""
    if tools > grpcio:
        return f"grpcio-tools {tools} makes stubs that need grpcio>={tools}, not {grpcio}"
    if tools.release[:2] != grpcio.release[:2]:
        return f"grpcio-tools {tools} and grpcio {grpcio} are on different release lines"
    return None


@pytest.mark.parametrize(
    ("tools", "grpcio", "ok"),
    [
        ("1.85.1", "1.85.3", True),
        ("1.85.3", "1.85.3", True),
        ("1.85.4", "1.85.3", False),
        ("1.84.2", "1.85.3", False),
    ],
)
def test_grpc_tools_mismatch_names_what_cannot_run(tools: str, grpcio: str, ok: bool) -> None:
    assert (grpc_tools_mismatch(Version(tools), Version(grpcio)) is None) == ok


def test_locked_grpcio_tools_makes_stubs_the_locked_grpcio_runs() -> None:
    tools = pins(BUILD_LOCK)["grpcio-tools"][0]
    grpcio = pins(RUNTIME_LOCK)["grpcio"][0]
    problem = grpc_tools_mismatch(tools, grpcio)
    assert problem is None, f"{BUILD_LOCK} vs {RUNTIME_LOCK}: {problem}; {REFRESH}"


def stub_requirements(grpc_stub: str, pb2_stub: str) -> tuple[Version, Version]:
    """(grpcio, protobuf) versions that generated pdserve.v1 code declares it needs."""
    grpc_needs = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", grpc_stub, re.M)
    pb_needs = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
        r"(\d+),\s*(\d+),\s*(\d+),",
        pb2_stub,
    )
    assert grpc_needs and pb_needs, "the generated stubs' version checks were not found"
    return Version(grpc_needs.group(1)), Version(".".join(pb_needs.groups()))


def stub_problems(needs_grpc: Version, needs_pb: Version, grpc: Version, pb: Version) -> list[str]:
    """What keeps stubs that need (needs_grpc, needs_pb) from importing on (grpc, pb)."""
    problems = []
    if needs_grpc > grpc:
        problems.append(f"the stubs need grpcio>={needs_grpc}, grpcio {grpc} is installed")
    if needs_pb.major != pb.major or needs_pb > pb:
        problems.append(
            f"the stubs need protobuf {needs_pb.major}.x >= {needs_pb}, {pb} is installed"
        )
    return problems


def test_stub_problems_reports_a_newer_generator_than_the_runtime() -> None:
    grpc_text = "import grpc\n\nGRPC_GENERATED_VERSION = '1.85.4'\n"
    pb_text = (
        "_runtime_version.ValidateProtobufRuntimeVersion(\n"
        "    _runtime_version.Domain.PUBLIC,\n    7,\n    37,\n    0,\n    '',\n)\n"
    )
    needs = stub_requirements(grpc_text, pb_text)
    assert needs == (Version("1.85.4"), Version("7.37.0"))
    assert stub_problems(*needs, Version("1.85.3"), Version("7.36.2")) == [
        "the stubs need grpcio>=1.85.4, grpcio 1.85.3 is installed",
        "the stubs need protobuf 7.x >= 7.37.0, 7.36.2 is installed",
    ]
    assert stub_problems(*needs, Version("1.85.4"), Version("8.0.0")) == [
        "the stubs need protobuf 7.x >= 7.37.0, 8.0.0 is installed"
    ]
    assert stub_problems(*needs, Version("1.85.4"), Version("7.37.1")) == []


def test_generated_stubs_run_on_the_installed_grpcio_and_protobuf() -> None:
    v1 = ROOT / "pdserve" / "v1"
    if not (v1 / "serving_pb2_grpc.py").exists():
        pytest.fail("pdserve/v1 has no generated stubs: install pdserve (scripts/setup-env.sh)")
    needs = stub_requirements(
        (v1 / "serving_pb2_grpc.py").read_text(), (v1 / "serving_pb2.py").read_text()
    )
    problems = stub_problems(
        *needs, Version(installed_version("grpcio")), Version(installed_version("protobuf"))
    )
    assert not problems, "; ".join(problems) + f": {REFRESH}"
