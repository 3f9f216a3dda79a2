"""The fit of an ``hf`` model with multi-head latent attention (MLA:
DeepSeek-V2/V3, Kimi-K2, ...), parent side, without vLLM: vLLM caches one
latent vector of ``kv_lora_rank + qk_rope_head_dim`` values per token and
layer for such a model (576 on DeepSeek-V3), not a K and a V per KV head,
and the fit counts the same; on the CPU in pages of 16 tokens, as vLLM's CPU
MLA backend takes them. A config of an MLA type without a latent is plain
attention, as it is to vLLM; one with a latent that is no count is refused
naming the field. The real engine's count is checked in
tests/test_vllm_mtp.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import ModelSettings
from supervisor.models.draft import plan_speculative
from supervisor.models.hf_fit import HfKvOptions, kv_bytes_per_seq, kv_values_per_token, null_page_bytes
from supervisor.models.hf_info import HfInfo, config_facts, read_hf_info
from supervisor.models.library import ModelEntry
from supervisor.models.memfit import ContextDecision
from supervisor.models.placement import plan_load
from tests.test_hf_library import CONFIG, listed, tensors, write_safetensors
from tests.test_vllm_draft_plan import Library

# DeepSeek-V3's attention fields on a tiny body (the fit reads config.json
# and the safetensors headers alone, so Llama-named tensors stand in).
DEEPSEEK: dict[str, Any] = {
    **CONFIG, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "num_key_value_heads": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "q_lora_rank": 1536, "num_nextn_predict_layers": 0,
}
LATENT = 512 + 64
# Two layers of the latent, in bf16: vLLM logged 2,064 tokens of the tiny
# DeepSeek-V3 of tests/tiny_hf_mla.py in a budget of 2,064 x 2,304 bytes.
MLA_TOKEN_BYTES = 2 * LATENT * 2
# Two layers of 2 KV heads x 64 values, K and V, in bf16.
LLAMA_TOKEN_BYTES = 2 * 2 * 2 * 64 * 2


def write(d: Path, cfg: dict[str, Any], extra: dict[str, tuple[str, list[int]]] | None = None) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    write_safetensors(d / "model.safetensors", {**tensors(cfg.get("text_config", cfg)), **(extra or {})})
    return d


def fit(entry: ModelEntry, memory_kind: str, lib: Library | None = None,
        settings: ModelSettings | None = None) -> ContextDecision:
    """The fit of two sequences of 1,024 tokens."""
    settings = settings or ModelSettings(n_ctx=1024)
    plan = plan_speculative(entry, settings, lib) if lib is not None else None
    decision = plan_load(entry, settings, explicit_ctx=True, target_ctx=0, min_ctx=256,
                         free_bytes=8 << 30, memory_kind=memory_kind, slots=2, draft=plan)
    assert decision is not None
    return decision


def test_a_deepseek_v3_counts_its_latent_once_per_token_and_layer(tmp_path: Path) -> None:
    info = read_hf_info(write(tmp_path / "ds", DEEPSEEK))
    assert (info.kv_latent_dim, info.n_head_kv, info.head_dim) == (LATENT, 4, 64)
    assert kv_values_per_token(info) == LATENT
    opts = HfKvOptions(max_num_seqs=2, block_size=16)
    assert kv_bytes_per_seq(info, 1000, opts, "bfloat16") == 1008 * MLA_TOKEN_BYTES  # whole pages
    assert null_page_bytes(info, opts, "bfloat16") == 16 * MLA_TOKEN_BYTES
    entry = listed(tmp_path)["ds"]
    # On the CPU vLLM's MLA backend takes pages of 16 tokens (not its usual
    # 128): 2 sequences of 1,024 tokens and the page its block pool holds back.
    assert fit(entry, "cpu").kv_bytes == (2 * 1024 + 16) * MLA_TOKEN_BYTES
    assert fit(entry, "gpu").kv_bytes == (2 * 1024 + 16) * MLA_TOKEN_BYTES


def test_a_llama_keeps_a_k_and_a_v_per_kv_head(tmp_path: Path) -> None:
    info = read_hf_info(write(tmp_path / "llama", CONFIG))
    assert info.kv_latent_dim == 0 and kv_values_per_token(info) == 2 * 2 * 64
    entry = listed(tmp_path)["llama"]
    assert fit(entry, "cpu").kv_bytes == (2 * 1024 + 128) * LLAMA_TOKEN_BYTES
    # A latent rank on a model type vLLM does not serve with MLA changes nothing.
    assert config_facts({**CONFIG, "kv_lora_rank": 512, "qk_rope_head_dim": 64})["kv_latent_dim"] == 0


def test_mla_is_read_as_vllm_decides_it() -> None:
    # An MLA type without kv_lora_rank: plain attention to vLLM's is_deepseek_mla too.
    plain = {k: v for k, v in DEEPSEEK.items() if k != "kv_lora_rank"}
    assert config_facts(plain)["kv_latent_dim"] == 0
    assert config_facts({**DEEPSEEK, "kv_lora_rank": None})["kv_latent_dim"] == 0
    # Kimi-K2 and GLM-4.7-Flash (glm4_moe_lite) are on vLLM's list.
    for model_type in ("kimi_k2", "glm4_moe_lite"):
        assert config_facts({**DEEPSEEK, "model_type": model_type})["kv_latent_dim"] == LATENT
    # A multimodal config nests the DeepSeek-V3 text model: its latent counts.
    nested = {"architectures": ["KimiVLForConditionalGeneration"], "model_type": "kimi_vl",
              "text_config": DEEPSEEK}
    assert config_facts(nested)["kv_latent_dim"] == LATENT
    # A DeepSeek-V4-style config (compress_ratios) names its latent head_dim.
    v4 = {**DEEPSEEK, "model_type": "deepseek_v4", "compress_ratios": [0, 4], "head_dim": 512}
    assert config_facts(v4)["kv_latent_dim"] == 512
    # An EAGLE head for a DeepSeek-V3 target is MLA too; for a Llama it is not.
    eagle = {**DEEPSEEK, "model_type": "eagle", "model": {"model_type": "deepseek_v3"}}
    assert config_facts(eagle)["kv_latent_dim"] == LATENT
    assert config_facts({**eagle, "model": {"model_type": "llama"}})["kv_latent_dim"] == 0


@pytest.mark.parametrize(("field", "value"), [
    ("kv_lora_rank", "512"), ("kv_lora_rank", -512), ("kv_lora_rank", 1 << 40), ("kv_lora_rank", 0),
    ("kv_lora_rank", True), ("kv_lora_rank", 512.0), ("qk_rope_head_dim", "64"), ("qk_rope_head_dim", -64),
])
def test_a_latent_that_is_no_count_is_refused_naming_the_field(tmp_path: Path, field: str,
                                                               value: Any) -> None:
    write(tmp_path / "bad", {**DEEPSEEK, field: value})
    write(tmp_path / "good", DEEPSEEK)
    found = listed(tmp_path)
    assert found["good"].usable
    bad = found["bad"]
    assert not bad.usable and field in (bad.reason or "") and "config.json" in (bad.reason or ""), bad.reason


def test_deepseek_v3_mtp_layers_draft_with_latent_pages(tmp_path: Path) -> None:
    # DeepSeek-V3's MTP layer is the decoder layer after the last one, and MLA too.
    h = DEEPSEEK["hidden_size"]
    mtp = {"model.layers.2.eh_proj.weight": ("BF16", [h, 2 * h])}
    write(tmp_path / "ds-mtp", {**DEEPSEEK, "num_nextn_predict_layers": 1}, mtp)
    lib = Library(listed(tmp_path))
    entry = lib.entries["ds-mtp"]
    assert entry.hf is not None and entry.hf.mtp_layers == 1
    drafted = fit(entry, "cpu", lib, ModelSettings(n_ctx=1024, speculative="mtp"))
    # The 2 decoder layers' latent and the MTP layer's, each 576 values in bf16.
    assert drafted.kv_bytes == (2 * 1024 + 16) * (MLA_TOKEN_BYTES + LATENT * 2)


def test_hf_info_defaults_to_plain_attention() -> None:
    info = HfInfo(architecture="LlamaForCausalLM", model_type="llama", n_layer=2, n_head=4, n_head_kv=2,
                  head_dim=64, hidden_size=256, vocab_size=320, dtype="bfloat16")
    assert info.kv_latent_dim == 0 and kv_values_per_token(info) == 256
