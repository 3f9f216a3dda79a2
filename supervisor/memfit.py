"""Will a model fit, and with how much context?

Byte arithmetic over a :class:`~supervisor.gguf_info.GgufInfo`, mirroring how
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

:func:`choose_context` turns that into a decision the API reports, or a typed
:class:`DoesNotFit` refusal naming the sizes. :func:`free_memory` reads free
GPU memory from ``nvidia-smi`` (respecting ``CUDA_VISIBLE_DEVICES``), else
system RAM. It blocks for up to a few seconds: call it in a thread.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping
from typing import Literal

import msgspec
import psutil

from supervisor.errors import BadRequest
from supervisor.gguf_info import GgufInfo

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
    n_seq: int = 1
    n_ubatch: int = 512
    # Engine slots, each with its own cache of n_ctx cells (not unified).
    slots: int = 1


class KvEstimate(msgspec.Struct, frozen=True, kw_only=True):
    n_cells: int  # context cells of full-attention layers (n_ctx rounded up to 256)
    n_cells_swa: int  # cells of sliding-window layers
    k_bytes: int
    v_bytes: int
    recurrent_bytes: int

    @property
    def total(self) -> int:
        return self.k_bytes + self.v_bytes + self.recurrent_bytes


class ContextDecision(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`choose_context` decided and why; reported by the API."""

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


def kv_cache_bytes(info: GgufInfo, n_ctx: int, opts: KvOptions | None = None) -> KvEstimate:
    """KV cache plus recurrent state of ``info`` at a context of ``n_ctx``."""
    opts = opts or KvOptions()
    n_cells = align_up(max(n_ctx, 1))
    n_cells_swa = n_cells
    if info.sliding_window > 0 and not opts.swa_full:
        window = info.sliding_window * opts.n_seq + opts.n_ubatch
        n_cells_swa = align_up(min(n_cells, window))
    v_pad = 0
    if not opts.flash_attn:
        v_pad = max(
            (_head_dims(info, il)[1] * h for il, h in enumerate(info.n_head_kv_per_layer)),
            default=0,
        )
    k_bytes = v_bytes = 0
    for il in range(info.n_layer):
        if not info.attention_layers[il]:
            continue
        cells = n_cells_swa if info.swa_layers[il] else n_cells
        head_k, head_v = _head_dims(info, il)
        n_kv = info.n_head_kv_per_layer[il]
        k_bytes += row_bytes(opts.cache_type_k, head_k * n_kv) * cells
        if info.is_mla:
            continue  # the latent in K serves as V
        v_width = v_pad if v_pad else head_v * n_kv
        v_bytes += row_bytes(opts.cache_type_v, v_width) * cells
    n_recurrent = sum(info.recurrent_layers)
    recurrent = n_recurrent * recurrent_state_values(info) * 4 * max(opts.n_seq, 1)
    slots = max(1, opts.slots)
    return KvEstimate(
        n_cells=n_cells,
        n_cells_swa=n_cells_swa,
        k_bytes=k_bytes * slots,
        v_bytes=v_bytes * slots,
        recurrent_bytes=recurrent * slots,
    )


def compute_buffer_bytes(info: GgufInfo, n_ctx: int, opts: KvOptions | None = None) -> int:
    """A rough upper estimate of llama.cpp's compute buffer for one ubatch.

    Logits and activations for ``n_ubatch`` tokens; without flash attention
    also one layer's f32 attention scores over the whole context.
    """
    opts = opts or KvOptions()
    n_ff = max(info.n_ff_per_layer, default=0)
    acts = opts.n_ubatch * 4 * (info.n_vocab + 4 * info.n_embd + 2 * n_ff)
    scores = 0 if opts.flash_attn else info.n_head * align_up(n_ctx) * opts.n_ubatch * 4
    return acts + scores


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
) -> ContextDecision:
    """Pick the context size to load ``info`` with, or raise :class:`DoesNotFit`.

    ``requested`` (explicit) is used if it fits and refused otherwise. With no
    request the context is automatic: ``target`` (default: the native context),
    capped at the native context, or else the largest multiple of 256 that
    fits, never below ``floor``. ``reserve_bytes`` is held back for the
    runtime (driver context, fragmentation).
    """
    opts = opts or KvOptions()
    native = info.context_length
    fixed = weight_bytes + reserve_bytes

    def needed(n_ctx: int) -> tuple[int, int, int]:
        kv = kv_cache_bytes(info, n_ctx, opts).total
        compute = compute_buffer_bytes(info, n_ctx, opts)
        return kv, compute, fixed + kv + compute

    def decide(n_ctx: int, reason: str) -> ContextDecision:
        kv, compute, total = needed(n_ctx)
        return ContextDecision(
            n_ctx=n_ctx,
            automatic=requested is None,
            requested=requested,
            native_ctx=native,
            kv_bytes=kv,
            compute_bytes=compute,
            weight_bytes=weight_bytes,
            reserve_bytes=reserve_bytes,
            needed_bytes=total,
            free_bytes=free_bytes,
            memory_kind=memory_kind,
            cache_type_k=opts.cache_type_k,
            cache_type_v=opts.cache_type_v,
            reason=reason,
        )

    if requested is not None:
        if requested < 1:
            raise BadRequest("context size must be at least 1", param="n_ctx")
        kv, compute, total = needed(requested)
        if total <= free_bytes:
            return decide(requested, "the requested context fits")
        best = _largest_fitting(needed, CTX_ALIGN, align_down(requested), free_bytes)
        hint = f"; the largest context that fits is {best}" if best else ""
        raise DoesNotFit(
            f"context {requested} needs {gib(total)} ({gib(weight_bytes)} weights"
            f" + {gib(kv)} KV cache"
            f" + {gib(compute)} compute + {gib(reserve_bytes)} reserve) but only {gib(free_bytes)}"
            f" {memory_kind} memory is free{hint}",
            needed_bytes=total,
            free_bytes=free_bytes,
        )
    goal = min(target or native or 4096, native or target or 4096)
    lowest = min(floor, goal)
    kv, compute, total = needed(goal)
    if total <= free_bytes:
        return decide(goal, f"automatic context {goal} fits")
    best = _largest_fitting(needed, lowest, goal, free_bytes)
    if best is not None:
        return decide(
            best,
            f"context reduced from {goal} to {best} to fit {gib(free_bytes)} free"
            f" {memory_kind} memory",
        )
    kv, compute, total = needed(lowest)
    what = (
        "the weights alone"
        if fixed > free_bytes
        else f"the weights with the minimum context {lowest}"
    )
    raise DoesNotFit(
        f"{what} need {gib(total if fixed <= free_bytes else fixed)} ({gib(weight_bytes)} weights"
        f" + {gib(kv)} KV cache + {gib(compute)} compute + {gib(reserve_bytes)} reserve)"
        f" but only {gib(free_bytes)} {memory_kind} memory is free",
        needed_bytes=total,
        free_bytes=free_bytes,
    )


def _largest_fitting(
    needed: Callable[[int], tuple[int, int, int]], lowest: int, highest: int, free_bytes: int
) -> int | None:
    """The largest context in [lowest, highest] (a multiple of 256 or ``lowest``) that fits."""
    if highest < lowest or needed(lowest)[2] > free_bytes:
        return None
    lo, hi = align_up(lowest) // CTX_ALIGN, align_down(highest) // CTX_ALIGN
    best = lowest
    while lo <= hi:  # the need grows with the context, so bisect
        mid = (lo + hi) // 2
        if needed(mid * CTX_ALIGN)[2] <= free_bytes:
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
