"""MTP drafting on a real vLLM worker: a tiny random GLM-4-MoE with one MTP
layer (tests/tiny_hf_mtp.py) in the models dir; loaded with
``speculative = "mtp"`` it keeps its greedy text, drafts with its own MTP
layer, and vLLM counts that layer's KV pages in the exact budget the worker
gave it.

Needs the vLLM environment (``make install-vllm``) and the train extra."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from supervisor.config import default_vllm_python
from tests.server import Server, running, short_tempdir

pytest.importorskip("transformers", reason="needs the train extra")
VLLM_PYTHON = default_vllm_python()
if not VLLM_PYTHON:
    pytest.skip("no vLLM environment (make install-vllm)", allow_module_level=True)

from tests.tiny_hf_mtp import build_mtp_model

MODEL = "tiny-vllm-mtp"
N_CTX = 1024
# vLLM's start on a busy 2-core machine.
START_S = 240


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    models = short_tempdir("gvm")
    build_mtp_model(models / MODEL, max_position_embeddings=N_CTX)
    env = {"GPUVISOR_VLLM_PYTHON": VLLM_PYTHON, "GPUVISOR_PARALLEL": "2", "GPUVISOR_N_CTX": str(N_CTX)}
    with running(Server(models, env=env, model=MODEL)) as server:
        yield server


def _complete(srv: Server) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "one two three one two three one two", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True}
    r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=START_S)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.timeout(3 * START_S)
def test_a_model_drafts_with_its_own_mtp_layer_and_keeps_its_text(srv: Server) -> None:
    plain = _complete(srv)["choices"][0]["text"]
    pid = srv.worker(MODEL)["pid"]
    r = httpx.post(f"{srv.base_url}/api/models/{MODEL}/load", timeout=START_S, json={"speculative": "mtp"})
    assert r.status_code == 200, r.text
    srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid, MODEL, timeout=START_S)
    drafted = _complete(srv)
    # Greedy: the model verifies every drafted token, so the text is the same.
    assert drafted["choices"][0]["text"] == plain and drafted["usage"]["completion_tokens"] == 48
    state = srv.wait_worker(lambda w: bool(w["stats"]) and w["stats"]["draft_tokens"] > 0, MODEL,
                            timeout=30)["stats"]
    assert 0 <= state["draft_accepted"] <= state["draft_tokens"], state
    item = httpx.get(f"{srv.base_url}/api/models/{MODEL}", timeout=10).json()
    shown = item["speculative"]
    # draft_max unset: one token a step, as the checkpoint has one MTP layer.
    assert (shown["mode"], shown["draft_model"], shown["draft_max"]) == ("mtp", None, 1), shown
    # The MTP layer takes 0.5 KiB of KV a token beside the 2 decoder layers'
    # 1 KiB, and vLLM counts as many tokens in the budget the worker gave it
    # (with the page of 128 tokens, the CPU build's, its block pool holds back).
    assert item["fit"]["kv_bytes"] == (N_CTX * 2 + 128) * 1536, item["fit"]
    log = httpx.get(f"{srv.base_url}/api/models/{MODEL}/log", timeout=10).text
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    assert found and int(found[-1].replace(",", "")) == N_CTX * 2 + 128, log[-2000:]
