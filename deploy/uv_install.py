"""`uv pip install ARGS` with pip's own configuration carried over, so it installs what pip would.

make install uses it: uv resolves, downloads and unpacks in parallel (the test environment in
well under half of pip's time), but it reads none of pip's settings. A machine
that points pip at local indexes, wheel folders, constraints, a CA bundle or a proxy (pip.conf
or PIP_* variables) gets the same from uv here. pip looks at every index for the best version;
uv's default takes the first index that has a package, so `unsafe-best-match` keeps pip's choice.
pip's bytecode compilation is not carried over: make install runs deploy/precompile.py after it.

    python deploy/uv_install.py UV [uv pip install arguments...]

Exits with uv's status (the Makefile falls back to pip when it is not 0).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

# `pip config list` lines: section.key='value' (section: global, install, user, site, :env:).
_LINE = re.compile(r"^(?P<section>[^.]*|:env:)\.(?P<key>[a-z0-9-]+)=(?P<value>.*)$")
# Where one key is set in several places, pip takes the variable, then the install command's
# section, then the global one.
_RANK = {":env:": 0, "install": 1}


@dataclass
class UvSettings:
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def _values(raw: str) -> list[str]:
    """A value as `pip config list` prints it (a Python string literal), split on whitespace:
    pip's list settings take several values, on one line or several."""
    try:
        text = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        text = raw
    return str(text).split()


def pip_settings(config_list: str) -> dict[str, list[str]]:
    """The settings `pip config list` printed, each from the place pip reads it from."""
    chosen: dict[str, tuple[int, list[str]]] = {}
    for line in config_list.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        rank = _RANK.get(m["section"], 2)
        key = m["key"].replace("_", "-")
        if key not in chosen or rank < chosen[key][0]:
            chosen[key] = (rank, _values(m["value"]))
    return {key: values for key, (_, values) in chosen.items()}


def _true(values: list[str]) -> bool:
    return bool(values) and values[0].lower() in ("1", "true", "yes", "on")


def uv_settings(pip: dict[str, list[str]]) -> UvSettings:
    """pip's settings as uv flags and variables; the ones uv has no use for are left out."""
    out = UvSettings(args=["--index-strategy", "unsafe-best-match"])
    # pip compiles all it installs; --compile-bytecode would too (15,657 modules, 32 s on 2 cores).
    # make install compiles instead what kvfleet and its tests import (deploy/precompile.py).
    for url in pip.get("index-url", [])[:1]:
        out.args += ["--index-url", url]
    for url in pip.get("extra-index-url", []):
        out.args += ["--extra-index-url", url]
    for place in pip.get("find-links", []):
        out.args += ["--find-links", place]
    for path in pip.get("constraint", []):
        out.args += ["--constraint", path]
    for host in pip.get("trusted-host", []):
        out.args += ["--allow-insecure-host", host]
    if _true(pip.get("no-index", ["false"])):
        out.args.append("--no-index")
    for cert in pip.get("cert", [])[:1]:
        out.env["SSL_CERT_FILE"] = cert
    for cert in pip.get("client-cert", [])[:1]:
        out.env["SSL_CLIENT_CERT"] = cert
    for proxy in pip.get("proxy", [])[:1]:  # pip's one proxy serves both schemes
        out.env["HTTP_PROXY"] = out.env["HTTPS_PROXY"] = proxy
    for seconds in pip.get("default-timeout", pip.get("timeout", []))[:1]:
        out.env["UV_HTTP_TIMEOUT"] = seconds
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    uv, rest = argv[0], argv[1:]
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    settings = uv_settings(pip_settings(listed.stdout if listed.returncode == 0 else ""))
    cmd = [uv, "pip", "install", "--python", sys.executable, *settings.args, *rest]
    return subprocess.run(cmd, env={**os.environ, **settings.env}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
