"""MTP drafting for ``hf`` models, parent side, without vLLM: the library
counts a checkpoint's MTP layers only where its weights hold them,
``speculative = "mtp"`` (and ``auto``) plans vLLM's ``mtp`` method for such
a model and refuses one without, naming the setting, and the MTP layers' KV
pages are in the fit. The real engine drafts with them in
tests/test_vllm_mtp.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import ModelSettings
from supervisor.errors import ApiError
from supervisor.models.draft import plan_speculative
from supervisor.models.hf_info import mtp_layers
from supervisor.models.memfit import ContextDecision
from supervisor.models.placement import plan_load
from tests.test_hf_library import CONFIG, listed, tensors, write_safetensors
from tests.test_vllm_draft_plan import Library

GLM = {**CONFIG, "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
       "num_nextn_predict_layers": 1}


def mtp_tensors(cfg: dict[str, Any], layers: int) -> dict[str, tuple[str, list[int]]]:
    """GLM-4.5's MTP layers: decoder layers after the last one, with the
    projection joining a token's embedding and the last hidden state."""
    h, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    out: dict[str, tuple[str, list[int]]] = {}
    for i in range(n, n + layers):
        out[f"model.layers.{i}.eh_proj.weight"] = ("BF16", [h, 2 * h])
        out[f"model.layers.{i}.self_attn.q_proj.weight"] = ("BF16", [h, h])
    return out


def write(d: Path, cfg: dict[str, Any], extra: dict[str, tuple[str, list[int]]]) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    write_safetensors(d / "model.safetensors", {**tensors(cfg), **extra})
    return d


@pytest.fixture
def lib(tmp_path: Path) -> Library:
    write(tmp_path / "glm-mtp", GLM, mtp_tensors(GLM, 1))
    two = {**GLM, "num_nextn_predict_layers": 2}
    write(tmp_path / "glm-mtp2", two, mtp_tensors(two, 2))
    # As transformers saves a GLM-4-MoE: the count declared, the layer's tensors dropped.
    write(tmp_path / "glm-declared", GLM, {})
    write(tmp_path / "llama", CONFIG, {})
    return Library(listed(tmp_path))


def test_mtp_layers_count_only_where_the_weights_hold_them(lib: Library) -> None:
    counts = {name: e.hf.mtp_layers for name, e in lib.entries.items() if e.hf is not None}
    assert counts == {"glm-mtp": 1, "glm-mtp2": 2, "glm-declared": 0, "llama": 0}
    # Qwen3-Next and Qwen3.5 keep them under mtp., MiMo under model.mtp_layers.
    assert mtp_layers(1, 24, {"mtp.fc.weight", "model.layers.0.mlp.up_proj.weight"}) == 1
    assert mtp_layers(1, 36, {"model.mtp_layers.0.input_proj.weight"}) == 1
    assert mtp_layers(1, 2, {"model.language_model.layers.2.eh_proj.weight"}) == 1
    # A vision tower's deeper layers are no MTP layers; nor is a count with no tensors.
    assert mtp_layers(1, 2, {"model.visual.layers.2.mlp.fc1.weight"}) == 0
    assert mtp_layers(0, 2, {"mtp.fc.weight"}) == 0


def test_mtp_plans_vllms_method_for_a_model_with_mtp_layers(lib: Library) -> None:
    target = lib.entries["glm-mtp"]
    for settings in (ModelSettings(speculative="mtp"), ModelSettings(speculative="auto")):
        plan = plan_speculative(target, settings, lib)
        # Unset, draft_max is the checkpoint's own MTP layer count (vLLM needs a number).
        assert (plan.options.mode, plan.options.draft_model, plan.options.draft_max, plan.draft) == (
            "mtp", "", 1, None)
    assert plan_speculative(target, ModelSettings(speculative="mtp", draft_max=3), lib).options.draft_max == 3
    # auto without MTP layers drafts nothing, as for GGUF models.
    assert plan_speculative(lib.entries["llama"], ModelSettings(speculative="auto"), lib).options.mode == "off"


def refusal(lib: Library, model: str, settings: ModelSettings) -> ApiError:
    with pytest.raises(ApiError) as caught:
        plan_speculative(lib.entries[model], settings, lib)
    return caught.value


def test_mtp_without_mtp_layers_is_refused_naming_the_setting(lib: Library) -> None:
    for model in ("llama", "glm-declared"):
        err = refusal(lib, model, ModelSettings(speculative="mtp"))
        assert (err.status, err.code, err.param) == (400, "mtp_unavailable", "speculative")
        assert "no MTP layers" in err.message, err.message
    # vLLM runs two MTP layers in turn: 3 tokens would not load, 4 would.
    err = refusal(lib, "glm-mtp2", ModelSettings(speculative="mtp", draft_max=3))
    assert (err.status, err.param) == (400, "draft_max")
    assert plan_speculative(lib.entries["glm-mtp2"], ModelSettings(speculative="mtp", draft_max=4),
                            lib).options.draft_max == 4


def test_the_fit_holds_the_mtp_layers_kv_pages(lib: Library) -> None:
    target = lib.entries["glm-mtp"]

    def fit(settings: ModelSettings) -> ContextDecision:
        plan = plan_speculative(target, settings, lib)
        decision = plan_load(target, settings, explicit_ctx=True, target_ctx=0, min_ctx=256,
                             free_bytes=8 << 30, memory_kind="cpu", slots=2, draft=plan)
        assert decision is not None
        return decision

    alone = fit(ModelSettings(n_ctx=1024))
    drafted = fit(ModelSettings(n_ctx=1024, speculative="mtp"))
    # 1 KiB of KV a token for the 2 decoder layers, 0.5 KiB for the MTP layer
    # (vLLM counted the same: 43,648 tokens in 64 MiB with it, 65,536
    # without); and one page (128 tokens on the CPU) held back by vLLM's block pool.
    assert alone.kv_bytes == (1024 * 2 + 128) * 1024
    assert drafted.kv_bytes == (1024 * 2 + 128) * (1024 + 512)
    # The MTP layer's weights are in the checkpoint's: counted once.
    assert drafted.weight_bytes == alone.weight_bytes
    assert drafted.compute_bytes > alone.compute_bytes
