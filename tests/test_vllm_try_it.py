"""Try it on vLLM, in Chromium, with no export: a fine-tune of a tiny
Hugging Face model finishes, the job page's Try it opens the chat on
``<base>:<output>`` (the adapter dir the fine-tune wrote, served by vLLM's
per-request LoRA), says that the vLLM worker is starting, and the chat
answers once it serves. No export job is created and no GGUF written.

The llama.cpp path (Try it exporting a GGUF adapter, on a machine without
vLLM) is tests/test_web_ui_adapters.py and tests/test_offline_loop.py.
Needs the vLLM environment (``make install-vllm``), the train extra and
Debian's chromium."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from supervisor.config import default_vllm_python
from tests.browser import DESKTOP, new_page
from tests.server import Server, poll_until, running, short_tempdir

pytest.importorskip("peft", reason="needs the train extra")
VLLM_PYTHON = default_vllm_python()
if not VLLM_PYTHON:
    pytest.skip("no vLLM environment (make install-vllm)", allow_module_level=True)

from tests.tiny_hf import build_vllm_model, write_chat_dataset

# A fine-tune, vLLM's start (30-60 s alone on a CPU, more on a busy machine)
# and a chat: coarse bounds against a hang, not timings.
pytestmark = pytest.mark.timeout(600)
BASE = "tiny-vllm"
OUTPUT = "run1"
PAIR = f"{BASE}:{OUTPUT}"


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    models, data, outputs = short_tempdir("gvm"), short_tempdir("gvd"), short_tempdir("gvo")
    build_vllm_model(models / BASE)
    write_chat_dataset(data / "qa.train.jsonl")
    env = {"GPUVISOR_VLLM_PYTHON": VLLM_PYTHON, "GPUVISOR_DATASETS_DIR": str(data),
           "GPUVISOR_OUTPUTS_DIR": str(outputs), "GPUVISOR_N_CTX": "2048", "OMP_NUM_THREADS": "1"}
    with running(Server(models, env=env, model=BASE)) as server:
        yield server


def _get(srv: Server, path: str) -> Any:
    return httpx.get(srv.base_url + path, timeout=30).json()


def _finetune(srv: Server) -> dict[str, Any]:
    params = {"model": BASE, "train": "qa.train.jsonl", "max_steps": 4, "batch_size": 4,
              "gradient_accumulation_steps": 1, "output_name": OUTPUT, "merge": False, "cpu_threads": 1}
    r = httpx.post(srv.base_url + "/api/jobs", json={"kind": "finetune", "params": params}, timeout=30)
    assert r.status_code == 201, r.text
    job: dict[str, Any] = poll_until(lambda: _get(srv, f"/api/jobs/{r.json()['id']}"),
                                     lambda j: j["status"] not in ("queued", "running"), timeout=300, interval=0.5)
    assert job["status"] == "succeeded", job
    return job


def test_try_it_serves_the_finetunes_adapter_on_vllm_with_no_export(browser: Any, srv: Server) -> None:
    from playwright.sync_api import expect

    job = _finetune(srv)
    # Listed once the library's scan saw the fine-tune's files settle.
    listed = poll_until(lambda: _get(srv, "/api/models"), lambda b: any(a["id"] == OUTPUT for a in b["adapters"]))
    [adapter] = [a for a in listed["adapters"] if a["id"] == OUTPUT]
    assert adapter["path"] == job["result"]["adapter_path"] and adapter["usable"], adapter
    assert [(lk["base"], lk["model"], lk["fits"]) for lk in adapter["links"]] == [(BASE, PAIR, True)]
    [base] = [m for m in listed["data"] if m["id"] == BASE]
    assert (base["engine"], base["usable"], base["state"]) == ("vllm", True, "unloaded"), base

    context, pg, watch = new_page(browser, srv.base_url, DESKTOP)
    try:
        pg.goto(f"{srv.base_url}/#/jobs/{job['id']}")
        clicked = time.monotonic()
        pg.click(".try-it button")
        expect(pg.locator("#chat-model")).to_have_value(PAIR, timeout=30_000)
        opened = time.monotonic() - clicked
        # The chat says what the wait is for, and starts the worker before any message.
        note = pg.locator(".start-note")
        expect(note).to_contain_text(f"vLLM worker for {PAIR} is starting", timeout=30_000)
        expect(note).to_contain_text("30-60 s")
        srv.wait_worker(lambda w: w["state"] in ("starting", "ready"), BASE, timeout=60)
        pg.fill("#chat-input", "What colour is the sky?")
        pg.click("form.composer button[type=submit]")
        pg.wait_for_selector(".msg.assistant.completed, .msg.assistant.incomplete", timeout=300_000)
        answered = time.monotonic() - clicked
        assert not pg.locator(".msg.assistant.failed").count()
        assert pg.locator(".msg.assistant .who").first.text_content() == PAIR
        assert " out" in (pg.locator(".msg.assistant .usage").first.text_content() or "")  # its usage came back
        expect(note).to_be_hidden()  # the worker serves: nothing left to say
    finally:
        context.close()
    watch.check()
    print(f"\nTry it on vLLM: chat open {opened:.1f} s after the click, first answer after {answered:.1f} s")

    # Served as the fine-tune wrote it: no export job, no GGUF.
    assert _get(srv, "/api/jobs?kind=export")["data"] == []
    assert not list(srv.models_dir.glob("*.gguf"))
    # The answer came from the adapter on the base's one vLLM worker.
    worker = srv.worker(BASE)
    assert worker["state"] == "ready" and worker["stats"]["requests_done"] >= 1, worker
    [adapter] = [a for a in _get(srv, "/api/models")["adapters"] if a["id"] == OUTPUT]
    assert adapter["adapter_error"] is None, adapter
