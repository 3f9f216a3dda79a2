from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from supervisor.api.models import describe_model
from supervisor.app import timing_from
from supervisor.config import Config, ModelSettings
from supervisor.models.demo import write_tiny_gguf
from supervisor.models.gguf_info import GgufError, GgufInfo, TensorSizes, read_gguf_info
from supervisor.models.kvsize import (
    CACHE_TYPE_SIZES,
    KvOptions,
    compute_buffer_bytes,
    kv_cache_bytes,
)
from supervisor.models.library import ModelEntry
from supervisor.models.memfit import DoesNotFit, choose_context, gib
from supervisor.models.memory import free_memory
from supervisor.models.placement import GPU_RUNTIME_RESERVE, shard_tensor_sizes
from supervisor.workers import room as room_module
from supervisor.workers.handle import WorkerHandle, WorkerState
from supervisor.workers.pool import WorkerPool
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


# ---------------------------------------------------------------- partial offload

MIB = 1024 * 1024
LAYER = 256 * MIB  # one repeating layer of the Llama-3-8B shaped fixture
HEAD = 400 * MIB  # output head (and, alike, the token embeddings)


def llama_sizes(*, tied: bool = False) -> TensorSizes:
    return TensorSizes(
        layer_bytes=[LAYER] * 32,
        output_bytes=1 * MIB if tied else HEAD + MIB,
        token_embd_bytes=HEAD,
        has_output_head=not tied,
    )


def layer_kv(n_ctx: int) -> int:
    return 8 * 128 * 2 * 2 * n_ctx  # 8 KV heads x 128 dims x f16, K and V


def gpu_need(info: GgufInfo, n_ctx: int, layers: int, opts: KvOptions, reserve: int = 0) -> int:
    """GPU bytes with the head and the last ``layers`` layers offloaded."""
    weights = HEAD + MIB + layers * LAYER
    # The compute buffer, plus one CPU layer's weights copied over for a prompt.
    return weights + layers * layer_kv(n_ctx) + compute_buffer_bytes(info, n_ctx, opts) + LAYER + reserve


def test_too_big_for_the_gpu_is_split_by_layers(llama: GgufInfo) -> None:
    sizes = llama_sizes()
    weights = sizes.total
    free = 6 * GIB
    opts = KvOptions()
    d = choose_context(llama, weight_bytes=weights, free_bytes=free, target=4096, floor=2048,
                       opts=opts, tensors=sizes)
    layers = d.layers_placed
    assert 0 < layers < 32 and d.n_gpu_layers == layers + 1  # llama.cpp counts the head too
    assert d.n_ctx == 4096 and d.automatic
    # The most layers that fit: one more would not.
    assert gpu_need(llama, 4096, layers, opts) <= free < gpu_need(llama, 4096, layers + 1, opts)
    assert d.needed_bytes == gpu_need(llama, 4096, layers, opts) <= free
    assert d.weight_bytes == HEAD + MIB + layers * LAYER
    assert d.kv_bytes == layers * layer_kv(4096)
    # The rest stays in RAM: layers, token embeddings, and the KV of the CPU layers.
    assert d.host_bytes == (32 - layers) * (LAYER + layer_kv(4096)) + HEAD
    assert d.placement == f"{layers} of 32 layers on the GPU: weights {gib(weights)} > 6.00 GiB free"
    assert d.partial_offload and d.n_gpu_layers_asked == -1


def test_split_keeps_a_requested_context(llama: GgufInfo) -> None:
    sizes = llama_sizes()
    d = choose_context(llama, weight_bytes=sizes.total, free_bytes=6 * GIB, requested=32768,
                       tensors=sizes)
    assert d.n_ctx == 32768 and not d.automatic and d.reason == "the requested context with partial offload"
    assert gpu_need(llama, 32768, d.layers_placed, KvOptions()) <= 6 * GIB
    assert gpu_need(llama, 32768, d.layers_placed + 1, KvOptions()) > 6 * GIB


def test_split_when_weights_fit_but_the_cache_does_not(llama: GgufInfo) -> None:
    sizes = llama_sizes()
    free = sizes.total + 256 * MIB  # weights fit; the minimum context's KV (512 MiB) does not
    d = choose_context(llama, weight_bytes=sizes.total, free_bytes=free, target=4096, floor=4096,
                       tensors=sizes)
    assert d.partial_offload and d.layers_placed == 31
    assert "weights" in d.placement and "KV cache 0.50 GiB" in d.placement
    assert f"> {gib(free)} free" in d.placement


def test_whole_model_keeps_every_layer(llama: GgufInfo) -> None:
    sizes = llama_sizes()
    d = choose_context(llama, weight_bytes=sizes.total, free_bytes=64 * GIB, tensors=sizes)
    assert (d.layers_placed, d.n_gpu_layers, d.n_layer) == (32, -1, 32)
    assert d.placement == "all 32 layers on the GPU" and not d.partial_offload
    assert d.host_bytes == 0 and d.weight_bytes == sizes.total


def test_ram_is_never_split(llama: GgufInfo) -> None:
    sizes = llama_sizes()
    with pytest.raises(DoesNotFit, match="weights alone need") as err:
        choose_context(llama, weight_bytes=sizes.total, free_bytes=6 * GIB, tensors=sizes,
                       memory_kind="ram")
    assert "layers" not in err.value.message
    d = choose_context(llama, weight_bytes=sizes.total, free_bytes=64 * GIB, tensors=sizes,
                       memory_kind="ram")
    assert d.placement == "all 32 layers in RAM" and d.layers_placed == 32 and d.n_gpu_layers == -1


def test_configured_layers_are_costed_not_searched(llama: GgufInfo) -> None:
    sizes = llama_sizes()
    opts = KvOptions()
    d = choose_context(llama, weight_bytes=sizes.total, free_bytes=64 * GIB, tensors=sizes,
                       n_gpu_layers=11, target=4096)
    assert (d.layers_placed, d.n_gpu_layers, d.n_gpu_layers_asked) == (10, 11, 11)
    assert d.needed_bytes == gpu_need(llama, 4096, 10, opts)
    assert d.placement == "10 of 32 layers on the GPU, as configured (n_gpu_layers 11)"
    assert not d.partial_offload
    # Too many configured layers for the memory: refused, never lowered.
    with pytest.raises(DoesNotFit):
        choose_context(llama, weight_bytes=sizes.total, free_bytes=2 * GIB, tensors=sizes,
                       n_gpu_layers=11)


def test_not_even_one_layer_fits(llama: GgufInfo) -> None:
    sizes = llama_sizes()
    with pytest.raises(DoesNotFit, match="not even one of the 32 layers fits on the GPU"):
        choose_context(llama, weight_bytes=sizes.total, free_bytes=900 * MIB, tensors=sizes)


def test_tied_head_puts_a_copy_of_the_embeddings_on_the_gpu(llama: GgufInfo) -> None:
    sizes = llama_sizes(tied=True)
    assert sizes.output_device_bytes == HEAD + MIB
    d = choose_context(llama, weight_bytes=sizes.total, free_bytes=6 * GIB, tensors=sizes)
    assert d.weight_bytes == HEAD + MIB + d.layers_placed * LAYER
    # The embeddings stay in RAM as well.
    assert d.host_bytes == (32 - d.layers_placed) * (LAYER + layer_kv(d.n_ctx)) + HEAD


def test_reserve_counts_against_the_gpu(llama: GgufInfo) -> None:
    sizes = llama_sizes()
    plain = choose_context(llama, weight_bytes=sizes.total, free_bytes=6 * GIB, tensors=sizes)
    held = choose_context(llama, weight_bytes=sizes.total, free_bytes=6 * GIB, tensors=sizes,
                          reserve_bytes=GIB)
    assert held.layers_placed < plain.layers_placed
    assert held.needed_bytes <= 6 * GIB and "reserve" in held.placement


def test_header_without_tensor_sizes_is_not_split(llama: GgufInfo) -> None:
    assert llama.tensors.layer_bytes == [0] * 32  # header-only fixture
    with pytest.raises(DoesNotFit, match="weights alone"):
        choose_context(llama, weight_bytes=9 * GIB, free_bytes=6 * GIB)


def test_tensor_sizes_from_the_header(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", n_layer=3, n_embd=64, n_ff=128, n_head=4,
                           n_head_kv=2, extra_tokens=0)
    info = read_gguf_info(path)
    sizes = info.tensors
    n_vocab = info.n_vocab
    # norms 2 x 64; q, o 64 x 64; k, v 32 x 64; gate, up, down 128 x 64; all f32.
    per_layer = 4 * (2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)
    assert sizes.layer_bytes == [per_layer] * 3
    assert sizes.token_embd_bytes == 4 * n_vocab * 64
    assert sizes.output_bytes == 4 * (n_vocab * 64 + 64) and sizes.has_output_head
    # Padding aside, the tensors are the file less its header.
    assert 0 < path.stat().st_size - sizes.total < 64 * 1024


def test_shard_sizes_merge() -> None:
    a = TensorSizes(layer_bytes=[5, 5, 0], token_embd_bytes=7)
    b = TensorSizes(layer_bytes=[0, 1, 5], output_bytes=3, has_output_head=True)
    m = a.merged(b)
    assert m.layer_bytes == [5, 6, 5] and m.total == 26 and m.has_output_head
    assert m.output_device_bytes == 3


def test_truncated_tensor_data_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100_000])
    with pytest.raises(GgufError, match="runs past the end"):
        read_gguf_info(cut)


# ---------------------------------------------------------------- the pool's use of it


class _Models:
    def __init__(self, entries: dict[str, ModelEntry]) -> None:
        self.entries = entries

    def entry(self, model_id: str) -> ModelEntry | None:
        return self.entries.get(model_id)


def _entry(path: Path, model_id: str) -> ModelEntry:
    return ModelEntry(id=model_id, path=str(path), files=[str(path)], size_bytes=path.stat().st_size,
                      source="dir", root=str(path.parent), mtime=0.0, info=read_gguf_info(path))


@pytest.fixture
def gpu_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[WorkerPool, list[int]]:
    """A pool on a "GPU" whose free memory the test sets; workers never start."""
    big = write_tiny_gguf(tmp_path / "big.gguf", n_layer=8, n_embd=256, n_ff=1024, extra_tokens=0)
    small = write_tiny_gguf(tmp_path / "small.gguf")
    free = [64 * GIB]

    async def measure(_budget: int, _committed: object) -> tuple[int, str]:
        return free[0], "gpu"

    monkeypatch.setattr(room_module, "measure_free", measure)
    monkeypatch.setattr(WorkerHandle, "start", lambda self: None)
    cfg = Config(n_ctx=1024, min_ctx=1024, load_wait_timeout=0.1)
    models = _Models({"big": _entry(big, "big"), "small": _entry(small, "small")})
    pool = WorkerPool(models, cfg, timing_from(cfg), tmp_path, tmp_path,  # type: ignore[arg-type]
                      device="gpu")
    return pool, free


async def test_pool_loads_a_split_model_with_the_planned_layers(gpu_pool: tuple[WorkerPool, list[int]]) -> None:
    pool, free = gpu_pool
    entry = pool.models.entry("big")
    assert entry is not None
    # Room for the runtime reserve, the compute buffer (14 MiB) and a few layers.
    free[0] = GPU_RUNTIME_RESERVE + 40 * MIB
    handle = await pool.load("big")
    fit = pool.fits[("big", False)]
    assert fit is not None and fit.partial_offload and 0 < fit.layers_placed < 8
    assert handle.spec.n_gpu_layers == fit.n_gpu_layers == fit.layers_placed + 1
    assert fit.needed_bytes <= free[0]
    # The API shows the layers placed and why.
    shown = describe_model(entry, pool)["fit"]
    assert shown["layers_placed"] == fit.layers_placed and shown["n_layer"] == 8
    assert shown["placement"].startswith(f"{fit.layers_placed} of 8 layers on the GPU: weights")
    # An explicit load with the same settings keeps the worker: -1 was asked both times.
    again = await pool.load("big", options=ModelSettings(n_ctx=1024))
    assert again is handle
    await pool.stop_all()


async def test_pool_evicts_idle_models_before_splitting(gpu_pool: tuple[WorkerPool, list[int]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pool, free = gpu_pool
    small = await pool.load("small")
    small.state = WorkerState.READY  # loaded and idle
    entry = pool.models.entry("big")
    assert entry is not None
    free[0] = GPU_RUNTIME_RESERVE + 40 * MIB
    calls = 0

    async def measure(_budget: int, _committed: object) -> tuple[int, str]:
        nonlocal calls
        calls += 1  # the first look finds the small model in the way
        return (free[0] if calls == 1 else 64 * GIB), "gpu"

    monkeypatch.setattr(room_module, "measure_free", measure)
    handle = await pool.load("big")
    assert ("small", False) not in pool.handles
    fit = pool.fits[("big", False)]
    assert fit is not None and not fit.partial_offload and handle.spec.n_gpu_layers == -1
    await pool.stop_all()


def test_shard_sets_are_sized_from_every_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = write_tiny_gguf(tmp_path / "m-00001-of-00002.gguf")
    second = write_tiny_gguf(tmp_path / "m-00002-of-00002.gguf", seed=1)
    entry = _entry(first, "m")
    entry.files = [str(first), str(second)]
    assert entry.info is not None
    one = entry.info.tensors
    both = shard_tensor_sizes(entry, entry.info)
    assert both.layer_bytes == [2 * b for b in one.layer_bytes] and both.total == 2 * one.total
    second.write_bytes(b"not a gguf at all, and long enough to be read")
    assert shard_tensor_sizes(entry, entry.info) == TensorSizes()
    assert "not split between GPU and RAM" in caplog.text
