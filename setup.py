"""Build step of the package: the generated gRPC modules (kvfleet/v1) are made from protos/ when a
wheel or sdist install is built, so `pip install .` of a clean clone imports (kvfleet/v1 is not
in git). grpcio-tools is a build requirement only (pyproject.toml's [build-system]).

The worker's C libraries (worker_svc/model/native.py: the fused CPU ops, the int8 kernels per
level) are compiled here too, as extensions (plain shared libraries that ctypes loads, no Python
C API), with the flags the worker's first-use compile uses; an editable install (`make install`)
puts them next to their sources. One the compiler cannot build is skipped with a warning."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.errors import CompileError

ROOT = Path(__file__).resolve().parent
PROTOS = ROOT / "protos"
sys.path.insert(0, str(ROOT))
from worker_svc.model import native  # noqa: E402  (standard library only: no torch at build time)

LIBRARIES = {f"worker_svc.model._{spec.name}": spec for spec in native.LIBRARIES}


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


class BuildNative(build_ext):
    """Each extension is one of native.LIBRARIES, compiled by native.compile_library (the exact
    flags of the first-use compile, no Python's CFLAGS). With OpenMP on Linux, where torch's
    wheels bring libgomp.so.1 (torch itself is not installed at build time), without it where
    the compiler has none. A record of what was built (native.BUILD_INFO) goes beside them."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:  # the libraries are independent: one compiler a core (8 s -> 4 s on 2)
            self.parallel = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def build_extensions(self) -> None:
        self.built: dict[str, bool] = {}
        super().build_extensions()  # each extension is optional: a failure is a warning
        out = Path(self.build_lib) / "worker_svc" / "model" / native.BUILD_INFO
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(native.build_record(self.built), indent=1) + "\n")
        for spec in native.LIBRARIES:
            if spec.name not in self.built:
                self.warn(f"{spec.name} not built: the worker compiles it on first use where it can, else goes without")

    def build_extension(self, ext: Extension) -> None:
        spec, out = LIBRARIES[ext.name], Path(self.get_ext_fullpath(ext.name))
        errors = []
        for openmp in (True, False) if sys.platform.startswith("linux") else (False,):
            try:
                native.compile_library(spec, out, openmp)
                self.built[spec.name] = openmp
                return
            except RuntimeError as e:
                errors.append(str(e))
        raise CompileError("; ".join(errors))

    def run(self) -> None:
        super().run()
        if self.inplace:  # editable: setuptools copied the libraries next to their sources
            record = Path(self.build_lib) / "worker_svc" / "model" / native.BUILD_INFO
            self.copy_file(str(record), str(ROOT / "worker_svc" / "model" / native.BUILD_INFO))


setup(
    cmdclass={"build_py": BuildWithProtos, "build_ext": BuildNative},
    ext_modules=[
        Extension(name, sources=[f"worker_svc/model/{spec.source}"], optional=True) for name, spec in LIBRARIES.items()
    ],
)
