"""Secrets stay in the parent: model workers and jobs get an allowlisted
environment, and only the download job gets the Hugging Face token."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.lab.job_process import child_environ, job_environ
from tests.server import Server, running, short_tempdir

pytestmark = pytest.mark.timeout(120)

ADMIN = "gva_0123abcd_" + "A" * 43
HF_SETTING = "hf_" + "S" * 34  # GPUVISOR_HF_TOKEN
HF_ENV = "hf_" + "E" * 34  # the parent's own HF_TOKEN
SECRETS = (ADMIN, HF_SETTING, HF_ENV)
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def test_the_allowlist() -> None:
    parent = {"PATH": "/bin", "HOME": "/h", "LANG": "C.UTF-8", "LC_ALL": "C", "CUDA_VISIBLE_DEVICES": "0",
              "HIP_VISIBLE_DEVICES": "1", "GGML_CUDA_NO_PINNED": "1", "LLAMA_ARG_X": "1",
              "OMP_NUM_THREADS": "2", "PYTHONPATH": "/src", "HF_HOME": "/hf", "HF_HUB_OFFLINE": "1",
              "GPUVISOR_ADMIN_TOKEN": ADMIN, "GPUVISOR_HF_TOKEN": HF_SETTING, "HF_TOKEN": HF_ENV,
              "HUGGING_FACE_HUB_TOKEN": HF_ENV, "HF_HUB_TOKEN": HF_ENV, "AWS_SECRET_ACCESS_KEY": "x",
              "NOTIFY_SOCKET": "/run/systemd/notify", "SSH_AUTH_SOCK": "/tmp/agent",
              "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_API_KEY": "x"}
    env = child_environ(parent)
    assert set(env) == {"PATH", "HOME", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                        "GGML_CUDA_NO_PINNED", "LLAMA_ARG_X", "OMP_NUM_THREADS", "PYTHONPATH", "HF_HOME",
                        "HF_HUB_OFFLINE", "VLLM_CPU_OMP_THREADS_BIND"}
    extra = {"HF_TOKEN": HF_SETTING, "HF_HUB_CACHE": "/cache"}
    assert job_environ("download", parent, extra)["HF_TOKEN"] == HF_SETTING
    assert job_environ("download", parent, {})["HF_TOKEN"] == HF_ENV
    sleep = job_environ("sleep", parent, extra)
    assert "HF_TOKEN" not in sleep and sleep["HF_HUB_CACHE"] == "/cache"
    assert not any(secret in sleep.values() for secret in SECRETS)


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)  # the only model: preloaded
    env = {"GPUVISOR_ADMIN_TOKEN": ADMIN, "GPUVISOR_HF_TOKEN": HF_SETTING, "HF_TOKEN": HF_ENV}
    with running(Server(models, env=env)) as server:
        yield server


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (entry.decode(errors="replace").partition("=") for entry in raw.split(b"\0") if entry)
    return {k: v for k, _, v in pairs}


def _poll(get: Any, done: Any, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not done(value := get()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def _assert_clean(env: dict[str, str]) -> None:
    assert "GPUVISOR_ADMIN_TOKEN" not in env and "GPUVISOR_HF_TOKEN" not in env and "HF_TOKEN" not in env
    leaked = [k for k, v in env.items() if any(secret in v for secret in SECRETS)]
    assert not leaked, leaked
    assert "PATH" in env


def test_a_worker_sees_no_token(srv: Server) -> None:
    workers = _poll(lambda: httpx.get(srv.base_url + "/api/workers", headers=AUTH).json()["workers"],
                    lambda ws: ws and ws[0].get("pid") and ws[0]["state"] == "ready")
    assert workers and workers[0]["pid"], workers
    _assert_clean(_environ(int(workers[0]["pid"])))


def test_a_sleep_job_sees_no_token(srv: Server) -> None:
    job = httpx.post(srv.base_url + "/api/jobs", headers=AUTH,
                     json={"kind": "sleep", "params": {"steps": 600, "step_seconds": 0.1}}).json()
    try:
        running_job = _poll(lambda: httpx.get(srv.base_url + f"/api/jobs/{job['id']}", headers=AUTH).json(),
                            lambda j: j["status"] == "running" and j.get("pid"))
        assert running_job["status"] == "running", running_job
        _assert_clean(_environ(int(running_job["pid"])))
    finally:
        httpx.post(srv.base_url + f"/api/jobs/{job['id']}/cancel", headers=AUTH)
