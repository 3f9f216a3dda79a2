"""Files a kill -9 leaves behind: a dataset job's row spill (tens of MB) and
the parent's worker sockets. A DELETE of the job removes its spill, a restart
removes every leftover, and a user's own files beside them stay."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.server import Server, poll_until


def _models(tiny_model_path: Path) -> Path:
    return tiny_model_path.parent


def _big_input(datasets: Path) -> None:
    # Large enough that the job is still reading (and spilling) when killed.
    datasets.mkdir(parents=True, exist_ok=True)
    with (datasets / "big.jsonl").open("w") as f:
        for i in range(400_000):
            f.write(json.dumps({"instruction": f"question {i}", "output": f"answer {i}"}) + "\n")


def _job(srv: Server, job_id: str) -> dict[str, Any]:
    return httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json()  # type: ignore[no-any-return]


def _killed_mid_spill(srv: Server, datasets: Path) -> tuple[str, Path]:
    """Start a dataset job and SIGKILL it (as the OOM killer would) while its
    spill file exists; the job id and the spill it left."""
    r = httpx.post(srv.base_url + "/api/jobs", timeout=30,
                   json={"kind": "dataset", "params": {"input": "big.jsonl", "output_name": "big"}})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    spill = datasets / f".big.{job_id}.rows.tmp"
    poll_until(lambda: spill.exists(), bool, timeout=60, interval=0.005)
    pid = poll_until(lambda: _job(srv, job_id).get("pid"), bool, timeout=30)
    os.killpg(pid, signal.SIGKILL)
    poll_until(lambda: _job(srv, job_id)["status"], lambda s: s not in ("queued", "running"), timeout=60)
    assert spill.exists(), "the killed job removed its spill itself: nothing left to test"
    return job_id, spill


def test_delete_and_restart_remove_what_a_kill_left(
        tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(_models(tiny_model_path))
    datasets = srv.state_dir / "datasets"
    _big_input(datasets)
    mine = [datasets / ".notes.tmp", datasets / ".big.job_mine.rows.tmp", datasets / "keep.jsonl"]
    for p in mine:
        p.write_text("a user's own file\n")

    job_id, spill = _killed_mid_spill(srv, datasets)
    assert httpx.delete(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).status_code == 200
    assert not spill.exists(), "a deleted job kept its spill file"

    # A worker is up, so the run dir holds this parent's sockets.
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": srv.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    run = srv.state_dir / "run"
    old_pid = srv.proc.pid if srv.proc is not None else 0
    old_sockets = [p.name for p in run.glob(f"w{old_pid}-*.sock")]
    assert old_sockets, sorted(p.name for p in run.iterdir())

    _, second = _killed_mid_spill(srv, datasets)
    srv.stop(signal.SIGKILL)
    assert second.exists() and all((run / n).exists() for n in old_sockets)
    srv.start()
    assert not second.exists(), "a restart kept a killed job's spill file"
    assert not [n for n in old_sockets if (run / n).exists()], "stale sockets survived a restart"
    assert all(p.exists() for p in mine), "a user's file was removed"
    # The service works on as before: a chat on a fresh worker.
    t0 = time.monotonic()
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": srv.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and time.monotonic() - t0 < 60, r.text
