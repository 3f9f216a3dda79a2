"""MTP drafting on a real vLLM worker: a tiny random GLM-4-MoE with one MTP
layer (tests/tiny_hf_mtp.py) in the models dir; loaded with
``speculative = "mtp"`` it keeps its greedy text, drafts with its own MTP
layer, and vLLM counts that layer's KV pages in the exact budget the worker
gave it.

Needs the vLLM environment (``make install-vllm``) and the train extra."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from supervisor.config import default_vllm_python
from tests.server import Server, short_tempdir

pytest.importorskip("transformers", reason="needs the train extra")
VLLM_PYTHON = default_vllm_python()
if not VLLM_PYTHON:
    pytest.skip("no vLLM environment (make install-vllm)", allow_module_level=True)

from tests.tiny_hf_mtp import build_mtp_model
from tests.vllm_drafting import N_CTX, START_S, assert_budget, drafting_server, drafts_and_keeps_its_text

MODEL = "tiny-vllm-mtp"


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    assert VLLM_PYTHON
    models = short_tempdir("gvm")
    build_mtp_model(models / MODEL, max_position_embeddings=N_CTX)
    with drafting_server(models, MODEL, VLLM_PYTHON) as server:
        yield server


@pytest.mark.timeout(3 * START_S)
def test_a_model_drafts_with_its_own_mtp_layer_and_keeps_its_text(srv: Server) -> None:
    item = drafts_and_keeps_its_text(srv, MODEL, {"speculative": "mtp"})
    shown = item["speculative"]
    # draft_max unset: one token a step, as the checkpoint has one MTP layer.
    assert (shown["mode"], shown["draft_model"], shown["draft_max"]) == ("mtp", None, 1), shown
    # The MTP layer takes 0.5 KiB of KV a token beside the 2 decoder layers' 1 KiB.
    assert_budget(srv, MODEL, item, 1536)
