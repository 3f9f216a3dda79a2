"""Will a model fit, and with how much context?

Byte arithmetic over a :class:`~supervisor.models.gguf_info.GgufInfo`, mirroring how
llama.cpp sizes a context's memory:

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

:func:`choose_context` turns that into a decision the API reports, or a typed
:class:`DoesNotFit` refusal naming the sizes. On a GPU a model that does not
fit whole is split: its last layers on the GPU, the rest in RAM, sized from
the per-layer tensor bytes of the header. :func:`free_memory` reads free
GPU memory from ``nvidia-smi`` (respecting ``CUDA_VISIBLE_DEVICES``), else
system RAM. It blocks for up to a few seconds: call it in a thread.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping
from typing import Literal, NamedTuple

import msgspec
import psutil

from supervisor.errors import BadRequest
from supervisor.models.gguf_info import GgufInfo, TensorSizes

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
_MIB = 1024 * 1024
_SMI_QUERY = "--query-gpu=index,uuid,memory.free,memory.total"


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


class DeviceMemory(msgspec.Struct, frozen=True):
    index: int
    uuid: str
    free_bytes: int
    total_bytes: int


class MemorySnapshot(msgspec.Struct, frozen=True, kw_only=True):
    kind: Literal["gpu", "ram"]
    free_bytes: int
    total_bytes: int
    devices: list[DeviceMemory] = []
    note: str | None = None  # why GPU memory was not used, when it was looked for


def align_up(n: int, to: int = CTX_ALIGN) -> int:
    return -(-n // to) * to


def align_down(n: int, to: int = CTX_ALIGN) -> int:
    return n // to * to


def gib(n: int) -> str:
    return f"{n / (1024**3):.2f} GiB"


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

    def decide(n_ctx: int, reason: str, need: Need, layers: int, engine_layers: int,
               placement: str) -> ContextDecision:
        return ContextDecision(
            n_ctx=n_ctx,
            automatic=requested is None,
            requested=requested,
            native_ctx=native,
            kv_bytes=need.kv,
            compute_bytes=need.compute,
            weight_bytes=need.weights,
            reserve_bytes=reserve_bytes,
            needed_bytes=need.total,
            free_bytes=free_bytes,
            memory_kind=memory_kind,
            cache_type_k=opts.cache_type_k,
            cache_type_v=opts.cache_type_v,
            reason=reason,
            n_layer=n_layer,
            layers_placed=layers,
            n_gpu_layers=engine_layers,
            n_gpu_layers_asked=n_gpu_layers,
            placement=placement,
            host_bytes=need.host,
        )

    if fixed:
        def need(n_ctx: int) -> Need:
            return model.offloaded(n_ctx, n_gpu_layers)

        layers = max(0, n_gpu_layers - 1)
        placement = (
            f"{layers} of {n_layer} layers on the GPU, as configured (n_gpu_layers {n_gpu_layers})"
        )
    else:
        need, layers = model.full, n_layer
        placement = f"all {n_layer} layers on the GPU" if on_gpu else f"all {n_layer} layers in RAM"
    fitted = _fits(need, requested, goal, lowest, free_bytes, memory_kind)
    if fitted is not None:
        n_ctx, reason = fitted
        return decide(n_ctx, reason, need(n_ctx), layers, n_gpu_layers, placement)
    partial_tried = on_gpu and not fixed and n_gpu_layers < 0 and model.splittable
    if partial_tried:
        contexts = [requested] if requested is not None else sorted({goal, lowest}, reverse=True)
        found = _most_layers(model, contexts, free_bytes)
        if found is not None:
            n_ctx, layers = found
            what = "the requested context" if requested is not None else f"context {n_ctx}"
            return decide(
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


def visible_devices(environ: Mapping[str, str]) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of entries; None when unset (all visible)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    out: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        # CUDA stops enumerating at the first invalid entry (e.g. -1).
        if not part or part.startswith("-"):
            break
        out.append(part)
    return out


def parse_smi(output: str) -> list[DeviceMemory]:
    devices = []
    for line in output.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            raise ValueError(f"unexpected nvidia-smi line: {line!r}")
        index, uuid, free, total = fields
        devices.append(DeviceMemory(int(index), uuid, int(free) * _MIB, int(total) * _MIB))
    return devices


def _select(devices: list[DeviceMemory], wanted: list[str] | None) -> list[DeviceMemory]:
    if wanted is None:
        return devices
    chosen = []
    for entry in wanted:
        match = [d for d in devices if str(d.index) == entry or d.uuid.startswith(entry)]
        if not match:
            break  # CUDA ignores everything after an unknown device
        chosen.append(match[0])
    return chosen


def run_nvidia_smi() -> str:
    """nvidia-smi's memory query output; raises OSError / CalledProcessError."""
    done = subprocess.run(
        ["nvidia-smi", _SMI_QUERY, "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    return done.stdout


def free_memory(
    environ: Mapping[str, str] | None = None, smi: Callable[[], str] = run_nvidia_smi
) -> MemorySnapshot:
    """Free memory of the visible GPUs, or of system RAM when there is none."""
    environ = os.environ if environ is None else environ
    wanted = visible_devices(environ)
    note: str | None = None
    if wanted == []:
        note = "CUDA_VISIBLE_DEVICES hides every GPU"
    else:
        try:
            devices = _select(parse_smi(smi()), wanted)
        except FileNotFoundError:
            note = "nvidia-smi not found"
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            note = f"nvidia-smi failed: {exc}"
        else:
            if devices:
                return MemorySnapshot(
                    kind="gpu",
                    devices=devices,
                    free_bytes=sum(d.free_bytes for d in devices),
                    total_bytes=sum(d.total_bytes for d in devices),
                )
            note = "no visible GPU"
    vm = psutil.virtual_memory()
    return MemorySnapshot(
        kind="ram", free_bytes=int(vm.available), total_bytes=int(vm.total), note=note
    )
