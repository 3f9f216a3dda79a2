"""The import graph: what the parent imports, and that every module imports
on its own.

- The parent never imports an engine, torch or Ray (DESIGN.md: a crash in
  native code ends a worker, never the service).
- Every module of the project imports first, in an interpreter where no
  other module of ours is loaded yet: an import cycle that only bites in one
  order (``import supervisor.api.responses`` on its own) fails here.
- The layers: the parent shares only ``worker.protocol`` with the workers
  (other shared code is in ``formats/``); no child imports the parent;
  ``formats/`` imports none of them.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("supervisor", "worker", "jobs", "formats")
ENGINE_MODULES = ("xllamacpp", "torch", "transformers", "vllm", "ray")
# Runs the command line on import (``python -m supervisor``); supervisor.cli,
# all it imports, is imported like every other module.
NOT_IMPORTABLE = frozenset({"supervisor.__main__"})
# Libraries of an install other than the base one, by the package whose
# modules may need them: the train extra for job kinds, another engine's
# environment for its worker modules. A module may fail to import for lack
# of one only where that library is not installed at all.
OPTIONAL = {
    "jobs": frozenset({"torch", "transformers", "peft", "safetensors", "tokenizers", "sentencepiece"}),
    "worker": frozenset({"vllm", "torch", "transformers"}),
}


def _python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)


def modules(package: str) -> list[str]:
    names = []
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_ray_is_imported_only_with_a_cluster_configured() -> None:
    # The Ray launcher is part of the pool; it imports Ray when it first joins a cluster.
    out = _python("import json, sys\n"
                  "import supervisor.app, supervisor.workers.pool, supervisor.workers.ray_launcher\n"
                  "print(json.dumps('ray' in sys.modules))")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) is False


def test_the_node_agent_imports_none_of_the_service() -> None:
    # It runs in a Ray worker on every node: small process helpers only.
    out = _python("import json, sys\n"
                  "import supervisor.workers.node_agent\n"
                  "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
                  "('aiohttp', 'aiosqlite', 'ray', 'xllamacpp', 'huggingface_hub', 'jinja2', 'numpy') "
                  "or m in ('supervisor.app', 'supervisor.workers.pool', 'supervisor.workers.handle'))))")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_the_parent_imports_no_engine() -> None:
    out = _python("import json, sys\n"
                  "import supervisor.app, supervisor.cli\n"
                  f"print(json.dumps([m for m in {ENGINE_MODULES!r} if m in sys.modules]))")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


# Imports each module named on its command line as if first in a fresh
# interpreter: before each, every module of ours is dropped from sys.modules
# (third-party ones stay loaded, which only saves time: a cycle among our
# modules is re-run in full). Prints {module: error} for those that failed.
# "absent" names a library missing from this environment altogether.
_IMPORT_EACH = """
import importlib, importlib.util, json, sys, traceback
ours = tuple(sys.argv[1].split(","))
failed = {}
for name in sys.argv[2:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ours]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException as exc:
        root = (exc.name or "").split(".")[0] if isinstance(exc, ModuleNotFoundError) else ""
        absent = root if root and importlib.util.find_spec(root) is None else None
        failed[name] = {"error": traceback.format_exc(limit=-3), "absent": absent}
print(json.dumps(failed))
"""


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    names = [m for p in PACKAGES for m in modules(p) if m not in NOT_IMPORTABLE]
    assert "supervisor.api.responses" in names and "worker.engine" in names and len(names) > 100
    out = _python(_IMPORT_EACH, ",".join(PACKAGES), *names, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    failed: dict[str, dict[str, str | None]] = json.loads(out.stdout.splitlines()[-1])
    failed = {m: f for m, f in failed.items() if f["absent"] not in OPTIONAL.get(m.split(".")[0], ())}
    assert failed == {}, "\n".join(f"{m}:\n{f['error']}" for m, f in failed.items())


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """Every module a file imports (``from a import b`` also as ``a.b``, which
    may name a module), including by ``importlib.import_module("...")``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value


def _protocol(name: str) -> bool:
    """``worker.protocol`` and names in it; ``worker`` alone is the package
    that ``from worker import protocol`` names."""
    return name in ("worker", "worker.protocol") or name.startswith("worker.protocol.")


def _offences(package: str, forbidden: tuple[str, ...], allowed: Callable[[str], bool] = lambda _: False) -> list[str]:
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        for line, name in _imports(path):
            if name.split(".")[0] in forbidden and not allowed(name):
                found.append(f"{path.relative_to(REPO)}:{line}: {name}")
    return found


def test_the_parent_shares_only_the_protocol_with_workers() -> None:
    assert _offences("supervisor", ("worker",), _protocol) == []


def test_no_child_imports_the_parent_and_formats_import_none_of_ours() -> None:
    assert _offences("worker", ("supervisor",)) == []
    assert _offences("jobs", ("supervisor",)) == []
    assert _offences("formats", ("supervisor", "worker", "jobs")) == []


def test_the_layer_check_sees_what_it_forbids(tmp_path: Path) -> None:
    # Each spelling of an import the checks above must catch.
    probe = tmp_path / "probe.py"
    probe.write_text("import worker.engine\nfrom worker import engine_params\nfrom worker.speculative import x\n"
                     "import importlib\nimportlib.import_module('worker.engine')\nfrom worker import protocol\n")
    names = [name for _, name in _imports(probe) if name.split(".")[0] == "worker" and not _protocol(name)]
    assert names == ["worker.engine", "worker.engine_params", "worker.speculative", "worker.speculative.x",
                     "worker.engine"]


@pytest.mark.parametrize("module", ["supervisor.api.responses", "supervisor.responses"])
def test_a_module_that_was_in_a_cycle_imports_alone(module: str) -> None:
    out = _python(f"import {module}")
    assert out.returncode == 0, out.stderr
