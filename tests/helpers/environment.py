"""Flags fall back on KVFLEET_* variables: a test of flags and defaults starts with none set."""

from __future__ import annotations

import os

import pytest


def clear_kvfleet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVFLEET_")]:
        monkeypatch.delenv(name)


def no_service_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The services' parse_args set up logging; a test of their flags leaves the root logger be."""
    from scheduler_svc import __main__ as scheduler_main
    from worker_svc import __main__ as worker_main

    monkeypatch.setattr(worker_main, "setup_logging", lambda *a: None)
    monkeypatch.setattr(scheduler_main, "setup_logging", lambda *a: None)
