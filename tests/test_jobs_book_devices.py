"""Jobs book only the devices they use: quantize, export and dataset jobs
run on the CPU and book no GPU, so on a one-GPU box chat keeps being served
while they run.

The GPU is simulated by an ``nvidia-smi`` on the server's PATH that answers
like a machine with one GPU; the engine is the real one on the CPU, which
ignores the CUDA variables: what is checked is what the lease books.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from jobs.errors import ParamError
from jobs.kinds import decode_params, kind_spec, stored_params
from jobs.params import QuantizeParams
from supervisor.models.demo import write_tiny_gguf
from supervisor.models.demo_hf import write_tiny_hf
from tests.jobsupport import running_lab, wait_finished
from tests.server import Server, short_tempdir

pytestmark = pytest.mark.timeout(180)

# One line per GPU: index, uuid, name, memory.free, memory.total (MiB), as
# the service's memory query asks for them.
ONE_GPU_SMI = """#!/bin/sh
echo "0, GPU-sim-0000, Simulated GPU, 20000, 24576"
"""


def _one_gpu_path() -> str:
    bindir = short_tempdir("gvb")
    smi = bindir / "nvidia-smi"
    smi.write_text(ONE_GPU_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    return f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"


def _chat(srv: Server) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})


def _job_process(server_pid: int, kind: str, timeout: float = 60) -> psutil.Process:
    """The server's job process of ``kind``, as soon as it exists (polled
    tightly: the test stops it before it gets far)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(server_pid).children():
            try:
                if child.cmdline()[-3:] == ["-m", "jobs", kind]:
                    return child
            except psutil.Error:
                continue  # a child that just exited
        time.sleep(0.005)
    raise TimeoutError(f"no {kind} job process appeared")


def _stage(kind: str, models: Path, datasets: Path) -> dict[str, object]:
    """What a job of ``kind`` works on, put in place; its params."""
    if kind == "quantize":
        return {"model": "tiny", "type": "Q8_0", "output_name": "tiny-q8"}
    if kind == "export":
        write_tiny_hf(models / "tiny-twin")
        return {"model": "tiny-twin", "outtype": "F16", "output_name": "twin"}
    rows = "".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(200))
    (datasets / "qa.jsonl").write_text(rows)
    return {"input": "qa.jsonl", "eval_ratio": 0.1}


@pytest.mark.parametrize("kind", ["quantize", "export", "dataset"])
def test_cpu_jobs_leave_chat_serving_on_a_one_gpu_box(start_server: Callable[..., Server], kind: str) -> None:
    models, datasets = short_tempdir("gvm"), short_tempdir("gvd")
    write_tiny_gguf(models / "tiny.gguf")
    params = _stage(kind, models, datasets)
    srv = start_server(models, env={"PATH": _one_gpu_path(), "GPUVISOR_PRELOAD": "tiny",
                                    "GPUVISOR_DATASETS_DIR": str(datasets)})
    assert _chat(srv).status_code == 200
    gpu = httpx.get(srv.base_url + "/api/gpu", timeout=10).json()
    assert [d["id"] for d in gpu["devices"]] == ["cuda:0"]
    worker_pid = srv.worker("tiny")["pid"]
    assert srv.worker("tiny")["devices"] == ["cuda:0"]

    # Asking such a job for a GPU is refused, naming the field.
    r = httpx.post(srv.base_url + "/api/jobs", timeout=30, json={"kind": kind, "params": {**params, "gpus": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "params.gpus", r.text
    r = httpx.post(srv.base_url + "/api/jobs", timeout=30, json={"kind": kind, "params": params})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert srv.proc is not None
    proc = _job_process(srv.proc.pid, kind)
    # Held still, so that the chats below surely run while the job does.
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        for _ in range(3):
            r = _chat(srv)
            assert r.status_code == 200, r.text
        job = httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json()
        assert job["status"] == "running", job
        # The job holds no GPU, and sees none.
        device = httpx.get(srv.base_url + "/api/gpu", timeout=10).json()["devices"][0]
        assert device["holder"] is None and device["why"] is None and device["workers"] == ["tiny"]
        assert proc.environ().get("CUDA_VISIBLE_DEVICES") == ""
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while (job := httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json())["status"] == "running":
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    assert job["status"] == "succeeded", job
    # The serving worker was never evicted for the job.
    assert srv.worker("tiny")["pid"] == worker_pid


def test_quantize_gpu_fields_refused_when_new_ignored_when_stored() -> None:
    raw = {"model": "tiny", "type": "Q8_0"}
    for field, value in (("gpus", 1), ("gpu_ids", ["0"])):
        with pytest.raises(ParamError) as err:
            decode_params("quantize", {**raw, field: value})
        assert err.value.param == f"params.{field}" and "book no GPU" in str(err.value)
    # A job stored by an older version, which took a GPU count, still decodes.
    old = stored_params(kind_spec("quantize"), {**raw, "gpus": 1, "gpu_ids": None})
    assert isinstance(old, QuantizeParams) and old.devices(["cuda:0"]) == []


async def test_a_stored_quantize_job_with_gpus_still_runs(tmp_path: Path) -> None:
    async with running_lab(tmp_path) as lab:
        write_tiny_gguf(lab.roots.models / "tiny.gguf")
        # As an older version stored it: resolved paths, and a GPU count.
        params = {"model": str(lab.roots.models / "tiny.gguf"), "type": "Q8_0",
                  "output_name": "tiny-old.gguf", "allow_requantize": False, "overwrite": False,
                  "nthread": 0, "gpus": 1, "gpu_ids": None}
        job, _ = await lab.store.submit("quantize", params, 0, None)
        lab.runner.wake()
        done = await wait_finished(lab.store, job.id, timeout=60)
        assert done.status == "succeeded", done.error
        assert (lab.roots.models / "tiny-old.gguf").is_file()
