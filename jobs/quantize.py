"""The ``quantize`` kind: GGUF -> GGUF with llama.cpp's quantizer.

Before any work it refuses, with a clear error, a file that is not GGUF, an
already-quantized model (unless ``allow_requantize``), a type the tensor
shapes cannot take, and a disk without room for the output. The output is
written under a hidden temporary name in the models dir and renamed into
place only when complete, so a half-written file is never served.

``llama_model_quantize`` is one native call that cannot be interrupted; it
runs in a thread while the main thread reports progress (output size against
the estimate) and, on SIGTERM, abandons it: the temp file is removed and the
process exits, taking the thread with it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from jobs.context import JobContext, JobError, JobStopped
from jobs.events import JobIO
from jobs.params import JobParams, QuantizeParams

Q = gguf.GGMLQuantizationType
# Our type name -> (llama.cpp ftype constant name, the main tensor type it uses).
TYPES: dict[str, tuple[str, gguf.GGMLQuantizationType]] = {
    "F16": ("LLAMA_FTYPE_MOSTLY_F16", Q.F16),
    "BF16": ("LLAMA_FTYPE_MOSTLY_BF16", Q.BF16),
    "Q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", Q.Q8_0),
    "Q6_K": ("LLAMA_FTYPE_MOSTLY_Q6_K", Q.Q6_K),
    "Q5_K_M": ("LLAMA_FTYPE_MOSTLY_Q5_K_M", Q.Q5_K),
    "Q5_K_S": ("LLAMA_FTYPE_MOSTLY_Q5_K_S", Q.Q5_K),
    "Q5_0": ("LLAMA_FTYPE_MOSTLY_Q5_0", Q.Q5_0),
    "Q4_K_M": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", Q.Q4_K),
    "Q4_K_S": ("LLAMA_FTYPE_MOSTLY_Q4_K_S", Q.Q4_K),
    "Q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", Q.Q4_0),
    "Q3_K_M": ("LLAMA_FTYPE_MOSTLY_Q3_K_M", Q.Q3_K),
}
UNQUANTIZED = frozenset({Q.F32, Q.F16, Q.BF16})
_DISK_MARGIN = 64 * 1024 * 1024


@dataclass
class Plan:
    """What the header says about the input and the expected output."""

    file_type: int | None
    quantized: bool
    estimate_bytes: int
    incompatible: list[tuple[str, int]]
    quantizable: int


def _is_weight(t: Any) -> bool:
    return str(t.name).endswith(".weight") and len(t.shape) >= 2


def inspect_model(path: Path, type_name: str) -> Plan:
    """Read the GGUF header (memory-mapped) and plan the conversion."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise JobError(f"{path.name} is not a GGUF file")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise JobError(f"{path.name} is not a readable GGUF file: {exc}") from exc
    field = reader.fields.get("general.file_type")
    file_type = int(field.parts[field.data[0]][0]) if field is not None else None
    target = TYPES[type_name][1]
    block, type_size = gguf.GGML_QUANT_SIZES[target]
    estimate = path.stat().st_size - sum(int(t.n_bytes) for t in reader.tensors)
    incompatible, quantizable, quantized = [], 0, False
    for t in reader.tensors:
        ttype = gguf.GGMLQuantizationType(int(t.tensor_type))
        quantized = quantized or ttype not in UNQUANTIZED
        if not _is_weight(t):
            estimate += int(t.n_bytes)
            continue
        quantizable += 1
        row = int(t.shape[0])
        if row % block:
            incompatible.append((str(t.name), row))
            estimate += int(t.n_bytes)
        else:
            estimate += int(t.n_elements) // block * type_size
    if file_type is not None and file_type not in (0, 1, 32):
        quantized = True
    return Plan(file_type, quantized, estimate, incompatible, quantizable)


def check_plan(io: JobIO, plan: Plan, params: QuantizeParams, out_dir: Path) -> None:
    if plan.quantized and not params.allow_requantize:
        raise JobError(
            "the model is already quantized; requantizing loses quality, set allow_requantize to do it"
        )
    block = gguf.GGML_QUANT_SIZES[TYPES[params.type][1]][0]
    if plan.incompatible and len(plan.incompatible) * 2 > plan.quantizable:
        name, row = plan.incompatible[0]
        raise JobError(
            f"{params.type} needs weight rows that are a multiple of {block} values, but "
            f"{len(plan.incompatible)} of {plan.quantizable} weights do not (e.g. {name} has "
            f"rows of {row}); pick a type with smaller blocks such as Q8_0 or F16"
        )
    if plan.incompatible:
        io.log(f"{len(plan.incompatible)} tensors cannot take {params.type}; llama.cpp uses a fallback type")
    free = shutil.disk_usage(out_dir).free
    needed = int(plan.estimate_bytes * 1.05) + _DISK_MARGIN
    if free < needed:
        raise JobError(
            f"not enough free disk in the models dir: {free // 2**20} MiB free, "
            f"about {needed // 2**20} MiB needed"
        )


def _quantize_call(src: Path, dst: Path, params: QuantizeParams, outcome: list[int]) -> None:
    import llama_cpp  # only in the job process

    qp = llama_cpp.llama_model_quantize_default_params()
    qp.ftype = getattr(llama_cpp, TYPES[params.type][0])
    qp.nthread = params.nthread
    qp.allow_requantize = params.allow_requantize
    outcome.append(int(llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(qp))))


def quantize(io: JobIO, src: Path, tmp: Path, params: QuantizeParams, estimate: int) -> None:
    outcome: list[int] = []
    worker = threading.Thread(target=_quantize_call, args=(src, tmp, params, outcome), daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.5)
        if io.stop_requested:
            # The native call cannot stop; leaving the process ends it.
            tmp.unlink(missing_ok=True)
            raise JobStopped("stopped on request while quantizing (partial output removed)")
        size = tmp.stat().st_size if tmp.exists() else 0
        io.progress(min(0.99, size / max(1, estimate)), message=f"{size // 2**20} MiB written")
    if not outcome or outcome[0] != 0:
        raise JobError(f"llama.cpp could not quantize the model (code {outcome[:1]}); see the job log")


def run(io: JobIO, params: JobParams, ctx: JobContext) -> dict[str, Any]:
    if not isinstance(params, QuantizeParams) or params.output_name is None:
        raise JobError("quantize needs resolved QuantizeParams")
    src = Path(params.model)
    out_dir = Path(ctx.models_dir)
    out = out_dir / params.output_name
    io.stage("checking")
    plan = inspect_model(src, params.type)
    check_plan(io, plan, params, out_dir)
    if out.exists() and not params.overwrite:
        raise JobError(f"{out.name} already exists; set overwrite to replace it")
    tmp = out_dir / f".{out.name}.{ctx.job_id}.partial"
    io.stage("quantizing")
    io.log(f"quantizing {src.name} to {params.type}, about {plan.estimate_bytes // 2**20} MiB")
    started = time.monotonic()
    try:
        quantize(io, src, tmp, params, plan.estimate_bytes)
        with tmp.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise JobError("llama.cpp wrote an output that is not GGUF")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    size = out.stat().st_size
    return {
        "output_path": str(out),
        "bytes": size,
        "type": params.type,
        "model": out.name[: -len(".gguf")],
        "input_bytes": src.stat().st_size,
        "seconds": round(time.monotonic() - started, 3),
    }
