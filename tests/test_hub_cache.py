"""Which Hugging Face cache the service lists: huggingface_hub's own default
for the parent's environment unless hf_cache_dir says otherwise, and the
same one in every job, whatever of the parent's environment a job inherits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.service.systemd import render_unit
from tests.server import HUB_CACHE_ENV, REPO

# Resolves the cache in a fresh process (huggingface_hub reads its environment
# once, at import), then starts a job's environment from it and asks a child
# with that environment where huggingface_hub would download to.
_PROBE = """
import json, os, subprocess, sys
from supervisor.lab.job_process import job_environ
from supervisor.models import hub_cache
cache = hub_cache.resolve(sys.argv[1])
env = job_environ("download", os.environ, hub_cache.job_env(cache))
child = subprocess.run([sys.executable, "-c", "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"],
                       env=env, capture_output=True, text=True, check=True).stdout.strip()
print(json.dumps({"path": str(cache.path), "scan": None if cache.scan_dir is None else str(cache.scan_dir),
                  "job": child}))
"""


def probe(setting: str, env: dict[str, str], cwd: Path = REPO) -> dict[str, str | None]:
    base = {k: v for k, v in os.environ.items() if k not in HUB_CACHE_ENV and k != "XDG_CACHE_HOME"}
    out = subprocess.run([sys.executable, "-c", _PROBE, setting], env={**base, **env, "PYTHONPATH": str(REPO)},
                         cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result: dict[str, str | None] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize(("env", "expected"), [
    ({"HF_HUB_CACHE": "{t}/hub-cache", "HF_HOME": "{t}/home"}, "{t}/hub-cache"),
    ({"HF_HOME": "{t}/home"}, "{t}/home/hub"),
    ({"XDG_CACHE_HOME": "{t}/xdg"}, "{t}/xdg/huggingface/hub"),
    # The older name: a job does not inherit it, but gets the parent's answer.
    ({"HUGGINGFACE_HUB_CACHE": "{t}/legacy"}, "{t}/legacy"),
])
def test_the_default_is_the_hubs_own_and_the_jobs(tmp_path: Path, env: dict[str, str], expected: str) -> None:
    got = probe("", {k: v.format(t=tmp_path) for k, v in env.items()})
    want = expected.format(t=tmp_path)
    assert got == {"path": want, "scan": want, "job": want}


def test_an_explicit_dir_wins_and_off_lists_none(tmp_path: Path) -> None:
    env = {"HF_HOME": str(tmp_path / "home")}
    mine = str(tmp_path / "mine")
    assert probe(mine, env) == {"path": mine, "scan": mine, "job": mine}
    # Relative to where the service runs, not to a job's working directory.
    assert probe("rel/cache", env, cwd=tmp_path)["job"] == str(tmp_path / "rel" / "cache")
    # Off: nothing is listed; downloads still go to the Hub's default.
    default = str(tmp_path / "home" / "hub")
    assert probe(" OFF ", env) == {"path": default, "scan": None, "job": default}


def test_the_systemd_unit_keeps_the_cache_in_the_state_dir(tmp_path: Path) -> None:
    unit = render_unit()
    assert "StateDirectory=gpuvisor\n" in unit
    line = next(x for x in unit.splitlines() if x.startswith("Environment="))
    env = dict(pair.split("=", 1) for pair in line.removeprefix("Environment=").split())
    assert env["HF_HOME"].startswith("/var/lib/gpuvisor/")
    # What the service user's pull fills and its library lists.
    got = probe("", {k: v.replace("/var/lib/gpuvisor", str(tmp_path)) for k, v in env.items()})
    assert got["scan"] == got["job"] == str(tmp_path / "huggingface" / "hub")
