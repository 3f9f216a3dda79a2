"""How the suite spreads over pytest-xdist's workers (``make test`` runs two).

- A whole module goes to one worker, so its module-scoped server and
  worker processes start once.
- The modules that start vLLM engines all go to the same worker, one after
  another: two vLLM engines side by side on two cores each spin a thread
  pool as wide as the machine, and their tests took twice as long as when
  the engines ran in turn.
- The long-running modules are collected first. Otherwise the workers take
  the modules with most tests first and the one long test of the Ray
  cluster (minutes) or the vLLM modules (few tests each) ran last, one
  worker busy with them while the other had nothing left.

Without xdist (``pytest`` alone) only the order applies.
"""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest
from xdist.scheduler import LoadScopeScheduling

# The one scope of every module whose name starts so.
VLLM_PREFIX = "test_vllm_"
VLLM_SCOPE = "vllm-engines"
# Collected first, in this order: the vLLM modules (about 11 minutes alone on
# a 2-core machine), then the others that take a minute or more.
FIRST = (VLLM_PREFIX, "test_ray_cluster.py", "test_finetune_ddp.py", "test_hosted_code.py",
         "test_finetune.py", "test_vector_stores.py", "test_clients_codex.py", "test_fuzz.py",
         "test_finetune_e2e.py")


def module_name(nodeid: str) -> str:
    return PurePosixPath(nodeid.split("::", 1)[0]).name


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module's path, or the vLLM scope."""
    path = nodeid.split("::", 1)[0]
    return VLLM_SCOPE if module_name(nodeid).startswith(VLLM_PREFIX) else path


def rank(nodeid: str) -> int:
    """Where a module's tests are collected: FIRST's order, then all others."""
    name = module_name(nodeid)
    for i, prefix in enumerate(FIRST):
        if name.startswith(prefix) if prefix.endswith("_") else name == prefix:
            return i
    return len(FIRST)


def order(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place by :func:`rank`; a stable sort keeps each
    module's own order (some modules end with a test that stops their server)."""
    items.sort(key=lambda item: rank(item.nodeid))


class ModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no type information
    """xdist's per-scope scheduling with :func:`scope_of`'s scopes, handed out
    in collection order (run with ``--no-loadscope-reorder``)."""

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)
