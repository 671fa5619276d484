"""deploy/uv_install.py: make install's uv is given pip's settings, so it installs what pip would."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("uv_install", ROOT / "deploy" / "uv_install.py")
uv_install = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = uv_install  # its dataclass looks its module up
_spec.loader.exec_module(uv_install)

# What `pip config list` printed on a machine with local indexes (this project's CI machines).
LISTED = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-bundle-old.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/srv/old-wheels'
install.trusted-host='pypi.internal\\nmirror.internal'
not a setting
"""


def test_each_setting_comes_from_where_pip_reads_it():
    got = uv_install.pip_settings(LISTED)
    assert got == {
        "cert": ["/etc/ssl/certs/ca-certificates.crt"],  # the variable over the file
        "default-timeout": ["180"],
        "find-links": ["/opt/wheels"],
        "constraint": ["/etc/xdg/pip/constraints.txt"],
        "extra-index-url": ["file:///opt/pypi/simple", "file:///opt/pypi-more/simple"],
        "trusted-host": ["pypi.internal", "mirror.internal"],  # several lines: several values
    }
    # the install command's section over the global one
    assert uv_install.pip_settings("global.index-url='https://a/simple'\ninstall.index-url='https://b/simple'") == {
        "index-url": ["https://b/simple"]
    }


def test_pip_s_settings_become_uv_s_flags_and_variables():
    got = uv_install.uv_settings(uv_install.pip_settings(LISTED + "global.index-url='https://mirror/simple'\n"))
    assert got.args == [
        *("--index-strategy", "unsafe-best-match"),  # pip's choice across indexes: the best version
        *("--index-url", "https://mirror/simple"),
        *("--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple"),
        *("--find-links", "/opt/wheels"),
        *("--constraint", "/etc/xdg/pip/constraints.txt"),
        *("--allow-insecure-host", "pypi.internal", "--allow-insecure-host", "mirror.internal"),
    ]
    assert got.env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}
    behind = uv_install.uv_settings({"proxy": ["http://proxy:3128"], "client-cert": ["/etc/me.pem"]}).env
    assert behind == {
        "HTTP_PROXY": "http://proxy:3128",
        "HTTPS_PROXY": "http://proxy:3128",
        "SSL_CLIENT_CERT": "/etc/me.pem",
    }
    assert "--no-index" in uv_install.uv_settings({"no-index": ["true"]}).args
    assert "--no-index" not in uv_install.uv_settings({"no-index": ["false"]}).args
    # no bytecode compiled by uv, whatever pip's setting: make install's deploy/precompile.py
    # compiles what is imported
    for told in ({"no-compile": ["yes"]}, {"compile": ["true"]}):
        assert "--compile-bytecode" not in uv_install.uv_settings(told).args
    # nothing set (a machine without a pip.conf): pip's defaults, uv's own otherwise
    assert uv_install.uv_settings({}).args == ["--index-strategy", "unsafe-best-match"]


def test_the_installed_uv_takes_the_flags_made_from_this_machine_s_pip_settings():
    """The uv that make install used accepts this machine's translated settings (an unknown flag
    or value exits 2). Offline, for a package already installed: no network."""
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is None:
        pytest.skip("uv is not in this environment (make install fell back to pip)")
    run = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "uv_install.py"), uv, "--dry-run", "--offline", "pyyaml"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    bad = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "uv_install.py"), uv, "--dry-run", "--offline", "--no-such-flag", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr
