"""deploy/precompile.py: make install writes the bytecode of what kvfleet and its tests import."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("precompile", ROOT / "deploy" / "precompile.py")
precompile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(precompile)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_third_party_imports_of_the_sources_are_found(tmp_path: Path) -> None:
    _write(
        tmp_path / "worker_svc" / "a.py",
        "import os, numpy as np\nimport grpc.aio\nfrom . import b\nfrom .b import c\nfrom json import dumps\n"
        "from scheduler_svc.core import x\n"
        "def late():\n    from transformers import AutoTokenizer, AutoConfig\n    import json.decoder\n",
    )
    _write(tmp_path / "tests" / "helpers" / "h.py", "import pytest\nfrom tests.helpers import y\nimport kvfleet.cli\n")
    _write(tmp_path / "bench" / "broken.py", "def (:\n")  # a file that does not parse is passed over
    _write(tmp_path / "elsewhere" / "z.py", "import not_a_source_folder\n")
    assert precompile.imported_names(tmp_path) == [
        "grpc.aio",
        "numpy",
        "pytest",
        "transformers:AutoConfig",
        "transformers:AutoTokenizer",
    ]


def test_a_child_writes_the_bytecode_of_what_it_imports_whatever_the_environment_says(tmp_path, monkeypatch) -> None:
    """PYTHONDONTWRITEBYTECODE set (as on CI); a module that fails to import, or a name a
    module lacks, does not stop the rest."""
    _write(
        tmp_path / "lazy" / "__init__.py",
        "import importlib\ndef __getattr__(name):\n    return importlib.import_module('lazy.heavy').VALUE\n",
    )
    _write(tmp_path / "lazy" / "heavy.py", "VALUE = 1\n")
    _write(tmp_path / "fails.py", "raise RuntimeError('an optional dependency is missing')\n")
    _write(tmp_path / "plain.py", "X = 1\n")
    _write(tmp_path / "unnamed.py", "Y = 1\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    child = precompile._start(["fails", "lazy:VALUE", "plain:nothing_here", "no_such_module"])
    assert child.wait(timeout=60) == 0

    def compiled(source: Path) -> bool:
        return Path(importlib.util.cache_from_source(str(source))).exists()

    assert compiled(tmp_path / "lazy" / "__init__.py")
    assert compiled(tmp_path / "lazy" / "heavy.py")  # loaded by the name's first use
    assert compiled(tmp_path / "plain.py")
    assert not compiled(tmp_path / "unnamed.py")


def test_a_child_that_hangs_is_stopped_and_what_it_compiled_stays(tmp_path, monkeypatch, capsys) -> None:
    _write(tmp_path / "first.py", "X = 1\n")
    _write(tmp_path / "hangs.py", "import time\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    child = precompile._start(["first", "hangs"])
    precompile._finish(child, timeout_s=3)
    assert child.returncode is not None  # stopped, not left running
    assert "stopped" in capsys.readouterr().err
    assert Path(importlib.util.cache_from_source(str(tmp_path / "first.py"))).exists()


def test_every_installed_module_a_worker_imports_is_compiled(tmp_path, monkeypatch) -> None:
    """What the worker's sources import, compiled by the child into an empty cache folder
    (PYTHONPYCACHEPREFIX: the environment's own .pyc files are not seen), then a worker's
    imports looked up there: none of its installed modules is left to compile in each process
    that starts one (without their .pyc files, where PYTHONDONTWRITEBYTECODE is set as on CI,
    a clean clone's pytest took 547 s against 401 s)."""
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "pyc"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    names = precompile.imported_names(ROOT, ("worker_svc", "kvfleet_common", "kvfleet_models"))
    assert "torch" in names and "grpc_health.v1:health" in names
    assert precompile._start(names).wait(timeout=240) == 0
    listed = subprocess.run(
        [sys.executable, "-c", _UNCOMPILED, "worker_svc.server"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert listed.returncode == 0, listed.stderr
    counted, *uncompiled = listed.stdout.split()
    assert int(counted) > 500  # torch's, grpc's, numpy's modules...
    assert uncompiled == []


# Imports the module named and prints how many installed (site-packages) modules it loaded, then
# those without a .pyc where this interpreter looks for one.
_UNCOMPILED = """
import importlib, importlib.util, os, sys, sysconfig
importlib.import_module(sys.argv[1])
site = sysconfig.get_paths()["purelib"]
files = [getattr(m, "__file__", None) or "" for m in list(sys.modules.values())]
files = [f for f in files if f.endswith(".py") and f.startswith(site)]
print(len(files))
print("\\n".join(f for f in files if not os.path.exists(importlib.util.cache_from_source(f))))
"""
