"""Build hook: generate the gRPC/protobuf modules of pdserve.v1 from proto/ at build time.

The generated `pdserve/v1/*_pb2*.py` files are never edited or committed; every install
(`pip install .` or `pip install -e .`) regenerates them with the grpcio-tools pinned in
pyproject.toml's build requirements, so stubs always match the installed grpcio/protobuf.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()


def generate_protos() -> None:
    from grpc_tools import protoc  # build requirement

    sources = sorted((ROOT / "proto").rglob("*.proto"))
    if not sources:
        raise RuntimeError("no .proto sources under proto/")
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT / 'proto'}",
        f"-I{well_known}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *[str(s) for s in sources],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + ", ".join(map(str, sources)))


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
