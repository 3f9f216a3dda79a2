"""The job kinds: each kind's params struct, the module its process runs,
and how its params are decoded and checked.

Apart from :mod:`jobs.params` (the params' shared base and the kinds'
structs), so that every params module imports only that base and this
registry imports them all: no import circle.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgspec

from jobs.download_params import DownloadParams
from jobs.errors import ParamError, unknown_field, validation_param
from jobs.finetune_params import ExportParams, FinetuneParams
from jobs.params import (
    DatasetParams,
    JobParams,
    QuantizeParams,
    ResolveContext,
    SleepParams,
)


@dataclass(frozen=True)
class KindSpec:
    name: str
    params: type[JobParams]
    # Module run as the job process (imported only there).
    module: str
    description: str
    grace_s: float = 30.0
    # Saves a checkpoint when stopped with save (SIGUSR1) and can be resumed.
    resumable: bool = False
    # Offered by the API only with the test_job_kinds setting.
    test_only: bool = False
    # Runs only with the ``train`` extra installed (torch, transformers, peft).
    needs_train: bool = False
    # Params fields that older versions stored and this one no longer has:
    # dropped from stored jobs (they still run), refused in new submissions
    # with ``retired_why``.
    retired: tuple[str, ...] = ()
    retired_why: str = ""


@functools.cache
def job_kinds(include_test: bool = False) -> Mapping[str, KindSpec]:
    """The kinds the API offers; ``include_test`` adds the test-only ones.

    The runner and the job process know every kind (``include_test=True``):
    a job stored while the setting was on still runs and reports.
    """
    specs = [
        KindSpec("download", DownloadParams, "jobs.download", "download a model from the Hub"),
        KindSpec(
            "finetune", FinetuneParams, "jobs.finetune", "LoRA fine-tune a Hugging Face model",
            grace_s=120.0, resumable=True, needs_train=True,
        ),
        KindSpec("export", ExportParams, "jobs.export", "convert a Hugging Face model to GGUF"),
        KindSpec("dataset", DatasetParams, "jobs.dataset", "convert a dataset to chat JSONL"),
        KindSpec("quantize", QuantizeParams, "jobs.quantize", "quantize a GGUF model",
                 retired=("gpus", "gpu_ids"),
                 retired_why="quantize jobs run on the CPU and book no GPU"),
        KindSpec("sleep", SleepParams, "jobs.sleep", "a cheap test job", grace_s=10.0, test_only=True),
    ]
    return MappingProxyType({s.name: s for s in specs if include_test or not s.test_only})


def kind_spec(kind: str, *, include_test: bool = True) -> KindSpec:
    kinds = job_kinds(include_test)
    try:
        return kinds[kind]
    except KeyError:
        raise ParamError(
            f"unknown job kind {kind!r}; known: {', '.join(sorted(kinds))}", param="kind"
        ) from None


def decode_params(kind: str, raw: Mapping[str, Any], *, include_test: bool = True) -> JobParams:
    """Convert raw params of a new submission to the kind's struct (no path
    resolution); a retired field is a ParamError naming it."""
    spec = kind_spec(kind, include_test=include_test)
    for name in spec.retired:
        if name in raw:
            raise ParamError(f"{name}: {spec.retired_why}; leave it out", param=f"params.{name}")
    try:
        return msgspec.convert(dict(raw), spec.params)
    except msgspec.ValidationError as exc:
        at = validation_param(exc)
        field = at if at is not None else unknown_field(exc)
        param = f"params.{field}" if field else "params"
        raise ParamError(f"invalid params for {kind}: {exc}", param=param) from exc


def stored_params(spec: KindSpec, raw: Mapping[str, Any]) -> JobParams:
    """The params of a stored job, which an older version may have written:
    its retired fields are dropped. Raises ``msgspec.ValidationError``."""
    current = {k: v for k, v in raw.items() if k not in spec.retired}
    return msgspec.convert(current, spec.params)


def validate_params(kind: str, raw: Mapping[str, Any], ctx: ResolveContext) -> JobParams:
    """Decode and resolve; the result is what gets stored and run. Test-only
    kinds are unknown here unless ``ctx.test_kinds``."""
    params = decode_params(kind, raw, include_test=ctx.test_kinds)
    params.resolve(ctx)
    return params


def params_dict(params: JobParams) -> dict[str, Any]:
    out = msgspec.to_builtins(params)
    assert isinstance(out, dict)
    return out
