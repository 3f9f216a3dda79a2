from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from supervisor.gguf_info import GgufInfo, read_gguf_info
from supervisor.memfit import (
    CACHE_TYPE_SIZES,
    DoesNotFit,
    KvOptions,
    choose_context,
    compute_buffer_bytes,
    free_memory,
    kv_cache_bytes,
)
from tests import gguf_headers as hdr

GIB = 1024**3


@pytest.fixture
def llama(tmp_path: Path) -> GgufInfo:
    return read_gguf_info(hdr.llama_gqa(tmp_path / "llama.gguf"))


def test_block_sizes_match_ggml() -> None:
    for name, (block, size) in CACHE_TYPE_SIZES.items():
        qtype = gguf.GGMLQuantizationType[name.upper()]
        assert gguf.GGML_QUANT_SIZES[qtype] == (block, size)
    assert CACHE_TYPE_SIZES["q8_0"] == (32, 34) and CACHE_TYPE_SIZES["q4_0"] == (32, 18)


def test_gqa_f16(llama: GgufInfo) -> None:
    est = kv_cache_bytes(llama, 4096)
    # 32 layers x 8 KV heads x 128 dims x 2 bytes x 4096 cells, for K and for V.
    assert est.k_bytes == est.v_bytes == 32 * 8 * 128 * 2 * 4096
    assert est.total == 512 * 1024 * 1024
    assert est.recurrent_bytes == 0


def test_context_rounds_up_to_256_cells(llama: GgufInfo) -> None:
    assert kv_cache_bytes(llama, 1000).n_cells == 1024
    assert kv_cache_bytes(llama, 1000).total == kv_cache_bytes(llama, 1024).total


@pytest.mark.parametrize(("ctype", "row"), [("q8_0", 1024 // 32 * 34), ("q4_0", 1024 // 32 * 18)])
def test_quantized_cache_types(llama: GgufInfo, ctype: str, row: int) -> None:
    opts = KvOptions(cache_type_k=ctype, cache_type_v=ctype)  # type: ignore[arg-type]
    est = kv_cache_bytes(llama, 8192, opts)
    assert est.k_bytes == est.v_bytes == 32 * row * 8192


def test_sliding_window_layers(tmp_path: Path) -> None:
    info = read_gguf_info(hdr.gemma3_swa(tmp_path / "g.gguf"))
    row = 4 * 256 * 2  # 4 KV heads x 256 dims x f16
    est = kv_cache_bytes(info, 32768)
    swa_cells = 1536  # window 1024 + ubatch 512, rounded up to 256
    assert est.n_cells_swa == swa_cells
    assert est.k_bytes == est.v_bytes == (10 * swa_cells + 2 * 32768) * row
    full = kv_cache_bytes(info, 32768, KvOptions(swa_full=True))
    assert full.k_bytes == 12 * 32768 * row
    small = kv_cache_bytes(info, 1024)  # context under the window: all layers 1024
    assert small.k_bytes == 12 * 1024 * row


def test_mla_latent_cache(tmp_path: Path) -> None:
    info = read_gguf_info(hdr.deepseek2_mla(tmp_path / "d.gguf"))
    est = kv_cache_bytes(info, 4096)
    assert est.k_bytes == 27 * (512 + 64) * 2 * 4096
    assert est.v_bytes == 0


def test_hybrid_mamba_attention(tmp_path: Path) -> None:
    info = read_gguf_info(hdr.jamba_hybrid(tmp_path / "j.gguf"))
    est = kv_cache_bytes(info, 65536)
    assert est.k_bytes == est.v_bytes == 2 * 8 * 64 * 2 * 65536
    # per Mamba layer: conv (4-1) x 1024 + state 16 x 1024, f32
    assert est.recurrent_bytes == 6 * (3 * 1024 + 16 * 1024) * 4
    assert kv_cache_bytes(info, 4096).recurrent_bytes == est.recurrent_bytes


def test_hybrid_gated_delta_net(tmp_path: Path) -> None:
    info = read_gguf_info(hdr.qwen3next_hybrid(tmp_path / "q.gguf"))
    est = kv_cache_bytes(info, 8192)
    assert est.k_bytes == est.v_bytes == 2 * 2 * 256 * 2 * 8192
    conv = 3 * (2048 + 2 * 8 * 128)
    assert est.recurrent_bytes == 6 * (conv + 128 * 2048) * 4


def test_shared_kv_layers(tmp_path: Path) -> None:
    info = read_gguf_info(hdr.gemma3n_shared(tmp_path / "n.gguf"))
    est = kv_cache_bytes(info, 32768)
    row = 2 * 256 * 2
    # 20 layers own a cache: 16 sliding (512 + 512 cells), 4 global.
    assert est.k_bytes == est.v_bytes == (16 * 1024 + 4 * 32768) * row


def test_no_flash_attention_costs_scores(llama: GgufInfo) -> None:
    fa = compute_buffer_bytes(llama, 8192, KvOptions(flash_attn=True))
    no_fa = compute_buffer_bytes(llama, 8192, KvOptions(flash_attn=False))
    assert no_fa - fa == 32 * 8192 * 512 * 4


def test_requested_context_fits(llama: GgufInfo) -> None:
    d = choose_context(llama, weight_bytes=4 * GIB, free_bytes=16 * GIB, requested=8192)
    assert d.n_ctx == 8192 and not d.automatic
    assert d.kv_bytes == GIB
    assert d.needed_bytes == 4 * GIB + GIB + d.compute_bytes


def test_requested_context_refused_with_sizes(llama: GgufInfo) -> None:
    with pytest.raises(DoesNotFit) as err:
        choose_context(llama, weight_bytes=4 * GIB, free_bytes=int(4.6 * GIB), requested=8192)
    msg = err.value.message
    assert "8192" in msg and "4.00 GiB weights" in msg and "1.00 GiB KV cache" in msg
    assert "4.60 GiB" in msg and "largest context that fits" in msg
    assert err.value.status == 400 and err.value.code == "model_does_not_fit"


def test_automatic_context_shrinks_aligned(llama: GgufInfo) -> None:
    free = 4 * GIB + 300 * 1024 * 1024
    d = choose_context(llama, weight_bytes=4 * GIB, free_bytes=free, floor=1024)
    assert d.automatic and d.n_ctx % 256 == 0 and 1024 <= d.n_ctx < 8192
    assert d.needed_bytes <= free
    bigger = kv_cache_bytes(llama, d.n_ctx + 256).total + compute_buffer_bytes(llama, d.n_ctx + 256)
    assert 4 * GIB + bigger > free
    assert "reduced from 8192" in d.reason


def test_automatic_context_native_when_room(llama: GgufInfo) -> None:
    d = choose_context(llama, weight_bytes=GIB, free_bytes=64 * GIB)
    assert d.n_ctx == 8192
    d = choose_context(llama, weight_bytes=GIB, free_bytes=64 * GIB, target=100_000)
    assert d.n_ctx == 8192  # never above the native context automatically


def test_floor_and_weights_refusals(llama: GgufInfo) -> None:
    with pytest.raises(DoesNotFit, match="minimum context 4096"):
        choose_context(
            llama, weight_bytes=4 * GIB, free_bytes=4 * GIB + 10 * 1024 * 1024, floor=4096
        )
    with pytest.raises(DoesNotFit, match="weights alone need 8.00 GiB"):
        choose_context(llama, weight_bytes=8 * GIB, free_bytes=6 * GIB)


SMI = "0, GPU-aaaa, 1000, 24000\n1, GPU-bbbb, 20000, 24000\n"


def test_free_memory_gpu_respects_visible_devices() -> None:
    snap = free_memory({}, smi=lambda: SMI)
    assert snap.kind == "gpu" and snap.free_bytes == 21000 * 1024 * 1024
    snap = free_memory({"CUDA_VISIBLE_DEVICES": "1"}, smi=lambda: SMI)
    assert [d.index for d in snap.devices] == [1] and snap.free_bytes == 20000 * 1024 * 1024
    snap = free_memory({"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}, smi=lambda: SMI)
    assert [d.index for d in snap.devices] == [0]


def test_free_memory_falls_back_to_ram() -> None:
    snap = free_memory({"CUDA_VISIBLE_DEVICES": ""}, smi=lambda: SMI)
    assert snap.kind == "ram" and snap.note and "hides" in snap.note

    def missing() -> str:
        raise FileNotFoundError("nvidia-smi")

    snap = free_memory({}, smi=missing)
    assert snap.kind == "ram" and snap.free_bytes > 0 and snap.note == "nvidia-smi not found"
