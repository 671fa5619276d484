"""`pip install` of a clean checkout gives a package that serves: the wheel carries the generated
gRPC modules (setup.py runs protoc at build time; kvfleet/v1 is not in git), and a tiny cluster
started from the installed wheel alone (no make, not this checkout) answers a request token-exact."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

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
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, timeout=300)
    assert (target / "kvfleet" / "v1" / "worker_pb2_grpc.py").exists()
    # Run from elsewhere, the installed copy first on the path: this checkout is not imported.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFLEET_", "OTEL_"))}
    env["PYTHONPATH"] = str(target)
    run = subprocess.run([sys.executable, "-c", SERVE, str(target)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("served"), run.stdout
