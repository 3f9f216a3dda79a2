"""EAGLE drafting on a real vLLM worker: a tiny random target and an EAGLE
head for it (tests/tiny_eagle.py) in the models dir; the target loaded with
the head as its draft model keeps its greedy text, drafts, and vLLM counts
the head's KV pages in the exact budget the worker gave it.

Needs the vLLM environment (``make install-vllm``) and the train extra."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from supervisor.config import default_vllm_python
from tests.server import Server, short_tempdir

pytest.importorskip("transformers", reason="needs the train extra")
VLLM_PYTHON = default_vllm_python()
if not VLLM_PYTHON:
    pytest.skip("no vLLM environment (make install-vllm)", allow_module_level=True)

from tests.tiny_eagle import build_eagle_head
from tests.tiny_hf import build_vllm_model
from tests.vllm_drafting import N_CTX, START_S, assert_budget, drafting_server, drafts_and_keeps_its_text

MODEL = "tiny-vllm"
HEAD = "tiny-vllm-eagle"


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    assert VLLM_PYTHON
    models = short_tempdir("gve")
    build_vllm_model(models / MODEL, max_position_embeddings=N_CTX)
    build_eagle_head(models / MODEL, models / HEAD)
    with drafting_server(models, MODEL, VLLM_PYTHON) as server:
        yield server


@pytest.mark.timeout(3 * START_S)
def test_a_target_drafts_with_an_eagle_head_and_keeps_its_text(srv: Server) -> None:
    models = {m["id"]: m for m in httpx.get(srv.base_url + "/api/models", timeout=10).json()["data"]}
    assert not models[HEAD]["usable"] and "EAGLE draft head" in models[HEAD]["reason"], models[HEAD]
    item = drafts_and_keeps_its_text(srv, MODEL, {"speculative": "draft", "draft_model": HEAD, "draft_max": 3})
    shown = item["speculative"]
    assert (shown["mode"], shown["draft_model"], shown["draft_max"]) == ("eagle", HEAD, 3), shown
    # The head's one layer takes 0.5 KiB of KV a token beside the target's 1 KiB.
    assert_budget(srv, MODEL, item, 1536)
