"""``POST /api/jobs/estimate``: a fine-tune's memory per device, before submit.

The body is a submission's (``{"kind": "finetune", "params": {...}}``) and
is validated the same way (a 400 names the field), except that ``train`` may
be left out: the estimate needs no data (it assumes every micro-batch is
``max_seq_len`` long, the most one can be). Nothing is queued.

The numbers come from :func:`jobs.finetune_memory.estimate_memory`, which
reads ``config.json`` and the safetensors headers only (no torch in the
parent), and are set against the free memory of the devices the job would
book now (the lease's order), as the driver reports it; on a machine
without a GPU, against the RAM available. Besides the estimate for the
params given, it answers what gradient checkpointing and a 4-bit base would
change, so the form can say what each setting costs.

With a cluster, a node's devices (named in ``gpu_ids``, or a count taken on
the machine the runner would move it to) are judged by the memory that
node's agent last read (the lease's node readings), never by this
machine's GPU of the same index. ``node`` in the body judges a count on
that node's devices; a node the lease has no devices of is a 400 naming it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import psutil
from aiohttp import web

from jobs.errors import ParamError
from jobs.finetune_memory import MemoryEstimate, estimate_memory
from jobs.finetune_params import FinetuneParams, check_4bit_machine
from jobs.kinds import decode_params
from jobs.params import ResolveContext
from supervisor.api.io import decode_body, json_response
from supervisor.appkeys import JOB_SETTINGS, LEASE
from supervisor.errors import BadRequest, param_error
from supervisor.lab.lease import CPU, GpuLease
from supervisor.lab.node_exec import job_node
from supervisor.models.devices import DeviceReadError, GpuReading

ESTIMATE_PATH = "/api/jobs/estimate"
# What the estimate leaves out on a GPU: the CUDA context and the caching
# allocator's slack, a few hundred MiB whatever the model. Counted in the fit.
GPU_HEADROOM_BYTES = 512 << 20
# On the CPU: the Python runtime with torch, transformers and peft loaded.
CPU_HEADROOM_BYTES = 1 << 30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class EstimateBody(msgspec.Struct, forbid_unknown_fields=True):
    kind: str
    params: dict[str, Any] = {}
    # Accepted so a submission's body can be sent as it is; it changes nothing here.
    priority: int = 0
    # A cluster node to judge the fit on: a count of GPUs is taken from its
    # devices, and named ones must be its. None: the devices the job would get.
    node: str | None = None


def add_routes(app: web.Application) -> None:
    app.router.add_post(ESTIMATE_PATH, estimate_job)


def _validated(body: EstimateBody, request: web.Request) -> tuple[FinetuneParams, list[str]]:
    """The params as a submission checks them, and the devices it would book."""
    if body.kind != "finetune":
        raise BadRequest(f"memory estimates are for finetune jobs, not {body.kind!r}", param="kind")
    settings = request.app[JOB_SETTINGS]
    ctx = ResolveContext(settings.roots, settings.model_lookup, test_kinds=settings.test_job_kinds)
    has_data = "train" in body.params
    raw = body.params if has_data else {**body.params, "train": ""}
    lease = request.app[LEASE]
    available = lease.preferred() if body.node is None else _node_devices(lease, body.node)
    try:
        params = decode_params("finetune", raw, include_test=ctx.test_kinds)
        assert isinstance(params, FinetuneParams)
        params.resolve(ctx, data=has_data)
        if body.node is not None and params.gpu_ids is None and params.gpus > len(available):
            raise ParamError(f"gpus: {params.gpus} asked, node {body.node} has {len(available)}",
                             param="params.gpus")
        devices = params.devices(available)
    except ParamError as exc:
        raise param_error(exc) from exc
    if body.node is None and params.gpu_ids is None and lease.jobs_on_nodes:
        try:
            # Where the runner takes a count this machine cannot give: a node that has it.
            devices = lease.on_one_machine(devices)
        except ValueError as exc:
            raise BadRequest(f"gpus: {exc}", param="params.gpus") from exc
    return params, devices


def _node_devices(lease: GpuLease, node: str) -> list[str]:
    """The node's devices in the order a count takes them; a 400 naming the
    node when the lease has none of it (not alive, or not in the cluster)."""
    devices = [d for d in lease.preferred() if lease.device(d).node == node]
    if not devices:
        raise BadRequest(f"node {node!r} is not a cluster node with devices in the lease "
                         f"(nodes: {', '.join(sorted(lease.nodes())) or 'none'})",
                         param="node", code="node_not_found")
    return devices


def _model_dir(value: str) -> tuple[Path | None, str | None]:
    """The model's directory (a repo id looked up in the local Hub cache, as
    the job does), or None and why."""
    if Path(value).is_absolute():
        return Path(value), None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(value, local_files_only=True)), None
    except LocalEntryNotFoundError:
        return None, f"{value} is not in the Hugging Face cache yet: download it first to see its estimate"


def _dtype(params: FinetuneParams, gpu: bool) -> tuple[str, int]:
    if params.dtype != "auto":
        return params.dtype, _DTYPE_BYTES[params.dtype]
    if gpu:
        # The job picks bfloat16 where the GPU has it (float16 for a 4-bit
        # base without it); an older GPU without either trains in float32.
        return ("bfloat16" if not params.load_in_4bit else "bfloat16 or float16"), 2
    return "float32", 4


def _estimates(model_dir: Path, params: FinetuneParams, dtype_bytes: int,
               world: int) -> dict[str, MemoryEstimate | None]:
    """The params' estimate, and with each memory saver flipped."""
    out = {"current": estimate_memory(model_dir, params, dtype_bytes, world=world)}
    for name in ("gradient_checkpointing", "load_in_4bit"):
        flipped = msgspec.structs.replace(params, **{name: not getattr(params, name)})
        out[name] = estimate_memory(model_dir, flipped, dtype_bytes, world=world)
    return out


async def _readings(lease: GpuLease, devices: list[str]) -> tuple[list[GpuReading], str | None]:
    """This machine's GPUs read now (the nodes' come from the lease's node readings)."""
    here = [d for d in devices if not lease.device(d).node]
    if lease.settler is None or not lease.gpu_indices(here):
        return [], None
    try:
        return await lease.settler.read(), None
    except DeviceReadError as exc:
        return [], str(exc)


def _device_fits(lease: GpuLease, devices: list[str], readings: list[GpuReading],
                 need: int | None) -> list[dict[str, Any]]:
    by_index = {r.index: r for r in readings}
    workers = lease.workers_on()
    out = []
    for device_id in devices:
        free: int | None
        total: int | None
        device = lease.device(device_id)
        if device_id == CPU:
            ram = psutil.virtual_memory()
            free, total, headroom = int(ram.available), int(ram.total), CPU_HEADROOM_BYTES
        elif device.node:
            # A node's GPU (or RAM, for node/cpu) as its agent last read it.
            free, total = lease.node_memory(device_id) or (None, None)
            headroom = GPU_HEADROOM_BYTES if device.index is not None else CPU_HEADROOM_BYTES
        else:
            index = lease.device(device_id).index
            reading = by_index.get(index) if index is not None else None
            free = reading.free_bytes if reading is not None else None
            total = reading.total_bytes if reading is not None else None
            headroom = GPU_HEADROOM_BYTES
        out.append({
            "id": device_id, "name": lease.device(device_id).name,
            "free_bytes": free, "total_bytes": total, "headroom_bytes": headroom,
            "fits": None if need is None or free is None else need + headroom <= free,
            # Unloaded when the job starts (the lease vacates its devices): their memory comes back.
            "models_loaded": len(workers.get(device_id, [])),
        })
    return out


def _verdict(fits: list[dict[str, Any]], memory_error: str | None) -> tuple[bool | None, str]:
    known = [d for d in fits if d["fits"] is not None]
    if not known:
        return None, f"free memory unknown ({memory_error})" if memory_error else "free memory unknown"
    short = [d for d in known if not d["fits"]]
    if not short:
        return (True if len(known) == len(fits) else None), "fits in the free memory of " + ", ".join(
            d["id"] for d in known)
    text = "does not fit in the free memory of " + ", ".join(d["id"] for d in short)
    if any(d["models_loaded"] for d in short):
        text += " now; the models loaded there are unloaded when the job starts, which frees their memory"
    return False, text


async def estimate_job(request: web.Request) -> web.Response:
    body = await decode_body(request, EstimateBody)
    params, devices = _validated(body, request)
    lease = request.app[LEASE]
    gpu = any(lease.device(d).index is not None for d in devices)
    dtype, dtype_bytes = _dtype(params, gpu)
    world = len(devices)
    model_dir, reason = await asyncio.to_thread(_model_dir, params.model)
    estimates: dict[str, MemoryEstimate | None] = {}
    if model_dir is not None:
        try:
            estimates = await asyncio.to_thread(_estimates, model_dir, params, dtype_bytes, world)
        except (OSError, ValueError, KeyError) as exc:  # a damaged config or header: said, not raised
            reason = f"the model's files cannot be read for an estimate: {exc}"
        else:
            if estimates["current"] is None:
                reason = "no estimate: the model's weights are not in safetensors files"
    current = estimates.get("current")
    readings, memory_error = await _readings(lease, devices)
    fits = _device_fits(lease, devices, readings, current.total_bytes if current else None)
    verdict, message = _verdict(fits, memory_error) if current else (None, reason or "no estimate")
    try:
        # A node's RAM device trains on the CPU as this machine's cpu does.
        check_4bit_machine([d if lease.device(d).index is not None else CPU for d in devices])
        four_bit_note = None
    except ParamError as exc:
        four_bit_note = exc.message
    return json_response({
        "object": "finetune.memory_estimate",
        "model": params.model,
        "dtype": dtype, "dtype_bytes": dtype_bytes,
        "devices": fits, "world_size": world,
        # The cluster node those devices are on; None for this machine.
        "node": job_node(devices) or None,
        "estimate": current.as_dict() if current else None,
        "fits": verdict, "message": message, "reason": reason, "memory_error": memory_error,
        # The same params with one memory saver flipped: what that setting costs.
        "alternatives": {
            name: {"value": not getattr(params, name), "estimate": est.as_dict() if est else None,
                   "note": four_bit_note if name == "load_in_4bit" and not params.load_in_4bit else None}
            for name, est in estimates.items() if name != "current"
        },
    })
