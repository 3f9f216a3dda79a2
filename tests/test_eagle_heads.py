"""EAGLE draft heads in the library, parent side, without vLLM: a head dir is
recognised from its tensors, listed as unusable on its own (it cannot
serve), and planned as vLLM's ``eagle`` / ``eagle3`` method when a target of
its hidden size and vocabulary names it as its draft model; its layer's KV
pages are in the fit. The real engine drafts with one in
tests/test_vllm_serving.py (reloading its Hub snapshot)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import ModelSettings
from supervisor.errors import ApiError
from supervisor.models.draft import plan_speculative
from supervisor.models.hf_fit import plan_hf_load
from supervisor.models.hf_info import draft_head
from tests.test_hf_library import CONFIG, listed, write_model, write_safetensors
from tests.test_vllm_draft_plan import Library


def head_tensors(cfg: dict[str, Any], prefix: str = "layers.0.", fc_in: int = 2) -> dict[str, tuple[str, list[int]]]:
    """An EAGLE head's tensors, as published: ``fc`` and one decoder layer."""
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    return {"fc.weight": ("BF16", [h, fc_in * h]),
            prefix + "self_attn.q_proj.weight": ("BF16", [h, h]), prefix + "self_attn.k_proj.weight": ("BF16", [kv, h]),
            prefix + "self_attn.v_proj.weight": ("BF16", [kv, h]), prefix + "self_attn.o_proj.weight": ("BF16", [h, h]),
            prefix + "mlp.gate_proj.weight": ("BF16", [f, h]), prefix + "mlp.up_proj.weight": ("BF16", [f, h]),
            prefix + "mlp.down_proj.weight": ("BF16", [h, f]),
            prefix + "post_attention_layernorm.weight": ("BF16", [h])}


def write_head(d: Path, cfg: dict[str, Any], **kw: Any) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    (d / "tokenizer.json").write_text(TOKENIZER)
    write_safetensors(d / "model.safetensors", head_tensors(cfg, **kw))
    return d


TOKENIZER = '{"model": {"vocab": {"a": 0, "b": 1}}}'


@pytest.fixture
def lib(tmp_path: Path) -> Library:
    (write_model(tmp_path / "target") / "tokenizer.json").write_text(TOKENIZER)
    write_head(tmp_path / "head", CONFIG)
    write_head(tmp_path / "head3", {**CONFIG, "architectures": ["LlamaForCausalLMEagle3"]}, prefix="midlayer.",
               fc_in=3)
    write_head(tmp_path / "wide-head", {**CONFIG, "hidden_size": 512, "intermediate_size": 1024})
    return Library(listed(tmp_path))


def test_a_head_is_listed_but_cannot_serve(lib: Library) -> None:
    head = lib.entries["head"]
    assert head.hf is not None and head.hf.draft_head == "eagle"
    assert not head.usable and "EAGLE draft head" in (head.reason or ""), head.reason
    head3 = lib.entries["head3"]
    assert head3.hf is not None and head3.hf.draft_head == "eagle3"
    assert not head3.usable and "an EAGLE-3 draft head" in (head3.reason or ""), head3.reason
    # A whole model is no head.
    target = lib.entries["target"]
    assert target.usable and target.hf is not None and target.hf.draft_head is None


def test_the_kind_of_head_comes_from_its_tensors_and_architecture() -> None:
    assert draft_head("LlamaForCausalLM", {"fc.weight", "layers.0.mlp.up_proj.weight"}) == "eagle"
    assert draft_head("LlamaForCausalLM", {"model.fc.weight"}) == "eagle"
    assert draft_head("LlamaForCausalLMEagle3", {"fc.weight", "midlayer.mlp.up_proj.weight"}) == "eagle3"
    assert draft_head("LlamaForCausalLM", {"midlayer.mlp.up_proj.weight"}) == "eagle3"
    assert draft_head("LlamaForCausalLM", {"model.norm.weight", "lm_head.weight"}) is None
    # A model whose layers hold an "fc" of their own (a vision tower's) is no head.
    assert draft_head("LlavaForConditionalGeneration", {"vision.layers.0.fc.weight"}) is None


def test_a_target_drafts_with_a_head_as_vllms_eagle_method(lib: Library) -> None:
    target = lib.entries["target"]
    for name, method in (("head", "eagle"), ("head3", "eagle3")):
        plan = plan_speculative(target, ModelSettings(speculative="draft", draft_model=name, draft_max=4), lib)
        assert (plan.options.mode, plan.options.draft_model, plan.options.draft_max) == (
            method, lib.entries[name].path, 4)
        assert plan.draft_id == name
    # The head's fc takes the target's hidden state: another width is refused, naming the setting.
    with pytest.raises(ApiError) as caught:
        plan_speculative(target, ModelSettings(speculative="draft", draft_model="wide-head"), lib)
    assert (caught.value.code, caught.value.param) == ("draft_unusable", "draft_model")
    assert "hidden size" in caught.value.message


def test_the_fit_holds_the_heads_layer(lib: Library) -> None:
    target, head = lib.entries["target"].hf, lib.entries["head"].hf
    assert target is not None and head is not None
    alone = plan_hf_load(target, requested=1024, target_ctx=0, min_ctx=256, free_bytes=8 << 30,
                         memory_kind="cpu", slots=2)
    drafted = plan_hf_load(target, requested=1024, target_ctx=0, min_ctx=256, free_bytes=8 << 30,
                           memory_kind="cpu", slots=2, draft=head)
    # 1 KiB of KV a token for the target's 2 layers, 0.5 KiB for the head's
    # one (vLLM counted the same: 43,648 tokens in 64 MiB with the head, 65,536
    # without); and one page (128 tokens on the CPU) held back by vLLM's block pool.
    assert drafted.kv_bytes == (1024 * 2 + 128) * (1024 + 512)
    assert drafted.weight_bytes == alone.weight_bytes + head.parameter_bytes
