"""LoRA adapters in the lab UI, in Chromium: a fine-tune job's "Try it"
exports its adapter and opens the chat on ``<base>:<adapter>``, which
answers; the models page lists adapters under their base, a refused one
with the reason.

The server is told of no vLLM environment (a checkout's own would otherwise
be found): this is Try it for llama.cpp, as on a machine without vLLM.
Try it on vLLM is tests/test_vllm_try_it.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("peft", reason="needs the train extra")

from jobs.hf_convert import convert
from jobs.lora_export import convert_adapter
from tests.browser import DESKTOP, new_page
from tests.lora_support import random_adapter
from tests.server import Server, poll_until, running, short_tempdir
from tests.tiny_hf import build_tiny_model, write_chat_dataset

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("ui-lora")
    models, data, outputs = short_tempdir("gvm"), short_tempdir("gvd"), short_tempdir("gvo")
    hf = build_tiny_model(models / "tiny-hf")
    convert(hf, models / "tiny-hf.gguf", "F16", "tiny-hf")
    other = build_tiny_model(tmp / "other" / "tiny-hf", intermediate_size=96)
    convert_adapter(random_adapter(other, tmp / "bad", seed=8), other, models / "bad-lora.gguf", "F16", "bad")
    write_chat_dataset(data / "qa.train.jsonl")
    env = {"GPUVISOR_DATASETS_DIR": str(data), "GPUVISOR_OUTPUTS_DIR": str(outputs), "OMP_NUM_THREADS": "1",
           "GPUVISOR_VLLM_PYTHON": str(tmp / "no-vllm" / "bin" / "python")}
    with running(Server(models, env=env, model="tiny-hf")) as s:
        yield s


@pytest.fixture
def desk(browser: Any, srv: Server) -> Iterator[Any]:
    context, pg, watch = new_page(browser, srv.base_url, DESKTOP)
    yield pg
    context.close()
    watch.check()


def _finetune(srv: Server) -> str:
    params = {"model": "tiny-hf", "train": "qa.train.jsonl", "max_steps": 4, "batch_size": 4,
              "gradient_accumulation_steps": 1, "output_name": "ft", "merge": False, "cpu_threads": 1}
    r = httpx.post(srv.base_url + "/api/jobs", json={"kind": "finetune", "params": params}, timeout=30)
    assert r.status_code == 201, r.text
    job_id = str(r.json()["id"])
    job = poll_until(lambda: httpx.get(f"{srv.base_url}/api/jobs/{job_id}", timeout=10).json(),
                     lambda j: j["status"] not in ("queued", "running"), timeout=180, interval=0.2)
    assert job["status"] == "succeeded", job
    return job_id


def test_try_it_exports_the_adapter_and_chats_with_it(desk: Any, srv: Server) -> None:
    from playwright.sync_api import expect

    job_id = _finetune(srv)
    desk.goto(f"{srv.base_url}/#/jobs/{job_id}")
    clicked = time.monotonic()
    desk.click(".try-it button")
    expect(desk.locator("#chat-model")).to_have_value("tiny-hf:ft-lora", timeout=60_000)
    opened = time.monotonic() - clicked
    exports = httpx.get(f"{srv.base_url}/api/jobs?kind=export", timeout=10).json()["data"]
    assert [(j["params"]["output_name"], j["status"]) for j in exports] == [("ft-lora", "succeeded")], exports
    desk.fill("#chat-input", "What colour is the sky?")
    desk.click("form.composer button[type=submit]")
    desk.wait_for_selector(".msg.assistant.completed, .msg.assistant.incomplete", timeout=60_000)
    answered = time.monotonic() - clicked
    assert not desk.locator(".msg.assistant.failed").count()
    assert desk.locator(".msg.assistant .who").first.text_content() == "tiny-hf:ft-lora"
    print(f"\nTry it on llama.cpp: chat open {opened:.1f} s after the click (the export included), "
          f"first answer after {answered:.1f} s")
    # Exported once: a second "Try it" finds the adapter there and opens the chat again.
    desk.goto(f"{srv.base_url}/#/jobs/{job_id}")
    desk.click(".try-it button")
    expect(desk.locator("#chat-model")).to_have_value("tiny-hf:ft-lora", timeout=60_000)


def test_models_page_lists_adapters_under_their_base(desk: Any, srv: Server) -> None:
    desk.goto(f"{srv.base_url}/#/models")
    refused = desk.locator('tr[data-adapter="tiny-hf:bad-lora"] .adapter-reason')
    refused.wait_for()
    text = refused.text_content() or ""
    assert "Refused" in text and "96" in text
    # Each adapter row follows its base's row.
    rows = desk.eval_on_selector_all("table.models tbody tr", "rs => rs.map(r => r.dataset.model || r.dataset.adapter || '')")
    assert rows.index("tiny-hf:bad-lora") > rows.index("tiny-hf")
