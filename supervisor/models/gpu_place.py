"""Which GPUs a model goes on: one, the fewest that fit together, or partial offload.

:func:`place` decides from per-GPU readings and a ``plan`` callback (the
memory fit of :func:`supervisor.models.placement.plan_load` for a given
amount of free memory):

- the one GPU with the most free memory, if the model fits there with the
  headroom (a share of its free memory kept back) and the same context it
  would get on every GPU;
- else the fewest GPUs (most free first) that fit together, with a tensor
  split in proportion to their free memory;
- else every GPU, with the layers that do not fit left on the CPU.

Every GPU a worker uses holds its own runtime (CUDA context, workspaces):
each GPU beyond the first costs one more runtime reserve.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import msgspec

from supervisor.models.devices import GpuReading
from supervisor.models.gpu_reading import node_device
from supervisor.models.memfit import ContextDecision, DoesNotFit

DEFAULT_HEADROOM = 0.10
PlacementMode = Literal["cpu", "single", "split", "offload"]
# plan(free_bytes) -> the fit in that much memory; raises DoesNotFit.
Plan = Callable[[int], ContextDecision | None]


class GpuPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """The decision, with the numbers it was made from (shown in /api/models)."""

    mode: PlacementMode
    devices: list[str]  # lease device ids
    indices: list[int] = []  # GPU indices: the worker's CUDA_VISIBLE_DEVICES
    free_bytes: list[int] = []  # per chosen GPU, as read before the load
    usable_bytes: int = 0  # what the memory fit was given (headroom and reserves off)
    tensor_split: list[float] = []  # per chosen GPU; empty on one GPU
    headroom: float = DEFAULT_HEADROOM
    reason: str = ""
    node: str = ""  # the cluster node it runs on ("" = this machine)


def cpu_placement(reason: str = "no GPU: the model runs in RAM") -> GpuPlacement:
    return GpuPlacement(mode="cpu", devices=["cpu"], headroom=0.0, reason=reason)


def usable_bytes(readings: Sequence[GpuReading], headroom: float, extra_reserve: int) -> int:
    """Free memory of ``readings`` less the headroom on each, less one more
    runtime reserve per GPU beyond the first."""
    total = sum(int(r.free_bytes * (1.0 - headroom)) for r in readings)
    return max(0, total - extra_reserve * (len(readings) - 1))


def tensor_split(readings: Sequence[GpuReading]) -> list[float]:
    """Shares of the layers in proportion to free memory (empty for one GPU)."""
    if len(readings) < 2:
        return []
    total = sum(r.free_bytes for r in readings) or 1
    return [round(r.free_bytes / total, 4) for r in readings]


def _most_free_first(readings: Sequence[GpuReading]) -> list[GpuReading]:
    return sorted(readings, key=lambda r: (-r.free_bytes, r.index))


def _placement(mode: PlacementMode, chosen: Sequence[GpuReading], usable: int, headroom: float,
               reason: str) -> GpuPlacement:
    return GpuPlacement(mode=mode, devices=[r.device_id for r in chosen],
                        indices=[r.index for r in chosen],
                        free_bytes=[r.free_bytes for r in chosen], usable_bytes=usable,
                        tensor_split=tensor_split(chosen), headroom=headroom, reason=reason,
                        node=chosen[0].node if chosen else "")


def _fits(decision: ContextDecision | None, best: ContextDecision | None) -> bool:
    if decision is None or best is None:
        return True  # unknown sizes: nothing to compare, the worker reports the file
    return not decision.partial_offload and decision.n_ctx >= best.n_ctx


def place(readings: Sequence[GpuReading], *, headroom: float, extra_reserve: int,
          plan: Plan) -> tuple[GpuPlacement, ContextDecision | None]:
    """The GPUs to load on and the fit there; DoesNotFit when not even all of
    them with the CPU can hold it. ``readings`` must not be empty."""
    if not readings:
        raise ValueError("place() needs at least one GPU reading")
    ordered = _most_free_first(readings)
    every = usable_bytes(ordered, headroom, extra_reserve)
    best = plan(every)  # raises DoesNotFit: then nothing here can help
    if best is not None and best.partial_offload:
        return (_placement("offload", ordered, every, headroom,
                           f"does not fit on the {len(ordered)} GPU(s) with {headroom:.0%} headroom: "
                           "layers that do not fit stay in RAM"), best)
    for k in range(1, len(ordered)):
        chosen = ordered[:k]
        usable = usable_bytes(chosen, headroom, extra_reserve)
        try:
            decision = plan(usable)
        except DoesNotFit:
            continue
        if _fits(decision, best):
            mode: PlacementMode = "single" if k == 1 else "split"
            why = (f"fits on {chosen[0].device_id}, the GPU with the most free memory, "
                   f"with {headroom:.0%} headroom" if k == 1 else
                   f"fits on the {k} GPUs with the most free memory, split by free memory")
            return _placement(mode, chosen, usable, headroom, why), decision
    mode = "single" if len(ordered) == 1 else "split"
    why = (f"fits on {ordered[0].device_id} with {headroom:.0%} headroom" if len(ordered) == 1
           else f"needs all {len(ordered)} GPUs, split by free memory")
    return _placement(mode, ordered, every, headroom, why), best


# Better placements first: on whole GPUs, then split, then with layers in RAM.
_MODE_RANK: dict[str, int] = {"single": 0, "split": 1, "offload": 2, "cpu": 3}


def place_on_nodes(readings: Sequence[GpuReading], *, headroom: float, extra_reserve: int,
                   plan: Plan, ram: Mapping[str, int] | None = None,
                   ram_plan: Plan | None = None) -> tuple[GpuPlacement, ContextDecision | None]:
    """:func:`place` on each node's GPUs alone, and the best of them: a
    llama.cpp worker runs on one machine, never split across machines.
    ``ram``: the free RAM of nodes without a GPU, where ``ram_plan`` fits the
    model in RAM (device ``node/cpu``).

    Best: whole GPUs before a split before partial offload before RAM, then
    the larger context, then the most free memory on the GPUs chosen.
    DoesNotFit when it fits on no node (the last node's reason)."""
    nodes: dict[str, list[GpuReading]] = {}
    for r in readings:
        nodes.setdefault(r.node, []).append(r)
    ram = dict(ram or {}) if ram_plan is not None else {}
    if not nodes and not ram:
        raise ValueError("place_on_nodes() needs at least one node")
    found: list[tuple[tuple[int, int, int], GpuPlacement, ContextDecision | None]] = []
    refusal: DoesNotFit | None = None
    for node, ours in nodes.items():
        try:
            placed, decision = place(ours, headroom=headroom, extra_reserve=extra_reserve, plan=plan)
        except DoesNotFit as exc:
            refusal = exc
            continue
        n_ctx = decision.n_ctx if decision is not None else 0
        rank = (_MODE_RANK[placed.mode], -n_ctx, -sum(placed.free_bytes))
        found.append((rank, msgspec.structs.replace(placed, reason=f"node {node}: {placed.reason}"), decision))
    for node, free in ram.items():
        assert ram_plan is not None
        try:
            decision = ram_plan(free)
        except DoesNotFit as exc:
            refusal = exc
            continue
        placed = GpuPlacement(mode="cpu", devices=[node_device(node, "cpu")], free_bytes=[free], usable_bytes=free,
                              headroom=0.0, node=node, reason=f"node {node}: no GPU there, the model runs in its RAM")
        found.append(((_MODE_RANK["cpu"], -(decision.n_ctx if decision is not None else 0), -free), placed, decision))
    if not found:
        assert refusal is not None
        raise refusal
    _, placed, decision = min(found, key=lambda f: f[0])
    return placed, decision
