from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from supervisor.models.demo import write_tiny_gguf
from supervisor.models.gguf_info import GgufError, read_gguf_info, template_features
from tests import gguf_headers as hdr


def test_llama_gqa_fields(tmp_path: Path) -> None:
    info = read_gguf_info(hdr.llama_gqa(tmp_path / "m.gguf"))
    assert info.architecture == "llama"
    assert info.name == "test-llama"
    assert info.quantization == "Q4_K_M"
    assert (info.n_layer, info.n_embd, info.n_head, info.n_head_kv) == (32, 4096, 32, 8)
    assert info.key_length == info.value_length == 128  # n_embd / n_head
    assert info.context_length == 8192
    assert info.n_vocab == 100
    assert info.attention_layers == [True] * 32
    assert not any(info.swa_layers) and not info.is_recurrent and not info.is_mla
    assert info.supports_tools and info.supports_reasoning


def test_demo_model_template_has_no_tools(tmp_path: Path) -> None:
    info = read_gguf_info(write_tiny_gguf(tmp_path / "demo.gguf"))
    assert info.quantization == "F32"
    assert (info.supports_tools, info.supports_reasoning) == (False, False)
    assert info.chat_template and "im_start" in info.chat_template


def test_template_features() -> None:
    assert template_features(None) == (False, False)
    assert template_features("{% for t in tools %}{% endfor %}") == (True, False)
    assert template_features("{{ reasoning_effort }}") == (False, True)
    assert template_features("<|channel|>analysis") == (False, True)


def test_gemma3_default_sliding_pattern(tmp_path: Path) -> None:
    info = read_gguf_info(hdr.gemma3_swa(tmp_path / "g.gguf"))
    assert info.sliding_window == 1024
    # llama.cpp's gemma3 default: 5 local layers, then 1 global.
    assert info.swa_layers == [True] * 5 + [False] + [True] * 5 + [False]
    assert info.key_length == 256 and info.key_length_swa == 256


def test_deepseek2_mla_fields(tmp_path: Path) -> None:
    info = read_gguf_info(hdr.deepseek2_mla(tmp_path / "d.gguf"))
    assert info.is_mla
    assert (info.kv_lora_rank, info.key_length_mla, info.value_length_mla) == (512, 192, 128)
    assert info.key_length == 576 and info.n_head_kv == 1


def test_jamba_layers_from_kv_heads(tmp_path: Path) -> None:
    info = read_gguf_info(hdr.jamba_hybrid(tmp_path / "j.gguf"))
    attn = [il for il, a in enumerate(info.attention_layers) if a]
    assert attn == [3, 7]
    assert info.recurrent_layers == [not a for a in info.attention_layers]
    assert (info.ssm_conv_kernel, info.ssm_inner_size, info.ssm_state_size) == (4, 1024, 16)
    assert info.n_head_kv_per_layer == [0, 0, 0, 8, 0, 0, 0, 8]


def test_qwen3next_full_attention_interval(tmp_path: Path) -> None:
    info = read_gguf_info(hdr.qwen3next_hybrid(tmp_path / "q.gguf"))
    assert [il for il, a in enumerate(info.attention_layers) if a] == [3, 7]
    assert sum(info.recurrent_layers) == 6
    assert info.ssm_group_count == 8


def test_gemma3n_shared_kv_and_explicit_pattern(tmp_path: Path) -> None:
    info = read_gguf_info(hdr.gemma3n_shared(tmp_path / "n.gguf"))
    assert info.shared_kv_layers == 10
    assert info.attention_layers == [True] * 20 + [False] * 10
    assert info.swa_layers == [(il % 5) < 4 for il in range(30)]


def test_projector(tmp_path: Path) -> None:
    info = read_gguf_info(hdr.mmproj(tmp_path / "mmproj.gguf"))
    assert info.is_projector


def test_big_token_array_is_counted_not_decoded(tmp_path: Path) -> None:
    def fill(w: gguf.GGUFWriter) -> None:
        w.add_block_count(1)
        w.add_token_list([f"tok{i}" for i in range(20000)])
        w.add_token_scores([0.0] * 20000)

    info = read_gguf_info(hdr.write_header(tmp_path / "v.gguf", "llama", fill))
    assert info.n_vocab == 20000


@pytest.mark.parametrize("cut", [3, 10, 30, 200])
def test_truncated_header_is_a_typed_error(tmp_path: Path, cut: int) -> None:
    full = hdr.llama_gqa(tmp_path / "full.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(full[:cut])
    with pytest.raises(GgufError) as err:
        read_gguf_info(bad)
    assert "truncated" in err.value.reason or "too short" in err.value.reason


def test_not_gguf_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GgufError, match="bad magic"):
        read_gguf_info(bad)
    with pytest.raises(GgufError, match="cannot read"):
        read_gguf_info(tmp_path / "missing.gguf")


def test_missing_architecture(tmp_path: Path) -> None:
    path = tmp_path / "noarch.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.kv_data[0].pop("general.architecture")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(GgufError, match="no general.architecture"):
        read_gguf_info(path)
