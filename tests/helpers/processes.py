"""Processes the tests started and lost sight of (an orphan is reparented to init)."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's exit may wait for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
