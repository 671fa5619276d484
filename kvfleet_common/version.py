"""kvfleet's installed version, as `kvfleet --version`, GetModelInfo and the gateway report it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def kvfleet_version() -> str:
    try:
        return version("kvfleet")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"
