"""The first hour offline, on a real server started with an empty models dir:
the demo models are written, a dataset job prepares chat data, a fine-tune of
tiny-random-demo-hf trains a few steps, "Try it" exports its adapter (as the
job page does), the library links it to tiny-random-demo, and the pair
answers a chat with the adapter applied; in Chromium, the job page's button
exports it and opens the chat on the pair. Exports get names of their own.
Nothing leaves loopback.

This is the path of a machine without vLLM: the server is told of no vLLM
environment (a checkout's own would otherwise be found), so the demo's
Hugging Face twin cannot serve and Try it exports for llama.cpp. Try it on
vLLM, with no export, is tests/test_vllm_try_it.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("peft", reason="needs the train extra")

from jobs.errors import ParamError
from jobs.finetune_params import ExportParams, FinetuneParams
from jobs.kinds import validate_params
from jobs.params import ResolveContext
from supervisor.models.demo import DEMO_MODEL_NAME
from supervisor.models.demo_hf import DEMO_HF_NAME
from tests.browser import DESKTOP, new_page
from tests.jobsupport import make_roots
from tests.server import Server, poll_until, running, short_tempdir
from tests.tiny_hf import QA

pytestmark = pytest.mark.timeout(300)


def _post(srv: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, timeout=60)


def _get(srv: Server, path: str) -> Any:
    return httpx.get(srv.base_url + path, timeout=30).json()


def _run_job(srv: Server, kind: str, params: dict[str, Any], timeout: float = 240) -> dict[str, Any]:
    r = _post(srv, "/api/jobs", {"kind": kind, "params": params})
    assert r.status_code == 201, r.text
    job: dict[str, Any] = poll_until(lambda: _get(srv, f"/api/jobs/{r.json()['id']}"),
                                     lambda j: j["status"] not in ("queued", "running"), timeout=timeout)
    assert job["status"] == "succeeded", job
    return job


def _answer(srv: Server, model: str) -> dict[str, Any]:
    r = _post(srv, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": QA[0][0]}], "max_tokens": 4,
        "temperature": 0, "logprobs": True, "top_logprobs": 3})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _first_logprobs(body: dict[str, Any]) -> dict[str, float]:
    first = body["choices"][0]["logprobs"]["content"][0]
    return {t["token"]: t["logprob"] for t in first["top_logprobs"]}


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    """A first start: empty models dir, the demo models written."""
    models, data, outputs = short_tempdir("gvm"), short_tempdir("gvd"), short_tempdir("gvo")
    with (data / "qa.jsonl").open("w") as f:
        for _ in range(4):
            for q, a in QA:
                f.write(json.dumps({"instruction": q, "output": a}) + "\n")
    env = {"GPUVISOR_WRITE_DEMO_MODEL": "true", "GPUVISOR_DATASETS_DIR": str(data),
           "GPUVISOR_OUTPUTS_DIR": str(outputs), "OMP_NUM_THREADS": "1",
           "GPUVISOR_VLLM_PYTHON": str(models.parent / f"{models.name}-no-vllm" / "bin" / "python")}
    with running(Server(models, env=env)) as server:
        yield server


def _finetune(srv: Server, train: str, **over: Any) -> dict[str, Any]:
    return _run_job(srv, "finetune", {
        "model": DEMO_HF_NAME, "train": train, "max_steps": 4, "learning_rate": 5e-2, "batch_size": 4,
        "gradient_accumulation_steps": 1, "save_steps": 1000, "cpu_threads": 1, **over})


def test_dataset_finetune_try_it_and_chat_offline(srv: Server) -> None:
    # First start: the GGUF demo in the library, its HF twin beside it.
    poll_until(lambda: {m["id"] for m in _get(srv, "/v1/models")["data"]}, lambda ids: DEMO_MODEL_NAME in ids)
    assert (srv.models_dir / DEMO_HF_NAME / "config.json").is_file()
    assert "wrote a tiny random demo model" in srv.log_text()

    ds = _run_job(srv, "dataset", {"input": "qa.jsonl", "eval_ratio": 0.25, "model": DEMO_MODEL_NAME})
    ft = _finetune(srv, ds["result"]["train_path"], export={"outtype": "F32"})
    result = ft["result"]
    # The fine-tune's own export: named for its base and its job.
    assert result["export"]["model"] == f"{DEMO_HF_NAME}-{ft['id']}"

    # "Try it", as the job page does it: export the adapter, wait for the
    # library to link it, chat with the pair.
    name = f"{Path(result['output_dir']).name}-lora"
    exported = _run_job(srv, "export", {"model": result["adapter_path"], "output_name": name})
    assert exported["result"]["adapter"]["base_name"] == DEMO_HF_NAME
    adapter = poll_until(lambda: {a["id"]: a for a in _get(srv, "/api/models")["adapters"]},
                         lambda found: name in found)[name]
    assert adapter["usable"], adapter
    assert [(lk["base"], lk["model"], lk["fits"]) for lk in adapter["links"]] == [
        (DEMO_MODEL_NAME, f"{DEMO_MODEL_NAME}:{name}", True)]
    pair = adapter["links"][0]["model"]
    with_adapter = _first_logprobs(_answer(srv, pair))
    # The pair computes as the fine-tuned model (merged, exported at F32);
    # the adapter is F16, as Try it exports it.
    merged = _first_logprobs(_answer(srv, result["export"]["model"]))
    assert with_adapter.keys() == merged.keys(), (with_adapter, merged)
    assert all(abs(with_adapter[t] - merged[t]) < 0.02 for t in merged), (with_adapter, merged)
    assert _first_logprobs(_answer(srv, DEMO_MODEL_NAME)) != with_adapter, "the adapter changed nothing"

    # Two exports of the merged model in a row: two names, neither "merged".
    first = _run_job(srv, "export", {"model": result["merged_path"]})["result"]["model"]
    second = _run_job(srv, "export", {"model": result["merged_path"]})["result"]["model"]
    assert first != second and "merged" not in first + second
    assert first.startswith(f"{DEMO_HF_NAME}-job_") and second.startswith(f"{DEMO_HF_NAME}-job_")
    ids = poll_until(lambda: {m["id"] for m in _get(srv, "/v1/models")["data"]},
                     lambda ids: {first, second} <= ids)
    assert _answer(srv, second)["choices"][0]["message"]["role"] == "assistant"
    assert f"{DEMO_MODEL_NAME}:{name}" in ids


def test_try_it_on_the_job_page_opens_the_chat_on_the_demo(browser: Any, srv: Server) -> None:
    from playwright.sync_api import expect

    ds = _run_job(srv, "dataset", {"input": "qa.jsonl", "output_name": "qa-ui", "eval_ratio": 0.0})
    job_id = _finetune(srv, ds["result"]["train_path"], merge=False)["id"]
    # Without vLLM the fine-tune's own adapter dir is listed, and cannot serve.
    listed = poll_until(lambda: _get(srv, "/api/models"), lambda b: any(a["id"] == job_id for a in b["adapters"]))
    [own] = [a for a in listed["adapters"] if a["id"] == job_id]
    [base] = [m for m in listed["data"] if m["id"] == own["links"][0]["base"]]
    assert (base["engine"], base["usable"]) == ("vllm", False), base
    context, pg, watch = new_page(browser, srv.base_url, DESKTOP)
    try:
        pg.goto(f"{srv.base_url}/#/jobs/{job_id}")
        pg.click(".try-it button")
        pair = f"{DEMO_MODEL_NAME}:{job_id}-lora"
        expect(pg.locator("#chat-model")).to_have_value(pair, timeout=60_000)
        exports = [j for j in _get(srv, "/api/jobs?kind=export")["data"]
                   if j["params"].get("output_name") == f"{job_id}-lora"]
        assert [j["status"] for j in exports] == ["succeeded"], exports
        assert pg.locator(".start-note").is_hidden()  # llama.cpp: no vLLM start to wait for
        pg.fill("#chat-input", QA[0][0])
        pg.click("form.composer button[type=submit]")
        pg.wait_for_selector(".msg.assistant.completed, .msg.assistant.incomplete", timeout=60_000)
        assert not pg.locator(".msg.assistant.failed").count()
        assert pg.locator(".msg.assistant .who").first.text_content() == pair
    finally:
        context.close()
    watch.check()


def test_export_names_are_pinned_or_left_to_the_job(tmp_path: Path) -> None:
    """What a submit decides: a model's own name (checked against the models
    dir), or nothing for a job's output, which the job names <base>-<job id>."""
    from supervisor.models.demo_hf import write_tiny_hf

    roots = make_roots(tmp_path)
    ctx = ResolveContext(roots)
    write_tiny_hf(roots.models / DEMO_HF_NAME)
    own = validate_params("export", {"model": DEMO_HF_NAME}, ctx)
    assert isinstance(own, ExportParams) and own.output_name == DEMO_HF_NAME
    (roots.models / f"{DEMO_HF_NAME}.gguf").write_bytes(b"")
    with pytest.raises(ParamError) as exists:
        validate_params("export", {"model": DEMO_HF_NAME}, ctx)
    assert exists.value.code == "output_exists"
    merged = roots.outputs / "job_x" / "merged"
    write_tiny_hf(merged)
    job_named = validate_params("export", {"model": str(merged)}, ctx)
    assert isinstance(job_named, ExportParams) and job_named.output_name is None
    ft = validate_params("finetune", {"model": DEMO_HF_NAME, "train": _train(roots.datasets),
                                      "export": {}}, ctx)
    assert isinstance(ft, FinetuneParams) and ft.export is not None and ft.export.output_name is None
    named = validate_params("finetune", {"model": DEMO_HF_NAME, "train": _train(roots.datasets),
                                         "output_name": "run1", "export": {}}, ctx)
    assert isinstance(named, FinetuneParams) and named.export is not None and named.export.output_name == "run1"


def _train(datasets: Path) -> str:
    path = datasets / "t.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "b"}]}) + "\n")
    return path.name


def test_a_base_named_hf_links_to_the_gguf_of_its_name() -> None:
    """An adapter recorded against ``<name>-hf`` finds the GGUF ``<name>``;
    no other name is taken for it (a merged export, a shorter name)."""
    from supervisor.models.adapters import AdapterInfo, Shapes, link
    from supervisor.models.gguf_info import GgufInfo
    from supervisor.models.library import ModelEntry

    def entry(model_id: str) -> ModelEntry:
        return ModelEntry(id=model_id, path=f"/m/{model_id}.gguf", files=[f"/m/{model_id}.gguf"], size_bytes=1,
                          source="dir", root="/m", mtime=0.0, info=GgufInfo(architecture="llama"))

    bases = [entry(n) for n in (DEMO_MODEL_NAME, f"{DEMO_HF_NAME}-job_0123456789abcdef", "tiny-random", "other")]
    shapes: Shapes = {"blk.0.attn_q.weight": (128, 128)}
    for recorded, linked in ((DEMO_HF_NAME, [DEMO_MODEL_NAME]), ("tiny-random-demo_HF", [DEMO_MODEL_NAME]),
                             (DEMO_MODEL_NAME, [DEMO_MODEL_NAME]), ("other-hf", ["other"]), ("hf", [])):
        info = AdapterInfo(architecture="llama", base_name=recorded, rank=4,
                           weights={"blk.0.attn_q.weight": (128, 128)})
        links, why = link(info, "a", bases, lambda _b: shapes)
        assert [(lk.base, lk.fits) for lk in links] == [(b, True) for b in linked], recorded
        assert (why is None) == bool(linked), (recorded, why)
