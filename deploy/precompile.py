"""Write the bytecode (.pyc) of the installed modules that kvfleet and its tests import.

make install runs it after uv, in place of compiling the whole environment: uv's
--compile-bytecode compiled all 15,657 modules of the test environment (32 s on the 2-core AVX2
EPYC); the services and the tests import about 4,600 of them (not transformers' other model
families, most of sympy, networkx, pip's and setuptools' modules). Here: 16-18 s. Where
PYTHONDONTWRITEBYTECODE is set a module without its .pyc is compiled again in every process that
imports it, so what the services import must be compiled once here; a module left out (one only
imported by name at run time, as transformers' model families are) costs only that.

What is compiled is found, not listed: every module named by an import statement in the project's
sources (inside functions too) that is not the project's own nor the standard library is
imported in a child interpreter that writes bytecode; what those import is compiled with them.
torch first, alone (most of the rest import it), then the rest in two children at once.

    python deploy/precompile.py [ROOT]
"""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

# The folders whose import statements are read: the packages, the benchmark and the tests.
SOURCES: tuple[str, ...] = ("kvfleet", "kvfleet_common", "kvfleet_models", "scheduler_svc", "worker_svc")
SOURCES += ("telemetry_svc", "gateway_svc", "bench", "tests")
# The project's own top-level modules: compiled by `make test` itself (their sources change
# between installs), never imported here.
OWN = {*SOURCES, "deploy", "setup"}
FIRST = "torch"

# The child: import each module named on stdin with bytecode written, whatever the environment
# says (`module:name` also takes the name, a submodule or a lazy package's attribute); one that
# does not import (an optional dependency, another platform's module) is passed over. Then the
# modules loaded before the switch (the site's start-up hooks) are compiled where they lack it.
_CHILD = """
import compileall, importlib, sys
sys.dont_write_bytecode = False
for name in sys.stdin.read().split():
    module, _, attr = name.partition(":")
    try:
        found = importlib.import_module(module)
        if attr and not hasattr(found, attr):
            importlib.import_module(f"{module}.{attr}")
    except (Exception, SystemExit):  # Ctrl-C stops it
        pass
for loaded in list(sys.modules.values()):
    source = getattr(loaded, "__file__", None) or ""
    if source.endswith(".py"):
        compileall.compile_file(source, quiet=2)
"""


def imported_names(root: Path, folders: tuple[str, ...] = SOURCES) -> list[str]:
    """The third-party modules the sources in `folders` import: `module` or `module:name`."""
    names: set[str] = set()
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            try:
                tree = ast.parse(path.read_bytes(), str(path))
            except (SyntaxError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    # module:name, as a lazy package (transformers) loads a name on first use
                    names.update(f"{node.module}:{alias.name}" for alias in node.names)
    skip = OWN | sys.stdlib_module_names
    return sorted(n for n in names if n.partition(":")[0].split(".")[0] not in skip)


def _start(names: list[str]) -> subprocess.Popen[bytes]:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert child.stdin is not None
    child.stdin.write("\n".join(names).encode())
    child.stdin.close()
    return child


def _finish(child: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Waits for a child; one that hangs (an import waiting on something) is stopped: what it
    compiled stays, the rest is compiled by the processes that import it."""
    try:
        child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        print(f"precompile: a child still importing after {timeout_s:.0f} s was stopped", file=sys.stderr)


def main(argv: list[str], timeout_s: float = 300) -> int:
    root = Path(argv[1] if len(argv) > 1 else ".").resolve()
    started = time.monotonic()
    names = imported_names(root)
    # torch alone first (most of the rest import it: two children would compile it twice), then
    # the rest in two children, one a core.
    _finish(_start([FIRST]), timeout_s)
    rest = [n for n in names if n != FIRST]
    for child in [_start(rest[0::2]), _start(rest[1::2])]:
        _finish(child, timeout_s)
    print(f"precompile: the bytecode of {len(names)} imported modules and theirs, {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
