"""The import rule of ARCHITECTURE.md, checked: which package may import which."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("kvfleet", "kvfleet_common", "kvfleet_models", "scheduler_svc", "worker_svc", "telemetry_svc", "gateway_svc")
GENERATED = "kvfleet.v1"
CLIENT = "kvfleet.client"

# package -> the other project packages (or modules) it may import
ALLOWED: dict[str, set[str]] = {
    "kvfleet_common": set(),
    "kvfleet_models": {"kvfleet_common"},
    "scheduler_svc": {"kvfleet_common", "kvfleet_models", GENERATED},
    "worker_svc": {"kvfleet_common", "kvfleet_models", GENERATED},
    "telemetry_svc": {"kvfleet_common", GENERATED},
    "gateway_svc": {"kvfleet_common", GENERATED, CLIENT},
    CLIENT: {"kvfleet_common", GENERATED},
}
# Pure cores: no gRPC, no protobuf, no sockets, no generated code.
CORES = [
    "scheduler_svc/core",
    "kvfleet_common/kv_blocks.py",
    "worker_svc/kv_views_mode.py",
    "telemetry_svc/stats.py",
    "telemetry_svc/gates.py",
    "telemetry_svc/summary.py",
    "telemetry_svc/retention.py",
    "telemetry_svc/jaeger.py",
    "gateway_svc/openai_schema.py",
    "gateway_svc/openai_responses.py",
    "gateway_svc/tool_calls.py",
    "worker_svc/sampling.py",
]
IO_MODULES = {"grpc", "grpc_health", "grpc_reflection", "google", "socket", "aiohttp", "kvfleet"}


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (deferred imports count too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _files(rel: str) -> list[Path]:
    p = ROOT / rel
    return [p] if p.suffix == ".py" else sorted(p.rglob("*.py"))


def _owner(module: str) -> str | None:
    """The package a project module belongs to, for the rule (kvfleet.v1 and kvfleet.client apart)."""
    for special in (GENERATED, CLIENT):
        if module == special or module.startswith(special + "."):
            return special
    top = module.split(".")[0]
    return top if top in PROJECT else None


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_the_rule_allows(package):
    rel = package.replace(".", "/")
    files = _files(rel + ".py") if (ROOT / (rel + ".py")).exists() else _files(rel)
    assert files, f"{package} has no files"
    bad = []
    for f in files:
        for module in _imports(f):
            owner = _owner(module)
            if owner is None or owner == package or module.startswith(package + "."):
                continue
            if package != "kvfleet" and owner not in ALLOWED[package]:
                bad.append(f"{f.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(sorted(bad))


@pytest.mark.parametrize("core", CORES)
def test_cores_import_no_network_or_generated_code(core):
    bad = [
        f"{f.relative_to(ROOT)} imports {m}" for f in _files(core) for m in _imports(f) if m.split(".")[0] in IO_MODULES
    ]
    assert not bad, "\n".join(sorted(bad))


def test_the_rule_catches_a_forbidden_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from worker_svc.engine import Engine\n")
    assert "worker_svc.engine" in _imports(f)
    assert _owner("worker_svc.engine") not in ALLOWED["scheduler_svc"]
