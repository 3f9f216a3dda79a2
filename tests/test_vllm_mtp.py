"""MTP drafting on a real vLLM worker: a tiny random GLM-4-MoE with one MTP
layer (tests/tiny_hf_mtp.py) in the models dir; loaded with
``speculative = "mtp"`` it keeps its greedy text, drafts with its own MTP
layer, and vLLM counts that layer's KV pages in the exact budget the worker
gave it.

Beside it a tiny random DeepSeek-V3 (tests/tiny_hf_mla.py), the family
whose MTP layers vLLM drafts with as well: its multi-head latent attention
caches one latent vector per token and layer, and vLLM finds exactly the
tokens the fit planned in the budget the worker gave it.

Needs the vLLM environment (``make install-vllm``) and the train extra."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from supervisor.config import default_vllm_python
from tests.server import Server, short_tempdir

pytest.importorskip("transformers", reason="needs the train extra")
VLLM_PYTHON = default_vllm_python()
if not VLLM_PYTHON:
    pytest.skip("no vLLM environment (make install-vllm)", allow_module_level=True)

from tests.tiny_hf_mla import LATENT_DIM, LAYERS, build_mla_model
from tests.tiny_hf_mtp import build_mtp_model
from tests.vllm_drafting import N_CTX, START_S, assert_budget, drafting_server, drafts_and_keeps_its_text

MODEL = "tiny-vllm-mtp"
MLA_MODEL = "tiny-vllm-mla"
# vLLM's CPU MLA backend takes pages of 16 tokens, the one its block pool
# holds back among them.
MLA_PAGE_TOKENS = 16


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    assert VLLM_PYTHON
    models = short_tempdir("gvm")
    build_mtp_model(models / MODEL, max_position_embeddings=N_CTX)
    build_mla_model(models / MLA_MODEL, max_position_embeddings=N_CTX)
    with drafting_server(models, MODEL, VLLM_PYTHON) as server:
        yield server


@pytest.mark.timeout(2 * START_S)
def test_an_mla_model_gets_the_latent_kv_budget_the_fit_planned(srv: Server) -> None:
    url = f"{srv.base_url}/api/models/{MLA_MODEL}"
    try:
        r = httpx.post(url + "/load", timeout=START_S, json={})
        assert r.status_code == 200, r.text
        srv.wait_worker(lambda w: w["state"] == "ready", MLA_MODEL, timeout=START_S)
        body = {"model": MLA_MODEL, "prompt": "one two three", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        done = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=START_S)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 8, done.text
        # 2 sequences of N_CTX tokens and the held page, each token 2 layers
        # of one 576-value latent in bf16 (a K and a V per head would be 4,096).
        tokens = 2 * N_CTX + MLA_PAGE_TOKENS
        item = httpx.get(url, timeout=10).json()
        assert item["fit"]["kv_bytes"] == tokens * LAYERS * LATENT_DIM * 2, item["fit"]
        log = httpx.get(url + "/log", timeout=10).text
        found = re.findall(r"KV cache size: ([\d,]+) tokens", log)
        assert found and int(found[-1].replace(",", "")) == tokens, log[-2000:]
    finally:  # the module's other test runs with this worker gone
        httpx.post(url + "/unload", timeout=60).raise_for_status()


@pytest.mark.timeout(3 * START_S)
def test_a_model_drafts_with_its_own_mtp_layer_and_keeps_its_text(srv: Server) -> None:
    item = drafts_and_keeps_its_text(srv, MODEL, {"speculative": "mtp"})
    shown = item["speculative"]
    # draft_max unset: one token a step, as the checkpoint has one MTP layer.
    assert (shown["mode"], shown["draft_model"], shown["draft_max"]) == ("mtp", None, 1), shown
    # The MTP layer takes 0.5 KiB of KV a token beside the 2 decoder layers' 1 KiB.
    assert_budget(srv, MODEL, item, 1536)
