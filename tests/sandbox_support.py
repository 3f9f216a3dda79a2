"""Shared by the sandbox tests: a Python the sandbox can run here."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

from supervisor.sandbox.containers import ContainerPool
from supervisor.sandbox.runner import SandboxLimits, SandboxSpec, probe

# Coarse: a run takes well under a second; these only stop a hang.
FAST = SandboxLimits(cpu_s=10, memory_mib=512, wall_s=20.0, file_mib=8, processes=16, open_files=64)


def candidate_pythons() -> list[str]:
    """The service's Python first; a service running as root runs the code
    as nobody, who may not reach it (a Python under /root): then the
    system's."""
    found = [sys.executable]
    system = shutil.which("python3", path="/usr/bin:/bin")
    if system and system not in found:
        found.append(system)
    return found


def find_python() -> tuple[str | None, list[str]]:
    """(a Python whose probe passes, None) or (None, every reason). Call
    outside an event loop (a session fixture)."""
    reasons = []
    with tempfile.TemporaryDirectory() as tmp:
        for python in candidate_pythons():
            spec = SandboxSpec(python=python, limits=FAST)
            pool = ContainerPool(Path(tmp), spec)
            trial = pool.create()
            reason = asyncio.run(probe(spec, trial.path))
            pool.remove(trial.id)
            if reason is None:
                return python, []
            reasons.append(reason)
    return None, reasons


def sandbox_python_or_skip() -> str:
    """For a fixture: a Python the sandbox runs here. Skips where this
    machine permits no sandbox (namespaces may be unavailable), and fails
    where the sandbox would have a network: that is a bug, not a machine."""
    import pytest

    python, reasons = find_python()
    if python is None:
        (pytest.fail if any("has a network" in r for r in reasons) else pytest.skip)(
            "no sandbox on this machine: " + "; ".join(reasons))
    return python
