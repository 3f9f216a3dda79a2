"""The ``export`` kind: a Hugging Face model dir -> GGUF in the models dir.

Converts with :mod:`jobs.hf_convert`, then optionally quantizes with the
quantize job's own code. Every file is written under a hidden temporary name
in the models dir and renamed into place only when complete, so the model
library never sees (or serves) a half-written model. ``finetune`` calls
:func:`export_model` as its last step when asked to.

A PEFT adapter dir as the model is written as a GGUF LoRA adapter
(:func:`export_adapter`, with :mod:`jobs.lora_export`), the same way.

Default names (jobs/finetune_params.py): a model's own GGUF is named for the
model; a model a job made (a fine-tune's ``merged/``) is ``<base>-<job id>``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from jobs.context import JobContext, JobError, check_stop
from jobs.events import JobIO
from jobs.finetune_params import (
    ADAPTER_CONFIG,
    ExportOptions,
    ExportParams,
    base_name,
    job_model_name,
    made_from,
)
from jobs.hf_convert import OutType, convert
from jobs.lora_export import convert_adapter, read_adapter_config
from jobs.params import JobParams, QuantizeParams
from jobs.quantize import check_plan, quantize
from jobs.quantize_plan import inspect_model


def resolve_model_dir(value: str) -> Path:
    """A model dir path, or a repo id looked up in the local HF cache only."""
    if Path(value).is_absolute():
        return Path(value)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(value, local_files_only=True))
    except LocalEntryNotFoundError as exc:
        raise JobError(f"{value} is not in the Hugging Face cache; download it first") from exc


def _partial(out: Path, job_id: str) -> Path:
    return out.with_name(f".{out.name}.{job_id}.partial")


def _convert_step(io: JobIO, model_dir: Path, out: Path, opts: ExportOptions, job_id: str,
                  name: str) -> dict[str, Any]:
    io.stage("converting")
    started = time.monotonic()
    last = [0.0]

    def progress(done: int, total: int, name: str) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.25 or done == total:
            last[0] = now
            io.progress(done / max(1, total), message=f"converting: {name}")

    tmp = _partial(out, job_id)
    try:
        info = convert(model_dir, tmp, opts.outtype, name, progress,
                       lambda: check_stop(io, "while converting"))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    for note in info.notes:
        io.log(note)
    seconds = round(time.monotonic() - started, 3)
    io.log(f"converted {info.arch} ({info.tensors} tensors) to {opts.outtype} in {seconds} s")
    return {"path": str(out), "bytes": out.stat().st_size, "arch": info.arch, "seconds": seconds}


def _quantize_step(io: JobIO, src: Path, out: Path, opts: ExportOptions, job_id: str) -> dict[str, Any]:
    assert opts.quantize is not None
    io.stage("quantizing")
    qparams = QuantizeParams(model=str(src), type=opts.quantize, output_name=out.name,
                             overwrite=opts.overwrite)
    plan = inspect_model(src, opts.quantize)
    check_plan(io, plan, qparams, out.parent)
    started = time.monotonic()
    tmp = _partial(out, job_id)
    try:
        quantize(io, src, tmp, qparams, plan.estimate_bytes)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    seconds = round(time.monotonic() - started, 3)
    return {"path": str(out), "bytes": out.stat().st_size, "type": opts.quantize, "seconds": seconds}


def export_model(
    io: JobIO, model_dir: Path, opts: ExportOptions, models_dir: Path, job_id: str,
    model_name: str | None = None,
) -> dict[str, Any]:
    """Convert (and quantize) into ``models_dir``; returns what was written.

    Unnamed (no ``opts.output_name``), the model is one a job made, such as
    a fine-tune's ``merged/``: it is named ``<base>-<job id>``. The GGUF's
    ``general.name`` is ``model_name`` (a model's own name, which adapters
    trained on it record as their base), else the file's name.
    """
    stem = (opts.output_name or job_model_name(made_from(model_dir), job_id)).removesuffix(".gguf")
    converted_name, quantized_name = opts.names(stem)
    name = model_name or stem
    targets = [models_dir / n for n in (converted_name, quantized_name) if n is not None]
    for target in targets:
        if target.exists() and not opts.overwrite:
            raise JobError(f"{target.name} already exists; set overwrite to replace it")
    if quantized_name is None:
        result = _convert_step(io, model_dir, models_dir / converted_name, opts, job_id, name)
        return {"converted": result, "model": converted_name.removesuffix(".gguf")}
    # The unquantized file is an intermediate unless asked to keep it: it
    # stays hidden (a partial name) so it is never served.
    keep = opts.keep_unquantized
    converted = models_dir / (converted_name if keep else f".{converted_name}.{job_id}.f16")
    try:
        result = _convert_step(io, model_dir, converted, opts, job_id, name)
        quantized = _quantize_step(io, converted, models_dir / quantized_name, opts, job_id)
    finally:
        if not keep:
            converted.unlink(missing_ok=True)
    if not keep:
        result.pop("path")
    return {"converted": result, "quantized": quantized, "model": quantized_name.removesuffix(".gguf")}


def export_adapter(
    io: JobIO, adapter_dir: Path, base_dir: Path | None, out: Path, outtype: OutType,
    overwrite: bool, job_id: str,
) -> dict[str, Any]:
    """Write a PEFT adapter as a GGUF LoRA adapter at ``out``; returns what was written."""
    if out.exists() and not overwrite:
        raise JobError(f"{out.name} already exists; set overwrite to replace it")
    if base_dir is None:
        recorded = read_adapter_config(adapter_dir).base
        if not recorded:
            raise JobError("the adapter does not record its base model; set base")
        base_dir = resolve_model_dir(recorded)
    io.stage("converting adapter")
    started = time.monotonic()
    tmp = _partial(out, job_id)
    try:
        info = convert_adapter(adapter_dir, base_dir, tmp, outtype, out.stem,
                               lambda: check_stop(io, "while converting"))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    seconds = round(time.monotonic() - started, 3)
    io.log(f"converted a rank {info.rank} LoRA adapter for {info.arch} ({info.tensors} tensors, "
           f"base {info.base_name}) to {outtype} in {seconds} s")
    return {"path": str(out), "bytes": out.stat().st_size, "arch": info.arch, "rank": info.rank,
            "alpha": info.alpha, "base_name": info.base_name, "adapter": out.stem, "seconds": seconds}


def run(io: JobIO, params: JobParams, ctx: JobContext) -> dict[str, Any]:
    if not isinstance(params, ExportParams):
        raise JobError("export needs ExportParams")
    model = Path(params.model)
    if (model / ADAPTER_CONFIG).is_file():
        assert params.output_name is not None  # pinned at submit
        out = Path(ctx.models_dir) / (params.output_name.removesuffix(".gguf") + ".gguf")
        base = resolve_model_dir(params.base) if params.base is not None else None
        return {"adapter": export_adapter(io, model, base, out, params.outtype, params.overwrite,
                                          ctx.job_id)}
    model_dir = resolve_model_dir(params.model)
    # A job's output has no name of its own; any other model keeps its name
    # inside the GGUF whatever the file is called, so its adapters find it.
    made_by_a_job = model.is_absolute() and model.resolve().is_relative_to(Path(ctx.outputs_dir).resolve())
    own_name = None if made_by_a_job else base_name(params.model)
    return export_model(io, model_dir, params, Path(ctx.models_dir), ctx.job_id, own_name)
