"""Will a model fit, and with how much context?

:func:`choose_context` weighs the weights, the KV cache and the compute
buffer (sized in :mod:`supervisor.models.kvsize`) against free memory (read
by :mod:`supervisor.models.memory`) and returns a decision the API reports,
or a typed :class:`DoesNotFit` refusal naming the sizes. On a GPU a model that
does not fit whole is split: its last layers on the GPU, the rest in RAM,
sized from the per-layer tensor bytes of the header.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import msgspec

from supervisor.errors import BadRequest
from supervisor.models.gguf_info import GgufInfo, TensorSizes
from supervisor.models.kvsize import (
    CTX_ALIGN,
    KvOptions,
    align_down,
    align_up,
    compute_buffer_bytes,
    kv_layer_bytes,
)


class ContextDecision(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`choose_context` decided and why; reported by the API.

    Sizes are those in ``memory_kind`` memory: with partial offload the GPU
    share, and ``host_bytes`` what stays in RAM.
    """

    n_ctx: int
    automatic: bool
    requested: int | None
    native_ctx: int
    kv_bytes: int
    compute_bytes: int
    weight_bytes: int
    reserve_bytes: int
    needed_bytes: int
    free_bytes: int
    memory_kind: str
    cache_type_k: str
    cache_type_v: str
    reason: str
    n_layer: int = 0
    # Repeating layers held in ``memory_kind`` memory: on a GPU the ones
    # offloaded, in RAM (no GPU) all of them.
    layers_placed: int = 0
    # What the engine is given (llama.cpp's count, the output head included;
    # -1 = all), and the configured value it was planned from.
    n_gpu_layers: int = -1
    n_gpu_layers_asked: int = -1
    placement: str = ""  # why that many layers
    host_bytes: int = 0  # weights and KV cache that partial offload leaves in RAM
    # The most context a slot can get (the native context, or what RoPE
    # scaling reaches; 0 = not capped), and the scaling the engine is given.
    max_ctx: int = 0
    rope_scaling: str = "none"
    rope_scale: float = 0.0
    yarn_orig_ctx: int = 0
    # Engine slots, each with a KV cache of n_ctx (costed above), and why that many.
    slots: int = 1
    slots_reason: str = ""

    @property
    def partial_offload(self) -> bool:
        """Fewer layers on the GPU than were asked for, because memory was short."""
        return self.n_gpu_layers != self.n_gpu_layers_asked


class DoesNotFit(BadRequest):
    """The model (or the requested context) cannot fit in the free memory."""

    code = "model_does_not_fit"

    def __init__(self, message: str, *, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(message, param="n_ctx")
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes



def gib(n: int) -> str:
    return f"{n / (1024**3):.2f} GiB"



class Need(NamedTuple):
    """Bytes one placement needs in the fitted memory, and what stays in RAM."""

    weights: int
    kv: int
    compute: int
    total: int  # weights + kv + compute + reserve
    host: int = 0


class _Model:
    """The memory a model needs for a context, fully or partly offloaded.

    llama.cpp offloads the last layers first, and its ``n_gpu_layers``
    counts the output head as one more layer: ``n`` puts the head and the
    last ``n - 1`` repeating layers on the GPU; the token embeddings always
    stay in RAM.
    """

    def __init__(self, info: GgufInfo, weight_bytes: int, reserve_bytes: int,
                 opts: KvOptions, tensors: TensorSizes) -> None:
        self.info = info
        self.weight_bytes = weight_bytes
        self.reserve_bytes = reserve_bytes
        self.opts = opts
        self.tensors = tensors
        self._kv: dict[int, list[int]] = {}

    @property
    def splittable(self) -> bool:
        """Whether the header says what each layer weighs."""
        sizes = self.tensors.layer_bytes
        return len(sizes) == self.info.n_layer > 1 and all(b > 0 for b in sizes)

    def kv_layers(self, n_ctx: int) -> list[int]:
        if n_ctx not in self._kv:
            self._kv[n_ctx] = kv_layer_bytes(self.info, n_ctx, self.opts)
        return self._kv[n_ctx]

    def full(self, n_ctx: int) -> Need:
        """Everything in one memory. The weights are the file sizes: a little
        more than the tensors (the token embeddings stay in RAM on a GPU)."""
        kv = sum(self.kv_layers(n_ctx))
        compute = compute_buffer_bytes(self.info, n_ctx, self.opts)
        total = self.weight_bytes + kv + compute + self.reserve_bytes
        return Need(self.weight_bytes, kv, compute, total)

    def offloaded(self, n_ctx: int, n_gpu_layers: int) -> Need:
        """GPU bytes with llama.cpp's ``n_gpu_layers`` (0..n_layer) offloaded."""
        t, kv_layers = self.tensors, self.kv_layers(n_ctx)
        first = self.info.n_layer - max(0, n_gpu_layers - 1)  # first layer on the GPU
        head = t.output_device_bytes if n_gpu_layers > 0 else 0
        weights = sum(t.layer_bytes[first:]) + head
        kv = sum(kv_layers[first:])
        # For a prompt's batch the engine copies the weights of CPU layers to
        # the GPU to multiply there: room for one layer of them.
        compute = compute_buffer_bytes(self.info, n_ctx, self.opts) + max(
            t.layer_bytes[:first], default=0
        )
        # A tied head is a copy: the token embeddings stay in RAM as well.
        host = t.total - sum(t.layer_bytes[first:]) - (t.output_bytes if head else 0)
        host += sum(kv_layers[:first])
        return Need(weights, kv, compute, weights + kv + compute + self.reserve_bytes, host)


def _fits(need: Callable[[int], Need], requested: int | None, goal: int, lowest: int,
          free_bytes: int, memory_kind: str) -> tuple[int, str] | None:
    """The context to load with and why, or None when none fits."""
    if requested is not None:
        if need(requested).total <= free_bytes:
            return requested, "the requested context fits"
        return None
    if need(goal).total <= free_bytes:
        return goal, f"automatic context {goal} fits"
    best = _largest_fitting(need, lowest, goal, free_bytes)
    if best is None:
        return None
    return best, (
        f"context reduced from {goal} to {best} to fit {gib(free_bytes)} free {memory_kind} memory"
    )


def _most_layers(model: _Model, contexts: list[int], free_bytes: int) -> tuple[int, int] | None:
    """(context, repeating layers on the GPU) of the partial offload that
    puts the most layers on the GPU at the first context that takes one."""
    for n_ctx in contexts:
        for layers in range(model.info.n_layer - 1, 0, -1):
            if model.offloaded(n_ctx, layers + 1).total <= free_bytes:
                return n_ctx, layers
    return None


def _over(need: Need, reserve_bytes: int, free_bytes: int) -> str:
    """Why the whole model does not fit, in a few words."""
    reserve = f" + {gib(reserve_bytes)} reserve" if reserve_bytes else ""
    if need.weights + reserve_bytes > free_bytes:
        return f"weights {gib(need.weights)}{reserve} > {gib(free_bytes)} free"
    return (
        f"weights {gib(need.weights)} + KV cache {gib(need.kv)} + compute {gib(need.compute)}"
        f"{reserve} = {gib(need.total)} > {gib(free_bytes)} free"
    )


def choose_context(
    info: GgufInfo,
    *,
    weight_bytes: int,
    free_bytes: int,
    requested: int | None = None,
    target: int | None = None,
    floor: int = 2048,
    opts: KvOptions | None = None,
    reserve_bytes: int = 0,
    memory_kind: str = "gpu",
    n_gpu_layers: int = -1,
    tensors: TensorSizes | None = None,
) -> ContextDecision:
    """Pick the context size (and GPU layers) to load ``info`` with, or raise
    :class:`DoesNotFit`.

    ``requested`` (explicit) is used if it fits and refused otherwise. With no
    request the context is automatic: ``target`` (default: the native context),
    capped at the native context, or else the largest multiple of 256 that
    fits, never below ``floor``. ``reserve_bytes`` is held back for the
    runtime (driver context, fragmentation).

    On a GPU, ``n_gpu_layers`` is llama.cpp's count: 0..n_layer places that
    many (the output head counted as one), and is costed as such; larger
    means all. With -1 (all, the default) and the model too big even at the
    smallest context, the most layers that fit go to the GPU (at the
    requested, else the automatic context, else ``floor``) and the rest stay
    in RAM. ``tensors`` (default: the header's) are the per-layer sizes;
    without them the model is refused as a whole.
    """
    opts = opts or KvOptions()
    if requested is not None and requested < 1:
        raise BadRequest("context size must be at least 1", param="n_ctx")
    model = _Model(info, weight_bytes, reserve_bytes, opts, tensors or info.tensors)
    native, n_layer = info.context_length, info.n_layer
    goal = min(target or native or 4096, native or target or 4096)
    lowest = min(floor, goal)
    on_gpu = memory_kind == "gpu"
    fixed = on_gpu and 0 <= n_gpu_layers <= n_layer and model.splittable
    ask = _Ask(requested, native, free_bytes, reserve_bytes, memory_kind, opts, n_layer, n_gpu_layers)
    need, layers, placement = _placement(model, n_layer, n_gpu_layers, on_gpu, fixed)
    fitted = _fits(need, requested, goal, lowest, free_bytes, memory_kind)
    if fitted is not None:
        n_ctx, reason = fitted
        return _decision(ask, n_ctx, reason, need(n_ctx), layers, n_gpu_layers, placement)
    partial_tried = on_gpu and not fixed and n_gpu_layers < 0 and model.splittable
    if partial_tried:
        contexts = [requested] if requested is not None else sorted({goal, lowest}, reverse=True)
        found = _most_layers(model, contexts, free_bytes)
        if found is not None:
            n_ctx, layers = found
            what = "the requested context" if requested is not None else f"context {n_ctx}"
            return _decision(
                ask,
                n_ctx,
                f"{what} with partial offload",
                model.offloaded(n_ctx, layers + 1),
                layers,
                layers + 1,
                f"{layers} of {n_layer} layers on the GPU: "
                + _over(model.full(n_ctx), reserve_bytes, free_bytes),
            )
    raise _refusal(need, requested=requested, lowest=lowest, free_bytes=free_bytes,
                   memory_kind=memory_kind, weight_bytes=need(lowest).weights,
                   reserve_bytes=reserve_bytes,
                   partial=f"; not even one of the {n_layer} layers fits on the GPU with the"
                   " rest in RAM" if partial_tried else "")


class _Ask(NamedTuple):
    """What a :func:`choose_context` call was asked, as its decision reports it."""

    requested: int | None
    native: int
    free_bytes: int
    reserve_bytes: int
    memory_kind: str
    opts: KvOptions
    n_layer: int
    n_gpu_layers: int


def _placement(model: _Model, n_layer: int, n_gpu_layers: int, on_gpu: bool,
               fixed: bool) -> tuple[Callable[[int], Need], int, str]:
    """(bytes needed per context, layers on the GPU, how they are placed) before any split."""
    if fixed:
        def need(n_ctx: int) -> Need:
            return model.offloaded(n_ctx, n_gpu_layers)

        layers = max(0, n_gpu_layers - 1)
        return need, layers, (
            f"{layers} of {n_layer} layers on the GPU, as configured (n_gpu_layers {n_gpu_layers})")
    placement = f"all {n_layer} layers on the GPU" if on_gpu else f"all {n_layer} layers in RAM"
    return model.full, n_layer, placement


def _decision(ask: _Ask, n_ctx: int, reason: str, need: Need, layers: int, engine_layers: int,
              placement: str) -> ContextDecision:
    return ContextDecision(
        n_ctx=n_ctx,
        automatic=ask.requested is None,
        requested=ask.requested,
        native_ctx=ask.native,
        kv_bytes=need.kv,
        compute_bytes=need.compute,
        weight_bytes=need.weights,
        reserve_bytes=ask.reserve_bytes,
        needed_bytes=need.total,
        free_bytes=ask.free_bytes,
        memory_kind=ask.memory_kind,
        cache_type_k=ask.opts.cache_type_k,
        cache_type_v=ask.opts.cache_type_v,
        reason=reason,
        n_layer=ask.n_layer,
        layers_placed=layers,
        n_gpu_layers=engine_layers,
        n_gpu_layers_asked=ask.n_gpu_layers,
        placement=placement,
        host_bytes=need.host,
        slots=max(1, ask.opts.slots),
    )


def _refusal(need: Callable[[int], Need], *, requested: int | None, lowest: int,
             free_bytes: int, memory_kind: str, weight_bytes: int, reserve_bytes: int,
             partial: str) -> DoesNotFit:
    """The refusal naming the sizes of the smallest load that was tried."""
    if requested is not None:
        asked = need(requested)
        best = _largest_fitting(need, CTX_ALIGN, align_down(requested), free_bytes)
        hint = f"; the largest context that fits is {best}" if best else ""
        return DoesNotFit(
            f"context {requested} needs {gib(asked.total)} ({gib(asked.weights)} weights"
            f" + {gib(asked.kv)} KV cache"
            f" + {gib(asked.compute)} compute + {gib(reserve_bytes)} reserve) but only"
            f" {gib(free_bytes)} {memory_kind} memory is free{hint}{partial}",
            needed_bytes=asked.total,
            free_bytes=free_bytes,
        )
    least = need(lowest)
    fixed = weight_bytes + reserve_bytes
    what = (
        "the weights alone"
        if fixed > free_bytes
        else f"the weights with the minimum context {lowest}"
    )
    return DoesNotFit(
        f"{what} need {gib(least.total if fixed <= free_bytes else fixed)}"
        f" ({gib(weight_bytes)} weights + {gib(least.kv)} KV cache + {gib(least.compute)} compute"
        f" + {gib(reserve_bytes)} reserve) but only {gib(free_bytes)} {memory_kind} memory"
        f" is free{partial}",
        needed_bytes=least.total,
        free_bytes=free_bytes,
    )


def _largest_fitting(
    need: Callable[[int], Need], lowest: int, highest: int, free_bytes: int
) -> int | None:
    """The largest context in [lowest, highest] (a multiple of 256 or ``lowest``) that fits."""
    if highest < lowest or need(lowest).total > free_bytes:
        return None
    lo, hi = align_up(lowest) // CTX_ALIGN, align_down(highest) // CTX_ALIGN
    best = lowest
    while lo <= hi:  # the need grows with the context, so bisect
        mid = (lo + hi) // 2
        if need(mid * CTX_ALIGN).total <= free_bytes:
            best, lo = max(best, mid * CTX_ALIGN), mid + 1
        else:
            hi = mid - 1
    return best
