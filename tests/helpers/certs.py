"""Development certificates for the tests: deploy/tls/make_dev_certs.sh, run the one way.

The script makes a CA and one identity per service (scheduler, worker, telemetry, gateway,
client); see its header for what each folder holds and which names each server certificate
carries. `extra_names` are its SERVICE=NAME arguments (e.g. "worker=hostA"), `env` its
environment knobs (KVFLEET_KEY_MODE, KVFLEET_KEY_OWNER).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "tls" / "make_dev_certs.sh"


def run_dev_certs_script(dest: Path, *extra_names: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The script's run into `dest`, whatever its outcome (text stdout/stderr), for tests of the
    script itself; `make_dev_certs` for tests that need the certificates."""
    return subprocess.run(
        ["bash", str(SCRIPT), str(dest), *extra_names],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def make_dev_certs(dest: Path, *extra_names: str, **env: str) -> Path:
    """Certificates in `dest` (made if missing); `dest` back. Fails with the script's stderr."""
    made = run_dev_certs_script(dest, *extra_names, **env)
    assert made.returncode == 0, f"make_dev_certs.sh {dest} {' '.join(extra_names)} failed: {made.stderr}"
    return dest
