"""`pip install` of a clean checkout gives a package that serves: the wheel carries the generated
gRPC modules (setup.py runs protoc at build time; kvfleet/v1 is not in git), and a tiny cluster
started from the installed wheel alone (no make, not this checkout) answers a request token-exact.
The wheel also carries the worker's C libraries, built with it (setup.py: the fused CPU ops and
the int8 kernels per level), and the installed worker loads those, with no compiler to reach."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from worker_svc.model import native

ROOT = Path(__file__).resolve().parents[2]

SERVE = r"""
import sys
from pathlib import Path
import kvfleet, kvfleet.v1.scheduler_pb2, worker_svc
assert Path(kvfleet.__file__).is_relative_to(sys.argv[1]), kvfleet.__file__
assert Path(worker_svc.__file__).is_relative_to(sys.argv[1]), worker_svc.__file__
from kvfleet.client import SchedulerClient, build_request
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
with LocalCluster(ClusterSpec(workers=1, model="tiny", telemetry=False)) as cluster:
    with SchedulerClient(cluster.scheduler_address) as client:
        got = list(client.generate(build_request([3, 1, 4, 1, 5], 12)).token_ids)
want = reference_generate(tiny_config(), tiny_weights(tiny_config(), seed=0), [3, 1, 4, 1, 5], 12)
assert got == want, (got, want)
print("served", got)
"""


# Run with no compiler to find (PATH empty, CC failing): every library must be the wheel's.
LOADS = r"""
import os, sys
from pathlib import Path
from worker_svc.model import fused, native, q8
here = Path(sys.argv[1])
ops = fused.load()
assert ops is not None and ops.origin is native.Origin.INSTALLED, ops
assert ops.path.parent == here / "worker_svc" / "model", ops.path
for level in q8.runnable_levels():
    k = q8.Q8Kernels.load(level)
    assert k.origin is native.Origin.INSTALLED and k.path.parent == ops.path.parent, (level, k.path)
assert not Path(os.environ["KVFLEET_CACHE_DIR"]).exists()  # nothing compiled on first use
print("loaded", q8.runnable_levels())
"""


def test_build_requirements_are_not_runtime_dependencies() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(r.startswith("grpcio-tools") for r in meta["build-system"]["requires"])
    assert not any(r.startswith("grpcio-tools") for r in meta["project"]["dependencies"])


def test_a_wheel_of_a_clean_checkout_installs_and_serves(tmp_path: Path) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs this project's git checkout to copy its tracked files from")
    src = tmp_path / "src"
    # What a clone of this work tree would hold: tracked files and new ones git does not ignore.
    listing = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    tracked = subprocess.run(listing, cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():  # (a file deleted in the work tree but not in git)
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    assert not (src / "kvfleet" / "v1").exists()  # as in a clean clone
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # The build requirements (setuptools, grpcio-tools) are this environment's: no download here.
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, timeout=300)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("kvfleet-*.whl")
    assert "-none-any" not in wheel.name  # a platform wheel: it holds compiled libraries
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        built = json.loads(zf.read(f"worker_svc/model/{native.BUILD_INFO}"))["libraries"]
    # This environment's compiler builds every level (one it cannot build is skipped: below).
    assert set(built) == {spec.name for spec in native.LIBRARIES}
    for spec in native.LIBRARIES:
        assert f"worker_svc/model/{native.installed_name(spec)}" in names, spec.name
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, timeout=300)
    assert (target / "kvfleet" / "v1" / "worker_pb2_grpc.py").exists()
    # Run from elsewhere, the installed copy first on the path: this checkout is not imported.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFLEET_", "OTEL_"))}
    env["PYTHONPATH"] = str(target)
    # No compiler to reach: the libraries must be the wheel's (the cluster's worker too).
    env.update(PATH=str(tmp_path / "empty-bin"), CC="/bin/false", KVFLEET_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-c", LOADS, str(target)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("loaded"), run.stdout
    run = subprocess.run([sys.executable, "-c", SERVE, str(target)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("served"), run.stdout
    assert not (tmp_path / "cache").exists()  # the cluster's worker compiled nothing either


def test_a_level_the_compiler_cannot_build_is_skipped_not_fatal(tmp_path: Path) -> None:
    """A compiler without AVX-512 VNNI (here: one that fails on that level's library): the build
    succeeds with a warning, without that library, and its record does not list it, so the
    worker reports the level unavailable (test_q8_kernels covers the dispatch)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    src = tmp_path / "src"
    files = ["setup.py", "pyproject.toml", "worker_svc/__init__.py", "worker_svc/model/__init__.py",
             "worker_svc/model/native.py", "worker_svc/model/cpu_features.py", "worker_svc/model/fused_ops.c",
             "worker_svc/model/q8_kernels.c", "worker_svc/model/gguf_kernels.c"]  # fmt: skip
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    cc = tmp_path / "old-cc"
    real = shutil.which("cc") or shutil.which("gcc")
    fail = 'case "$*" in *KV_Q8_LEVELS=2*) echo "unknown: avx512vnni" >&2; exit 1;; esac'
    cc.write_text(f'#!/bin/sh\n{fail}\nexec {real} "$@"\n')
    cc.chmod(0o755)
    out = tmp_path / "lib"
    run = subprocess.run([sys.executable, "setup.py", "build_ext", "-b", str(out), "-t", str(tmp_path / "tmp")],
                         cwd=src, env={**os.environ, "CC": str(cc)}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "q8_avx512 not built" in run.stdout + run.stderr
    assert "gguf_avx512 not built" in run.stdout + run.stderr
    model = out / "worker_svc" / "model"
    built = json.loads((model / native.BUILD_INFO).read_text())["libraries"]
    assert set(built) == {"fused_ops", "q8_scalar", "q8_avx2", "gguf_scalar", "gguf_avx2"}
    assert not (model / native.installed_name(native.Q8["avx512"])).exists()
    assert not (model / native.installed_name(native.GGUF["avx512"])).exists()
    for level in ("scalar", "avx2"):
        for specs in (native.Q8, native.GGUF):
            lib = model / native.installed_name(specs[level])
            assert native.installed(specs[level], openmp=True, where=model) == lib
    assert native.installed(native.Q8["avx512"], openmp=True, where=model) is None
