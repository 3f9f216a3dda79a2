"""How many bytes a context's KV cache and compute buffer take, as llama.cpp sizes them.

Byte arithmetic over a :class:`~supervisor.models.gguf_info.GgufInfo`:

- KV cache: each layer that owns a cache stores ``n_head_kv * key_length`` K
  values and ``n_head_kv * value_length`` V values per cell. llama.cpp rounds
  the context up to a multiple of 256 cells.
- Sliding-window layers keep only ``min(n_ctx, n_swa * n_seq + n_ubatch)``
  cells (rounded up to 256) unless the full-size SWA cache is asked for.
- MLA models cache one compressed latent per token (``key_length`` =
  kv_lora_rank + rope dims, one KV head) and no separate V.
- Without flash attention V is stored transposed, padded to the widest layer.
- Recurrent layers (SSM / RWKV / short conv) hold a fixed f32 state per
  sequence instead of a cache that grows with the context.
- Cache types are costed with their real block sizes (q8_0: 34 bytes per 32
  values; q4_0: 18 bytes per 32).
- Slots that do not share a cache get a stream each of n_ctx cells; a
  unified cache is one stream of n_ctx * slots cells.
- The compute buffer is an upper estimate of the graph of one ubatch.

These match the sizes the engine logs (see tests/test_memfit_engine.py).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import msgspec

from supervisor.models.gguf_info import GgufInfo

CacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
# (values per block, bytes per block), as ggml defines them.
CACHE_TYPE_SIZES: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "iq4_nl": (32, 18),
}
CTX_ALIGN = 256


class KvOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The context settings that change the memory a model needs."""

    cache_type_k: CacheType = "f16"
    cache_type_v: CacheType = "f16"
    flash_attn: bool = True
    swa_full: bool = False
    # Sequences sharing one cache stream (a unified cache holds every slot's).
    n_seq: int = 1
    n_ubatch: int = 512
    # Engine slots, each with its own cache of n_ctx cells (not unified).
    slots: int = 1
    # One cache stream of n_ctx * slots cells for all slots (embedding workers).
    kv_unified: bool = False
    # Logit rows per slot and step: 1, plus the draft tokens speculative
    # decoding verifies.
    n_outputs: int = 1


class KvEstimate(msgspec.Struct, frozen=True, kw_only=True):
    n_cells: int  # cells per stream of full-attention layers (n_ctx rounded up to 256)
    n_cells_swa: int  # cells per stream of sliding-window layers
    k_bytes: int
    v_bytes: int
    recurrent_bytes: int

    @property
    def total(self) -> int:
        return self.k_bytes + self.v_bytes + self.recurrent_bytes



def align_up(n: int, to: int = CTX_ALIGN) -> int:
    return -(-n // to) * to


def align_down(n: int, to: int = CTX_ALIGN) -> int:
    return n // to * to


def row_bytes(cache_type: str, n_values: int) -> int:
    """Bytes of ``n_values`` values of ``cache_type`` (whole blocks)."""
    block, size = CACHE_TYPE_SIZES[cache_type]
    return -(-n_values // block) * size


def _head_dims(info: GgufInfo, il: int) -> tuple[int, int]:
    if info.swa_layers and info.swa_layers[il]:
        return info.key_length_swa, info.value_length_swa
    return info.key_length, info.value_length


def recurrent_state_values(info: GgufInfo) -> int:
    """f32 values of recurrent state per recurrent layer and sequence (r + s)."""
    if info.wkv_head_size:
        return info.token_shift_count * info.n_embd + info.n_embd * info.wkv_head_size
    if info.shortconv_l_cache:
        conv = info.n_embd * (info.shortconv_l_cache - 1)
    else:
        d_conv = max(info.ssm_conv_kernel - 1, 0)
        conv = d_conv * (info.ssm_inner_size + 2 * info.ssm_group_count * info.ssm_state_size)
    return conv + info.ssm_state_size * info.ssm_inner_size


class Streams(NamedTuple):
    """How llama.cpp lays out a context's cache."""

    n_streams: int  # one per slot, or one shared (unified)
    cells: int  # cells per stream of full-attention layers
    cells_swa: int  # cells per stream of sliding-window layers


def cache_streams(info: GgufInfo, n_ctx: int, opts: KvOptions) -> Streams:
    """The engine gets n_ctx * slots: split into one stream per slot, each
    rounded up to 256 cells, or kept as one stream when unified. A window
    stream holds its sequences' windows plus one ubatch."""
    slots = max(1, opts.slots)
    if opts.kv_unified:
        count, cells, seqs = 1, align_up(max(n_ctx, 1) * slots), max(opts.n_seq, 1) * slots
    else:
        count, cells, seqs = slots, align_up(max(n_ctx, 1)), max(opts.n_seq, 1)
    cells_swa = cells
    if info.sliding_window > 0 and not opts.swa_full:
        cells_swa = align_up(min(cells, info.sliding_window * seqs + opts.n_ubatch))
    return Streams(count, cells, cells_swa)


def _layer_costs(info: GgufInfo, n_ctx: int, opts: KvOptions) -> list[tuple[int, int, int]]:
    """(K, V, recurrent state) bytes of each layer, all streams and sequences."""
    streams = cache_streams(info, n_ctx, opts)
    v_pad = 0
    if not opts.flash_attn:
        v_pad = max(
            (_head_dims(info, il)[1] * h for il, h in enumerate(info.n_head_kv_per_layer)),
            default=0,
        )
    state = recurrent_state_values(info) * 4 * max(opts.n_seq, 1) * max(1, opts.slots)
    out: list[tuple[int, int, int]] = []
    for il in range(info.n_layer):
        k = v = 0
        if info.attention_layers[il]:
            cells = (streams.cells_swa if info.swa_layers[il] else streams.cells) * streams.n_streams
            head_k, head_v = _head_dims(info, il)
            n_kv = info.n_head_kv_per_layer[il]
            k = row_bytes(opts.cache_type_k, head_k * n_kv) * cells
            if not info.is_mla:  # else the latent in K serves as V
                v = row_bytes(opts.cache_type_v, v_pad or head_v * n_kv) * cells
        out.append((k, v, state if info.recurrent_layers[il] else 0))
    return out


def kv_layer_bytes(info: GgufInfo, n_ctx: int, opts: KvOptions | None = None) -> list[int]:
    """KV cache plus recurrent state of each layer: it lives on that layer's device."""
    return [k + v + r for k, v, r in _layer_costs(info, n_ctx, opts or KvOptions())]


def kv_cache_bytes(info: GgufInfo, n_ctx: int, opts: KvOptions | None = None) -> KvEstimate:
    """KV cache plus recurrent state of ``info`` at a context of ``n_ctx`` per slot."""
    opts = opts or KvOptions()
    streams = cache_streams(info, n_ctx, opts)
    costs = _layer_costs(info, n_ctx, opts)
    return KvEstimate(
        n_cells=streams.cells,
        n_cells_swa=streams.cells_swa,
        k_bytes=sum(c[0] for c in costs),
        v_bytes=sum(c[1] for c in costs),
        recurrent_bytes=sum(c[2] for c in costs),
    )


def _ffn_width(info: GgufInfo) -> int:
    dense = max(info.n_ff_per_layer, default=0)
    if info.n_expert_used > 0:  # each token's experts run side by side
        return max(dense, info.n_expert_used * (info.n_ff_exp or dense))
    return dense


def compute_buffer_bytes(info: GgufInfo, n_ctx: int, opts: KvOptions | None = None) -> int:
    """An upper estimate of llama.cpp's compute buffer, the graph of one ubatch.

    llama.cpp reserves it for ``min(n_ubatch, context)`` tokens. Counted in
    f32: one layer's activations with nothing reused between its attention
    and feed-forward halves (four FFN-wide and four embedding-wide rows, two
    of Q and four of K/V); the attention masks every layer reads (one per
    cache: full and sliding window); the logit rows the server asks for; and
    without flash attention one layer's scores over the whole stream. The
    allocator reuses memory across a layer, so the engine's own figure is
    lower: measured on the CPU with flash attention, by 1.3x to 2.1x, the
    most where the mask dominates (the engine keeps it in f16).
    """
    opts = opts or KvOptions()
    streams = cache_streams(info, n_ctx, opts)
    tokens = min(opts.n_ubatch, streams.cells * streams.n_streams)
    n_head = max(info.n_head_per_layer, default=info.n_head)
    n_head_kv = max(info.n_head_kv_per_layer, default=info.n_head_kv)
    head = max(info.key_length, info.value_length, info.key_length_swa, info.value_length_swa)
    per_token = 4 * _ffn_width(info) + 4 * info.n_embd + 2 * n_head * head + 4 * n_head_kv * head
    owns = [il for il in range(info.n_layer) if info.attention_layers[il]]
    mask_cells = 0
    if any(not info.swa_layers[il] for il in owns):
        mask_cells += streams.cells
    if any(info.swa_layers[il] for il in owns):
        mask_cells += streams.cells_swa
    logits = max(1, opts.slots) * max(1, opts.n_outputs) * info.n_vocab
    scores = 0 if opts.flash_attn or not owns else n_head * streams.cells * tokens
    return 4 * (tokens * per_token + mask_cells * tokens + logits + scores)
