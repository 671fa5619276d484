"""Every comparison of a credential is constant-time (issue 20 point 7): no `==` / `!=` between a
bearer token, API key or secret and what a caller sent, anywhere in the services; the checks go
through hmac.compare_digest (kvfleet_common.security.same_secret). An AST scan, so a new `==`
on a token anywhere fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvfleet.experiment import new_experiment_id
from kvfleet_common.security import same_secret

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvfleet_common", "scheduler_svc", "worker_svc", "telemetry_svc", "gateway_svc", "kvfleet")
CREDENTIAL_PARTS = ("secret", "api_key", "password", "bearer")


def _is_credential(word: str) -> bool:
    """token, api_token, self._token, worker_secret ...; not model tokens (num_tokens, token_id)."""
    return any(p in word for p in CREDENTIAL_PARTS) or word.strip("_") == "token" or word.endswith("_token")


def _names(node: ast.AST) -> list[str]:
    """Identifiers an expression reads (names and attributes), lower-cased."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.append(n.id.lower())
        elif isinstance(n, ast.Attribute):
            out.append(n.attr.lower())
    return out


def _credential_compares(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare) or not any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            continue
        sides = [node.left, *node.comparators]
        if any(isinstance(s, ast.Constant) for s in sides):
            continue  # against a literal (an empty string, a header name): not a credential check
        if any(_is_credential(w) for s in sides for w in _names(s)):
            lines.append(node.lineno)
    return lines


def test_no_credential_is_compared_with_eq() -> None:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "/v1/" in str(path):
                continue
            lines = _credential_compares(path.read_text())
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert not found, f"== / != on a credential (use kvfleet_common.security.same_secret): {found}"


def test_the_scan_catches_a_plain_compare() -> None:
    assert _credential_compares("def f(sent, api_token):\n    return sent == api_token\n") == [2]
    assert _credential_compares("def f(a, b):\n    return self.secret != given\n") == [2]
    assert _credential_compares("def f(x):\n    return x.token_id == 3 or key == 'authorization'\n") == []
    assert _credential_compares("def f(x):\n    return x.num_tokens != n_tokens\n") == []


def test_same_secret_is_equality() -> None:
    assert same_secret("Bearer abc", "Bearer abc") and not same_secret("Bearer abd", "Bearer abc")
    assert not same_secret("", "Bearer abc")


@pytest.mark.parametrize("lever", ["persistent_kv_views", "int8"])
def test_experiment_ids_are_128_bit_random(lever: str) -> None:
    ids = {new_experiment_id(lever) for _ in range(64)}
    assert len(ids) == 64
    for i in ids:
        prefix, _, digits = i.rpartition("-")
        assert prefix == lever and len(digits) == 32 and int(digits, 16) >= 0
