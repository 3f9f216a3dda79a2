"""Hugging Face model dirs in the library (kind ``hf``, served by vLLM): facts
from config.json and hand-written safetensors headers (no torch), shard
indexes, hostile files, the memory fit, and the listing through a real server."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.models.hf_fit import (
    HfKvOptions,
    choose_hf_context,
    kv_bytes_per_seq,
    kv_cache_bytes,
    load_dtype,
    weight_bytes,
)
from supervisor.models.hf_info import HfError, read_hf_info, safetensors_dtype_bytes
from supervisor.models.library import ModelEntry, ModelLibrary
from supervisor.models.memfit import DoesNotFit
from tests.server import Server, short_tempdir

SIZES = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4, "U8": 1}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# The tiny model vLLM serves in the tests (tests/tiny_hf.py VLLM_CONFIG).
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 2048, "vocab_size": 320,
    "dtype": "bfloat16",
}


def tensors(cfg: dict[str, Any], dtype: str = "BF16") -> dict[str, tuple[str, list[int]]]:
    """A llama's tensors (names and shapes) for ``cfg``."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    out = {"model.embed_tokens.weight": (dtype, [v, h]), "model.norm.weight": (dtype, [h]),
           "lm_head.weight": (dtype, [v, h])}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (dtype, [h, h]), p + "self_attn.k_proj.weight": (dtype, [kv, h]),
                p + "self_attn.v_proj.weight": (dtype, [kv, h]), p + "self_attn.o_proj.weight": (dtype, [h, h]),
                p + "mlp.gate_proj.weight": (dtype, [f, h]), p + "mlp.up_proj.weight": (dtype, [f, h]),
                p + "mlp.down_proj.weight": (dtype, [h, f]), p + "input_layernorm.weight": (dtype, [h])}
    return out


def nbytes(ts: dict[str, tuple[str, list[int]]]) -> int:
    return sum(math.prod(shape) * SIZES[d] for d, shape in ts.values())


def write_safetensors(path: Path, ts: dict[str, tuple[str, list[int]]]) -> Path:
    """The 8-byte little-endian header length, the JSON header, zero bytes for the data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in ts.items():
        n = math.prod(shape) * SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(offset))
    return path


def write_model(d: Path, cfg: dict[str, Any] | None = None, *, shards: int = 1, dtype: str = "BF16",
                tok_template: str | None = TEMPLATE) -> Path:
    cfg = cfg or CONFIG
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    if tok_template is not None:
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": tok_template}))
    ts = list(tensors(cfg.get("text_config", cfg), dtype).items())
    if shards == 1:
        write_safetensors(d / "model.safetensors", dict(ts))
        return d
    weight_map: dict[str, str] = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = dict(ts[i::shards])
        write_safetensors(d / name, part)
        weight_map |= {t: name for t in part}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def listed(root: Path, vllm_python: str | None = sys.executable) -> dict[str, ModelEntry]:
    lib = ModelLibrary([root], settle_s=0, vllm_python=vllm_python)
    lib.rescan()
    return {e.id: e for e in lib.list()}


def test_facts_from_config_and_headers(tmp_path: Path) -> None:
    info = read_hf_info(write_model(tmp_path / "m"))
    assert (info.architecture, info.model_type, info.n_layer, info.n_head, info.n_head_kv, info.head_dim) == (
        "LlamaForCausalLM", "llama", 2, 4, 2, 64)
    assert (info.dtype, info.context_length, info.sliding_window, info.quantization) == ("bfloat16", 2048, 0, None)
    assert info.parameter_bytes == nbytes(tensors(CONFIG)) == info.dtype_bytes["BF16"]
    assert info.weight_files == ["model.safetensors"]
    assert info.chat_template == TEMPLATE
    # chat_template.jinja is where newer transformers write it; it wins.
    (tmp_path / "m" / "chat_template.jinja").write_text("{{ messages }}")
    assert read_hf_info(tmp_path / "m").chat_template == "{{ messages }}"


def test_other_configs_sliding_window_text_config_quantization(tmp_path: Path) -> None:
    mistral = {**CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 512}
    assert read_hf_info(write_model(tmp_path / "a", mistral)).sliding_window == 512
    # Qwen2 names a window it does not use.
    qwen = {**CONFIG, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    assert read_hf_info(write_model(tmp_path / "b", qwen)).sliding_window == 0
    mixed = {**mistral, "layer_types": ["sliding_attention", "full_attention"]}
    info = read_hf_info(write_model(tmp_path / "c", mixed))
    assert (info.sliding_window, info.sliding_layers) == (512, 1)
    # A vision-language config nests the language model's.
    vlm = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
           "text_config": {**CONFIG, "num_hidden_layers": 2, "head_dim": 32},
           "quantization_config": {"quant_method": "awq", "bits": 4}}
    info = read_hf_info(write_model(tmp_path / "d", vlm, tok_template=None))
    assert (info.architecture, info.n_layer, info.head_dim, info.quantization) == (
        "LlavaForConditionalGeneration", 2, 32, "awq")
    assert info.quantization_config == {"quant_method": "awq", "bits": 4}
    assert info.chat_template is None
    # No dtype in the config: the tensors tell.
    nodtype = {k: v for k, v in CONFIG.items() if k != "dtype"}
    assert read_hf_info(write_model(tmp_path / "e", nodtype, dtype="F32")).dtype == "float32"


def test_sharded_index(tmp_path: Path) -> None:
    d = write_model(tmp_path / "m", shards=3)
    info = read_hf_info(d)
    assert info.weight_files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert info.parameter_bytes == nbytes(tensors(CONFIG))
    entry = listed(tmp_path)["m"]
    assert (entry.kind, entry.engine, entry.usable, entry.path) == ("hf", "vllm", True, str(d))
    assert entry.size_bytes == sum((d / f).stat().st_size for f in info.weight_files)
    # A missing shard: listed, unusable, named.
    (d / "model-00002-of-00003.safetensors").unlink()
    entry = listed(tmp_path)["m"]
    assert not entry.usable and "model-00002-of-00003.safetensors" in (entry.reason or "")


def test_adapter_dirs_and_plain_dirs_are_no_models(tmp_path: Path) -> None:
    write_model(tmp_path / "base")
    adapter = write_model(tmp_path / "lora")
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "config.json").write_text("{}")
    write_model(tmp_path / ".hidden")
    assert set(listed(tmp_path)) == {"base"}


def _hostile(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(("name", "make", "why"), [
    ("truncated", lambda p: _hostile(p, b"\x10\x00"), "truncated"),
    ("huge header", lambda p: _hostile(p, (1 << 60).to_bytes(8, "little") + b"{}"), "over the"),
    ("header past the end", lambda p: _hostile(p, (1000).to_bytes(8, "little") + b"{}"), "past the end"),
    ("bad JSON", lambda p: _hostile(p, (5).to_bytes(8, "little") + b"{nope"), "JSON"),
    ("offsets outside the data", lambda p: _hostile(p, _header({"w": {
        "dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}) + bytes(8)), "outside"),
    ("shape not the bytes", lambda p: _hostile(p, _header({"w": {
        "dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}) + bytes(16)), "not 16 bytes"),
    ("not a tensor", lambda p: _hostile(p, _header({"w": [1, 2]})), "tensor"),
])
def test_hostile_safetensors_cost_only_their_model(tmp_path: Path, name: str,
                                                   make: Callable[[Path], Path], why: str) -> None:
    d = write_model(tmp_path / "bad")
    make(d / "model.safetensors")
    with pytest.raises(HfError, match=why):
        safetensors_dtype_bytes(d / "model.safetensors")
    write_model(tmp_path / "good")
    found = listed(tmp_path)
    assert found["good"].usable
    assert not found["bad"].usable and "model.safetensors" in (found["bad"].reason or ""), found["bad"].reason


def _header(entries: dict[str, Any]) -> bytes:
    raw = json.dumps(entries).encode()
    return len(raw).to_bytes(8, "little") + raw


def test_hostile_configs_indexes_and_links(tmp_path: Path) -> None:
    root = tmp_path / "models"
    outside = write_model(tmp_path / "elsewhere")
    bad_json = write_model(root / "badjson")
    (bad_json / "config.json").write_text("{not json")
    no_layers = write_model(root / "nolayers")
    (no_layers / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": "two"}))
    escape = write_model(root / "escape", shards=2)
    (escape / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../x.safetensors"}}))
    linked = write_model(root / "linked")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(outside / "model.safetensors")
    linked_cfg = write_model(root / "linkedcfg")
    (linked_cfg / "config.json").unlink()
    (linked_cfg / "config.json").symlink_to(outside / "config.json")
    fifo = write_model(root / "fifo")
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")  # an open() without O_NONBLOCK would hang the scan
    write_model(root / "good")
    found = listed(root)
    assert found["good"].usable
    reasons = {k: e.reason or "" for k, e in found.items() if not e.usable}
    assert set(reasons) == {"badjson", "nolayers", "escape", "linked", "linkedcfg", "fifo"}, reasons
    assert "config.json" in reasons["badjson"] and "JSON" in reasons["badjson"]
    assert "num_hidden_layers" in reasons["nolayers"]
    assert "../x.safetensors" in reasons["escape"]
    assert "outside" in reasons["linked"] and "outside" in reasons["linkedcfg"]
    assert "not a regular file" in reasons["fifo"]


def test_no_vllm_environment_makes_hf_models_unusable(tmp_path: Path) -> None:
    write_model(tmp_path / "m")
    unset = listed(tmp_path, vllm_python=None)["m"]
    assert not unset.usable and "make install-vllm" in (unset.reason or "")
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    gone = listed(tmp_path, vllm_python=missing)["m"]
    assert not gone.usable and missing in (gone.reason or "") and "make install-vllm" in (gone.reason or "")
    assert listed(tmp_path, vllm_python=sys.executable)["m"].usable


def test_kv_and_weight_estimates(tmp_path: Path) -> None:
    info = read_hf_info(write_model(tmp_path / "m"))
    opts = HfKvOptions(max_num_seqs=4, block_size=16)
    # 2 layers x 2 KV heads x 64 x (K and V) x 2 bytes = 1 KiB per token; vLLM
    # logged "KV cache size: 4,096 tokens, maximum concurrency for 1,024 tokens
    # per request: 4.00x" for this budget on the tiny model.
    assert kv_cache_bytes(info, 1024, opts, "bfloat16") == 4 * 1024 * 1024
    assert kv_bytes_per_seq(info, 1000, opts, "bfloat16") == 1024 * 1008  # whole 16-token pages
    assert weight_bytes(info, "bfloat16") == info.parameter_bytes
    assert load_dtype(info) == "bfloat16"
    # A sliding-window model holds the window plus one step's batch, and one page more.
    slide = {**CONFIG, "sliding_window": 256}
    sw = read_hf_info(write_model(tmp_path / "s", slide))
    batched = HfKvOptions(max_num_seqs=1, block_size=16, max_num_batched_tokens=512)
    page = 16 * 2 * 2 * 64 * 2
    assert kv_bytes_per_seq(sw, 4096, batched, "bfloat16") == 2 * page * (-(-(255 + 512) // 16) + 1)
    assert kv_bytes_per_seq(sw, 128, batched, "bfloat16") == 2 * page * (128 // 16 + 1)


def test_fp32_checkpoint_loads_in_16_bits(tmp_path: Path) -> None:
    fp32 = {**CONFIG, "dtype": "float32"}
    info = read_hf_info(write_model(tmp_path / "m", fp32, dtype="F32"))
    assert load_dtype(info) == "bfloat16"
    assert weight_bytes(info, "bfloat16") == info.parameter_bytes // 2


def test_context_choice_and_refusal(tmp_path: Path) -> None:
    info = read_hf_info(write_model(tmp_path / "m"))
    opts = HfKvOptions(max_num_seqs=4)
    roomy = choose_hf_context(info, free_bytes=8 << 30, opts=opts, memory_kind="gpu")
    # 2,048 tokens x 4 sequences x 1 KiB, and the 16-token page vLLM's block pool holds back.
    assert (roomy.n_ctx, roomy.automatic, roomy.kv_bytes) == (2048, True, (8 << 20) + 16 * 1024)
    assert roomy.needed_bytes == roomy.weight_bytes + roomy.kv_bytes + roomy.compute_bytes + roomy.reserve_bytes
    # Room for 1,024 tokens x 4 sequences of KV and not 1,280: 1,024.
    base = roomy.needed_bytes - roomy.kv_bytes
    tight = choose_hf_context(info, free_bytes=base + (5 << 20) - 1, opts=opts, floor=256, memory_kind="gpu")
    assert (tight.n_ctx, tight.kv_bytes) == (1024, (4 << 20) + 16 * 1024)
    assert "reduced from 2048 to 1024" in tight.reason
    with pytest.raises(DoesNotFit) as refused:
        choose_hf_context(info, free_bytes=base + (4 << 20), opts=opts, requested=2048, memory_kind="gpu")
    assert refused.value.needed_bytes == roomy.needed_bytes
    # Room for the weights and no KV cache: refused, the sizes named.
    with pytest.raises(DoesNotFit) as none:
        choose_hf_context(info, free_bytes=roomy.weight_bytes, opts=opts, memory_kind="cpu", reserve_bytes=0)
    assert none.value.free_bytes == roomy.weight_bytes and "KV cache" in none.value.message


def test_server_lists_hf_models_with_their_engine(tiny_model_path: Path,
                                                  start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvhm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    write_model(models / "org" / "Tiny-HF")
    missing = str(models.parent / "nowhere" / "bin" / "python")
    srv = start_server(models, env={"GPUVISOR_VLLM_PYTHON": missing}, wait_ready=False)
    v1 = {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]}
    assert v1["tiny"]["engine"] == "llama.cpp"
    hf = v1["org/Tiny-HF"]
    assert (hf["engine"], hf["state"]) == ("vllm", "unusable")
    assert "make install-vllm" in hf["reason"] and missing in hf["reason"]
    api = {m["id"]: m for m in httpx.get(srv.base_url + "/api/models", timeout=10).json()["data"]}
    item = api["org/Tiny-HF"]
    assert (item["kind"], item["engine"], item["architecture"], item["context_length"], item["n_layer"]) == (
        "hf", "vllm", "LlamaForCausalLM", 2048, 2)
    # Loading it is refused with the reason, nothing is started.
    r = httpx.post(srv.base_url + "/api/models/org/Tiny-HF/load", timeout=10)
    assert r.status_code == 503 and "make install-vllm" in r.json()["error"]["message"]


def test_a_hub_cache_snapshot_is_an_hf_model(tmp_path: Path) -> None:
    from tests.tiny_hf import put_in_hub_cache

    cache = tmp_path / "hub"
    put_in_hub_cache(write_model(tmp_path / "src", shards=2), cache, "org/Tiny-HF", commit="d" * 40)
    # A safetensors repo whose file links out of the cache: unusable, with the reason.
    snap = put_in_hub_cache(write_model(tmp_path / "src2"), cache, "org/Escape")
    outside = write_safetensors(tmp_path / "outside.safetensors", tensors(CONFIG))
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(outside)
    lib = ModelLibrary([tmp_path / "missing"], hf_cache_dir=cache, settle_s=0, vllm_python=sys.executable)
    lib.rescan()
    got = {e.id: e for e in lib.list()}
    assert set(got) == {"org/Tiny-HF", "org/Escape"}
    e = got["org/Tiny-HF"]
    assert (e.kind, e.source, e.repo_id, e.revision, e.usable) == ("hf", "hf_cache", "org/Tiny-HF", "d" * 40, True)
    assert e.hf is not None and (e.hf.n_layer, e.hf.architecture) == (2, "LlamaForCausalLM")
    assert e.size_bytes == sum(f.stat().st_size for f in (tmp_path / "src").glob("*.safetensors"))
    assert e.path.endswith("d" * 40) and len(e.files) == 3  # config.json and two shards
    bad = got["org/Escape"]
    assert not bad.usable and "resolves outside" in (bad.reason or ""), bad.reason
    # Turned off: neither is listed.
    off = ModelLibrary([tmp_path / "missing"], hf_cache_dir=None, settle_s=0, vllm_python=sys.executable)
    off.rescan()
    assert off.list() == []
