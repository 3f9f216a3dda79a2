"""Will an ``hf`` model fit under vLLM, and with how long a context?

Our fit decides and hands vLLM an exact KV cache budget
(``kv_cache_memory_bytes``), so vLLM never claims its default share of a
device (90 % of a GPU; on the CPU the same fraction of RAM): the lease stays
the one that decides. The sizes follow vLLM's own accounting
(vllm/v1/kv_cache_interface.py):

- weights: the safetensors tensor bytes, float tensors at the dtype vLLM
  loads (a float32 checkpoint is loaded in 16 bits, as vLLM does);
- KV cache: pages of ``block_size`` tokens (:func:`block_size`), each
  :func:`kv_values_per_token` values per layer: ``2 * kv_heads * head_dim``
  (a K and a V per KV head), or for a model with multi-head latent
  attention (MLA: DeepSeek-V2/V3, Kimi-K2, ...) its one latent vector,
  ``kv_lora_rank + qk_rope_head_dim``, as vLLM caches it (one KV head, no
  separate V); a full-attention layer holds ``ceil(max_model_len /
  block_size)`` pages per sequence, a sliding-window layer
  ``ceil(min(window - 1 + max_num_batched_tokens, max_model_len) /
  block_size) + 1``; times ``max_num_seqs`` sequences, all of them at full
  length at once; plus one page of every layer, which vLLM's block pool
  holds back for good (its null block);
- activations: an upper estimate of one step of ``max_num_batched_tokens``
  (attention, MLP and logits rows), counted in f32;
- a fixed reserve for the runtime (CUDA context and graphs on a GPU; torch
  and the engine processes themselves in RAM);
- a draft model (speculative decoding, ``draft``): its weights, its KV pages
  for the same sequences and context (vLLM keeps them in the one KV cache,
  and the worker's budget holds both), and its activations. A checkpoint's
  own MTP layers draft as such a model (:func:`mtp_draft`) whose weights are
  already in the checkpoint's.

The decision is a :class:`~supervisor.models.memfit.ContextDecision`, as for
GGUF models, so the pool and the API report it alike: ``n_ctx`` is vLLM's
``max_model_len`` and ``kv_bytes`` the budget the worker passes on.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from supervisor.errors import BadRequest
from supervisor.models.hf_info import DTYPE_BYTES, FLOAT_DTYPES, HfInfo
from supervisor.models.kvsize import CTX_ALIGN, align_down, align_up
from supervisor.models.memfit import ContextDecision, DoesNotFit, Need, gib

# What a vLLM worker's processes take beyond weights, KV cache and
# activations. Round figures: on a GPU the CUDA context, cuBLAS workspaces
# and CUDA graphs; in RAM torch, vLLM and its engine-core process (measured
# about 1 GiB of RSS together on the CPU build with a tiny model).
HF_GPU_RESERVE = 1 << 30
HF_CPU_RESERVE = 1 << 30
_LOAD_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# vLLM's KV page sizes (tokens): its CUDA default, and its CPU build's
# (vllm/platforms/cpu.py), which the worker leaves as they are. The CPU
# build serves MLA models with pages of 16 (its reference MLA kernel takes
# no other size); on a CPU with AMX it picks its AMX kernel and keeps 128,
# where the fit rounds to the smaller page and may count up to 112 tokens
# a sequence (and in the held page) short; the worker's own budget follows
# the block size vLLM actually took.
GPU_BLOCK_SIZE = 16
CPU_BLOCK_SIZE = 128
CPU_MLA_BLOCK_SIZE = 16


class HfKvOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The vLLM settings that change the memory a model needs; the worker
    passes the same values to the engine."""

    max_num_seqs: int = 1
    block_size: int = 16
    max_num_batched_tokens: int = 2048


def load_dtype(info: HfInfo) -> str:
    """The dtype vLLM is told to load with: the checkpoint's, a float32 one in bfloat16."""
    return info.dtype if info.dtype in ("bfloat16", "float16") else "bfloat16"


def weight_bytes(info: HfInfo, dtype: str) -> int:
    """Tensor bytes once loaded: float tensors converted to ``dtype``, the rest
    (quantized packs, scales) as stored."""
    size = _LOAD_DTYPE_BYTES[dtype]
    total = 0
    for stored, n in info.dtype_bytes.items():
        if stored in FLOAT_DTYPES:
            total += n // DTYPE_BYTES[stored] * size
        else:
            total += n
    return total


def kv_values_per_token(info: HfInfo) -> int:
    """KV values one layer caches per token: an MLA model's latent vector
    (vLLM's ``MLAAttentionSpec``: one head, no separate V), else a K and a V
    of ``head_dim`` for every KV head."""
    return info.kv_latent_dim or 2 * info.n_head_kv * info.head_dim


def kv_bytes_per_seq(info: HfInfo, max_model_len: int, opts: HfKvOptions, dtype: str) -> int:
    """One sequence's KV pages at ``max_model_len`` tokens, every layer."""
    bs = opts.block_size
    page = bs * kv_values_per_token(info) * _LOAD_DTYPE_BYTES[dtype]
    full_layers = info.n_layer - info.sliding_layers
    full_blocks = -(-max_model_len // bs)
    window_tokens = min(info.sliding_window - 1 + opts.max_num_batched_tokens, max_model_len)
    window_blocks = -(-window_tokens // bs) + 1 if info.sliding_layers else 0
    return page * (full_layers * full_blocks + info.sliding_layers * window_blocks)


def kv_cache_bytes(info: HfInfo, max_model_len: int, opts: HfKvOptions, dtype: str) -> int:
    """The budget for ``max_num_seqs`` sequences of ``max_model_len`` tokens."""
    return kv_bytes_per_seq(info, max_model_len, opts, dtype) * max(1, opts.max_num_seqs)


def null_page_bytes(info: HfInfo, opts: HfKvOptions, dtype: str) -> int:
    """The page of every layer that vLLM's block pool holds back for good (its
    null block): vLLM starts only if a full-length sequence fits beside it."""
    return opts.block_size * kv_values_per_token(info) * _LOAD_DTYPE_BYTES[dtype] * info.n_layer


def activation_bytes(info: HfInfo, opts: HfKvOptions) -> int:
    """An upper estimate of one step's activations (f32): per batched token the
    residual stream, Q/K/V and the MLP's gate and up rows; plus the logits of
    every sequence, and their softmax copy."""
    qkv = (info.n_head + 2 * info.n_head_kv) * info.head_dim
    per_token = 4 * info.hidden_size + qkv + 3 * max(info.intermediate_size, info.hidden_size)
    logits = 2 * max(1, opts.max_num_seqs) * info.vocab_size
    return 4 * (opts.max_num_batched_tokens * per_token + logits)


def mtp_draft(info: HfInfo) -> HfInfo:
    """A checkpoint's MTP layers as the draft model vLLM makes of them: full
    attention layers of the model's own shape, each with KV pages for every
    sequence and a page in the null block, and a step's activations of their
    own. No weights of their own: their tensors are in the checkpoint's bytes."""
    return msgspec.structs.replace(info, n_layer=info.mtp_layers, sliding_window=0, sliding_layers=0,
                                   parameter_bytes=0, dtype_bytes={}, mtp_layers=0)


def hf_need(info: HfInfo, max_model_len: int, opts: HfKvOptions, reserve_bytes: int,
            draft: HfInfo | None = None) -> Need:
    weights = kv = compute = 0
    for model in (info, draft) if draft is not None else (info,):
        dtype = load_dtype(model)
        weights += weight_bytes(model, dtype)
        kv += kv_cache_bytes(model, max_model_len, opts, dtype) + null_page_bytes(model, opts, dtype)
        compute += activation_bytes(model, opts)
    return Need(weights, kv, compute, weights + kv + compute + reserve_bytes)


def choose_hf_context(
    info: HfInfo,
    *,
    free_bytes: int,
    opts: HfKvOptions,
    requested: int | None = None,
    target: int | None = None,
    floor: int = 2048,
    reserve_bytes: int | None = None,
    memory_kind: str = "gpu",
    draft: HfInfo | None = None,
) -> ContextDecision:
    """The ``max_model_len`` to start vLLM with, or :class:`DoesNotFit`.

    As for GGUF models: an explicit ``requested`` length is used if it fits
    and refused otherwise; else ``target`` (default: the native context),
    capped at the native context, or the largest multiple of 256 that fits,
    never below ``floor``. ``reserve_bytes`` defaults to the runtime reserve
    of ``memory_kind``.
    """
    if requested is not None and requested < 1:
        raise BadRequest("context size must be at least 1", param="n_ctx")
    reserve = (HF_GPU_RESERVE if memory_kind == "gpu" else HF_CPU_RESERVE) if reserve_bytes is None else reserve_bytes
    native = info.context_length or target or 4096
    goal = min(target or native, native)

    def need(n_ctx: int) -> Need:
        return hf_need(info, n_ctx, opts, reserve, draft)

    def decide(n_ctx: int, reason: str) -> ContextDecision:
        return _decision(info, n_ctx, reason, need(n_ctx), requested, native, free_bytes, reserve,
                         memory_kind)

    if requested is not None:
        if need(requested).total <= free_bytes:
            return decide(requested, "the requested context fits")
        raise _refusal(need(requested), f"context {requested}", free_bytes, memory_kind)
    if need(goal).total <= free_bytes:
        return decide(goal, f"automatic context {goal} fits")
    lowest = min(floor, goal)
    best = _largest_fitting(need, lowest, goal, free_bytes)
    if best is None:
        raise _refusal(need(lowest), f"the minimum context {lowest}", free_bytes, memory_kind)
    return decide(best, f"context reduced from {goal} to {best} to fit {gib(free_bytes)} free"
                  f" {memory_kind} memory")


def plan_hf_load(info: HfInfo, *, requested: int | None, target_ctx: int, min_ctx: int,
                 free_bytes: int, memory_kind: str, slots: int, draft: HfInfo | None = None) -> ContextDecision:
    """The fit of a vLLM worker with ``slots`` sequences (and ``draft``
    drafting for it), as supervisor/models/placement.py asks it of every model."""
    native = info.context_length or target_ctx or 4096
    opts = HfKvOptions(max_num_seqs=max(1, slots), block_size=block_size(info, memory_kind))
    return choose_hf_context(info, free_bytes=free_bytes, opts=opts, requested=requested,
                             target=min(target_ctx or native, native) if requested is None else None,
                             floor=min(min_ctx, native), memory_kind=memory_kind, draft=draft)


def block_size(info: HfInfo, memory_kind: str) -> int:
    """The KV page (tokens) vLLM takes for ``info`` on ``memory_kind``."""
    if memory_kind == "gpu":
        return GPU_BLOCK_SIZE
    return CPU_MLA_BLOCK_SIZE if info.kv_latent_dim else CPU_BLOCK_SIZE


def _largest_fitting(need: Callable[[int], Need], lowest: int, highest: int, free_bytes: int) -> int | None:
    """The largest context in [lowest, highest] (a multiple of 256 or ``lowest``) that fits."""
    if need(lowest).total > free_bytes:
        return None
    lo, hi, best = align_up(lowest) // CTX_ALIGN, align_down(highest) // CTX_ALIGN, lowest
    while lo <= hi:  # the need grows with the context, so bisect
        mid = (lo + hi) // 2
        if need(mid * CTX_ALIGN).total <= free_bytes:
            best, lo = max(best, mid * CTX_ALIGN), mid + 1
        else:
            hi = mid - 1
    return best


def _refusal(need: Need, what: str, free_bytes: int, memory_kind: str) -> DoesNotFit:
    return DoesNotFit(
        f"{what} needs {gib(need.total)} ({gib(need.weights)} weights + {gib(need.kv)} KV cache"
        f" + {gib(need.compute)} activations + {gib(need.total - need.weights - need.kv - need.compute)}"
        f" reserve) but only {gib(free_bytes)} {memory_kind} memory is free",
        needed_bytes=need.total, free_bytes=free_bytes)


def _decision(info: HfInfo, n_ctx: int, reason: str, need: Need, requested: int | None, native: int,
              free_bytes: int, reserve: int, memory_kind: str) -> ContextDecision:
    dtype = load_dtype(info)
    where = "on the GPU" if memory_kind == "gpu" else "in RAM"
    return ContextDecision(
        n_ctx=n_ctx, automatic=requested is None, requested=requested, native_ctx=native,
        kv_bytes=need.kv, compute_bytes=need.compute, weight_bytes=need.weights,
        reserve_bytes=reserve, needed_bytes=need.total, free_bytes=free_bytes,
        memory_kind=memory_kind, cache_type_k=dtype, cache_type_v=dtype, reason=reason,
        n_layer=info.n_layer, layers_placed=info.n_layer,
        placement=f"all {info.n_layer} layers {where}")
