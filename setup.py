"""Build step of the package: the generated gRPC modules (kvfleet/v1) are made from protos/ when a
wheel or sdist install is built, so `pip install .` of a clean clone imports (kvfleet/v1 is not
in git). grpcio-tools is a build requirement only (pyproject.toml's [build-system])."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTOS = ROOT / "protos"


class BuildWithProtos(build_py):
    """build_py, then protoc over protos/kvfleet/v1/*.proto into the build tree."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install uses the checkout's kvfleet/v1 (`make protos`)
        from grpc_tools import protoc  # a build requirement

        out = Path(self.build_lib)
        (out / "kvfleet" / "v1").mkdir(parents=True, exist_ok=True)
        sources = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "kvfleet" / "v1").glob("*.proto"))
        include = str(Path(protoc.__file__).parent / "_proto")  # google/protobuf/*.proto
        args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}"]
        if protoc.main([*args, f"--grpc_python_out={out}", *sources]) != 0:
            raise RuntimeError(f"protoc failed on {sources}")
        (out / "kvfleet" / "v1" / "__init__.py").touch()


setup(cmdclass={"build_py": BuildWithProtos})
