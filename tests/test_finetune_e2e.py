"""The lab loop on a real gpuvisor server: fine-tune, restart the parent under
the job, resume, export to GGUF + Q8_0, and get an answer from the result."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

pytest.importorskip("peft", reason="needs the train extra")

from tests.server import Server, short_tempdir
from tests.tiny_hf import build_tiny_model, write_chat_dataset

pytestmark = pytest.mark.timeout(240)


def _post(srv: Server, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=30)


def _job(srv: Server, job_id: str) -> dict[str, Any]:
    return httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json()  # type: ignore[no-any-return]


def _wait(srv: Server, job_id: str, pred: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not pred(j := _job(srv, job_id)):
        assert time.monotonic() < deadline, f"job never matched: {j}"
        time.sleep(0.1)
    return j


def _events(srv: Server, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    """Every stored event through the SSE endpoint (it ends once the job has)."""
    out, event = [], ""
    with httpx.stream("GET", f"{srv.base_url}/api/jobs/{job_id}/events", timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event != "end":
                out.append((event, json.loads(line[6:])["data"]))
    return out


def _wait_model(srv: Server, model: str) -> None:
    deadline = time.monotonic() + 15
    while model not in {m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]}:
        assert time.monotonic() < deadline, f"{model} never appeared in /v1/models"
        time.sleep(0.1)


def test_finetune_restart_resume_export_and_answer(start_server: Callable[..., Server]) -> None:
    models, data, outputs = short_tempdir("gvm"), short_tempdir("gvd"), short_tempdir("gvo")
    build_tiny_model(models / "tiny-hf")
    write_chat_dataset(data / "qa.train.jsonl", repeats=8)
    # One torch thread: spinning OpenMP threads crawl on a small busy machine.
    env = {"GPUVISOR_DATASETS_DIR": str(data), "GPUVISOR_OUTPUTS_DIR": str(outputs),
           "OMP_NUM_THREADS": "1"}
    srv = start_server(models, env=env)
    params: dict[str, Any] = {
        "model": "tiny-hf", "train": "qa.train.jsonl", "max_steps": 40, "learning_rate": 5e-3,
        "batch_size": 4, "gradient_accumulation_steps": 1, "save_steps": 1000,
        "export": {"quantize": "Q8_0", "output_name": "tiny-ft"},
    }
    bad = _post(srv, "/api/jobs", {"kind": "finetune", "params": {**params, "lora_r": 0}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "params.lora_r"
    r = _post(srv, "/api/jobs", {"kind": "finetune", "params": params})
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    _wait(srv, job_id, lambda j: j["progress"] >= 4 / 40, timeout=120)

    srv.stop()  # SIGTERM: the runner asks the job to checkpoint and stop
    srv.start()
    interrupted = _job(srv, job_id)
    assert interrupted["status"] == "interrupted", interrupted
    saved = [d["step"] for t, d in _events(srv, job_id) if t == "metric" and "checkpoint" in d]
    assert saved and saved[-1] >= 4

    r = _post(srv, f"/api/jobs/{job_id}/resume")
    assert r.status_code == 200 and r.json()["status"] == "queued", r.text
    done = _wait(srv, job_id, lambda j: j["status"] not in ("queued", "running"), timeout=180)
    assert done["status"] == "succeeded", done
    assert done["attempt"] == 2 and done["result"]["resumed_from_step"] == saved[-1]
    events = _events(srv, job_id)
    steps = [d["step"] for t, d in events if t == "progress" and "step" in d]
    # The checkpoint was taken at the last finished step, so nothing repeats.
    assert steps == list(range(1, 41))
    losses = [d["loss"] for t, d in events if t == "progress" and "step" in d]
    assert losses[-1] < 0.5 * losses[0]
    assert done["result"]["export"]["model"] == "tiny-ft-Q8_0"
    assert _post(srv, f"/api/jobs/{job_id}/resume").status_code == 409

    _wait_model(srv, "tiny-ft-Q8_0")
    answer = _post(srv, "/v1/responses", {
        "model": "tiny-ft-Q8_0", "instructions": "Answer briefly.", "input": "What colour is the sky?",
        "max_output_tokens": 12, "temperature": 0,
    })
    assert answer.status_code == 200, answer.text
    body = answer.json()
    text = "".join(c.get("text", "") for item in body["output"] for c in item.get("content", []))
    # The random base model knows nothing: this answer was learned, converted and quantized.
    assert body["status"] == "completed" and "blue" in text, body
