"""Where a model fits: free memory, the memory budget, the context and GPU layers.

The pool asks :func:`plan_load` before spawning a worker; a model whose
weights cannot fit is refused here, before any loading, with the sizes named.
On a GPU, a model too big for its free memory is planned with partial
offload: the last layers that fit on the GPU, the rest in RAM.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path

import msgspec

from supervisor.config import ModelSettings
from supervisor.errors import BadRequest
from supervisor.models.adapters import adapter_bytes
from supervisor.models.draft import (
    SpeculativePlan,
    draft_bytes,
    draft_outputs,
    hf_draft_info,
)
from supervisor.models.gguf_info import (
    GgufError,
    GgufInfo,
    TensorSizes,
    read_tensor_sizes,
)
from supervisor.models.hf_fit import plan_hf_load
from supervisor.models.kvsize import KvOptions, align_up
from supervisor.models.library import ModelEntry
from supervisor.models.memfit import ContextDecision, choose_context
from supervisor.models.memory import MemorySnapshot, free_memory
from supervisor.models.rope import cap_note, context_reach
from supervisor.models.slots import SlotAsk, with_slots

log = logging.getLogger("gpuvisor.placement")

# GPU memory a new worker takes beyond its buffers, which nvidia-smi still
# counted as free before it started: the CUDA context, cuBLAS workspaces and
# allocator rounding. A round figure, not a measurement; llama.cpp's own fit
# keeps a 1 GiB margin per device.
GPU_RUNTIME_RESERVE = 512 * 1024 * 1024

# A vision projector's compute buffers for encoding one image, beyond its
# weights (the file size). An estimate, not a measurement: the encoder's
# activations grow with its image size and width, a few hundred MiB for the
# common ones.
PROJECTOR_COMPUTE_ALLOWANCE = 256 * 1024 * 1024


def projector_bytes(entry: ModelEntry, embedding: bool = False) -> int:
    """What a generation worker's projector takes: its weights, loaded whole
    beside the model (never split by layer), plus the compute allowance.
    An estimate; zero without a linked projector or for an embedding worker."""
    if embedding or not entry.mmproj:
        return 0
    try:
        size = Path(entry.mmproj).stat().st_size
    except OSError as exc:
        # The worker reports the unreadable projector and serves text only.
        log.warning("%s: cannot size its projector %s: %s", entry.id, entry.mmproj, exc)
        return 0
    return size + PROJECTOR_COMPUTE_ALLOWANCE


async def measure_free(budget_bytes: int, committed: Iterable[int]) -> tuple[int, str]:
    """Free bytes for a new model and the memory kind (gpu or ram).

    With a budget, what loaded models were planned to use is subtracted from
    it, and the result is capped by what is really free.
    """
    snap: MemorySnapshot = await asyncio.to_thread(free_memory)
    free = snap.free_bytes
    if budget_bytes > 0:
        free = min(free, max(0, budget_bytes - sum(committed)))
    return free, snap.kind


def shard_tensor_sizes(entry: ModelEntry, info: GgufInfo) -> TensorSizes:
    """Per-layer sizes of the whole model: a shard set's further files hold
    layers too (the library reads only the first file's header).

    With a further shard unreadable the sizes are unknown, and the model is
    planned whole (the worker then reports what is wrong with the file).
    """
    sizes = info.tensors
    for path in entry.files[1:]:
        try:
            sizes = sizes.merged(read_tensor_sizes(Path(path), info.n_layer))
        except GgufError as exc:
            log.warning("%s: cannot size its layers, so it is not split between GPU and RAM: %s",
                        entry.id, exc)
            return TensorSizes()
    return sizes


def kv_options(settings: ModelSettings, *, slots: int, embedding: bool) -> KvOptions:
    """The engine settings a worker runs ``settings`` with, as memfit needs them."""
    cache = settings.cache_type or "f16"
    # The worker sets the engine to match: flash attention on, swa_full off,
    # a cache per slot for generation and one shared cache for embeddings.
    return KvOptions(cache_type_k=cache, cache_type_v=cache, flash_attn=True, slots=slots,
                     kv_unified=embedding, n_outputs=1 + draft_outputs(settings))


# The context of a model whose header names none, with n_ctx automatic.
FALLBACK_CTX = 4096


def plan_load(entry: ModelEntry, settings: ModelSettings, *, explicit_ctx: bool, target_ctx: int,
              min_ctx: int, free_bytes: int, memory_kind: str, slots: int = 1,
              embedding: bool = False, draft: SpeculativePlan | None = None,
              slot_ask: SlotAsk | None = None) -> ContextDecision | None:
    """The context, slots and GPU layers to load with, or None when the
    header is unreadable (the worker then fails to load it, exit code 3, and
    reports why).

    ``slot_ask`` (default: exactly ``slots``) says how many slots are
    planned with the context and how many an automatic count may grow to
    (supervisor/models/slots.py). An explicit n_ctx is capped at what a slot
    can reach (supervisor/models/rope.py), and the reason says so. Raises
    DoesNotFit (400) when nothing fits in ``free_bytes``. Reads the headers
    of a shard set's further files: call it in a thread.
    """
    ask = slot_ask or SlotAsk(slots, slots, explicit=True)
    requested = settings.n_ctx if explicit_ctx else None
    if entry.hf is not None:  # a vLLM worker (supervisor/models/hf_fit.py)
        if settings.rope_scaling == "yarn":
            raise BadRequest("rope_scaling applies to GGUF models (llama.cpp); this one runs in vLLM",
                             param="rope_scaling")
        hf = plan_hf_load(entry.hf, requested=requested, target_ctx=target_ctx, min_ctx=min_ctx,
                          free_bytes=free_bytes, memory_kind=memory_kind, slots=ask.base,
                          draft=hf_draft_info(entry, draft))
        return msgspec.structs.replace(hf, slots=ask.base, slots_reason=f"parallel {ask.base}")
    info = entry.info
    if info is None:
        return None
    reach = context_reach(settings, native=info.context_length, header_orig=info.rope_orig_ctx,
                          requested=requested)
    native = reach.limit or target_ctx or FALLBACK_CTX
    sizes = shard_tensor_sizes(entry, info)

    def plan(n_slots: int, n_ctx: int | None) -> ContextDecision:
        return choose_context(
            info,
            weight_bytes=entry.size_bytes,
            free_bytes=free_bytes,
            requested=n_ctx,
            target=min(target_ctx or native, native) if n_ctx is None else None,
            floor=min(min_ctx, native),
            opts=kv_options(settings, slots=n_slots, embedding=embedding),
            # The projector is one fixed block, held back like the runtime's own.
            reserve_bytes=(GPU_RUNTIME_RESERVE if memory_kind == "gpu" else 0) + projector_bytes(entry, embedding)
            # A draft model's weights and KV, sized for the largest context this plan may choose.
            + draft_bytes(entry, draft, n_ctx=n_ctx or min(target_ctx or native, native), slots=n_slots)
            # The LoRA adapters its worker holds (supervisor/models/adapters.py).
            + (0 if embedding else adapter_bytes(entry.adapters)),
            memory_kind=memory_kind,
            n_gpu_layers=settings.n_gpu_layers if settings.n_gpu_layers is not None else -1,
            tensors=sizes,
        )

    decision = plan(ask.base, min(requested, reach.limit or requested) if requested is not None else None)
    notes = [reach.note, cap_note(requested, reach) if requested is not None else "", decision.reason]
    decision = msgspec.structs.replace(
        decision, n_ctx=served_context(decision.n_ctx, reach.limit), requested=requested,
        reason="; ".join(n for n in notes if n),
        max_ctx=reach.limit, rope_scaling=reach.rope_scaling, rope_scale=reach.rope_scale,
        yarn_orig_ctx=reach.yarn_orig_ctx)
    return with_slots(decision, ask, plan)


def served_context(n_ctx: int, limit: int) -> int:
    """The context a slot of ``n_ctx`` gets: the engine pads it to a whole
    256 cells (memfit costs those cells already), then caps it at ``limit``."""
    padded = align_up(n_ctx)
    return min(padded, limit) if limit > 0 else padded
