"""Parameters of ``finetune`` and ``export`` jobs, validated by the parent.

Like :mod:`jobs.params` this module is imported by the parent, so it never
imports torch, transformers or peft: whether the ``train`` extra is installed
is checked with :func:`importlib.util.find_spec`, which imports nothing.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from jobs.errors import ParamError
from jobs.params import (
    DeviceChoice,
    JobParams,
    QuantType,
    ResolveContext,
    check_name,
    existing_file,
    resolve_path,
)

ADAPTER_CONFIG = "adapter_config.json"
TRAIN_MODULES = ("torch", "transformers", "peft", "safetensors")
TRAIN_INSTALL_HINT = (
    "install the train extra: pip install torch==2.13.0 (or the CUDA build you want), "
    "then pip install 'gpuvisor[train]'"
)
BNB_INSTALL_HINT = "pip install bitsandbytes (on a machine with a CUDA build of torch)"
# The usual attention and MLP projections, under both the split names (Llama,
# Qwen, Gemma, OLMo, Granite, Mistral) and the fused ones (Phi-3 and Phi-4:
# qkv_proj, gate_up_proj): with only the split names, a Phi model trained
# just o_proj and down_proj. A model has one set or the other; the defaults
# it lacks are left out without a word (a name the user chose is reported).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj",
                   "gate_proj", "up_proj", "gate_up_proj", "down_proj")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
_HF_CACHE_DIR = re.compile(r"^models--(?P<owner>[^/]+?)--(?P<name>[^/]+)$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,99}$")

PosInt = Annotated[int, msgspec.Meta(ge=1, le=10_000_000)]
OutType = Literal["F32", "F16"]


def missing_train_modules() -> list[str]:
    return [m for m in TRAIN_MODULES if importlib.util.find_spec(m) is None]


def train_missing_reason(kind: str, missing: Sequence[str]) -> str:
    """Why a kind that needs the train extra cannot run (submit error and schema)."""
    return f"{kind} jobs need {', '.join(missing)}, which are not installed: {TRAIN_INSTALL_HINT}"


def resolve_hf_model(value: str, ctx: ResolveContext, param: str) -> str:
    """A Hugging Face model dir inside the roots, or a repo id that the job
    looks up in the HF cache (``owner/name``, when no such dir exists)."""
    path = resolve_path(value, ctx.roots.models, ctx.roots, param)
    if (path / "config.json").is_file():
        return str(path)
    if _REPO_ID.fullmatch(value) and ".." not in value and not path.exists():
        return value
    raise ParamError(
        f"{param}: {value!r} is not a Hugging Face model dir (a folder with config.json) "
        "in the models dir, nor an owner/name repo id",
        param=param, code="model_not_found",
    )


def check_output_dir(name: str | None, ctx: ResolveContext, overwrite: bool, param: str) -> str | None:
    if name is None:
        return None
    check_name(name, param)
    if (ctx.roots.outputs / name).exists() and not overwrite:
        raise ParamError(
            f"{name} already exists in the outputs dir; set overwrite to replace it",
            param=param, code="output_exists",
        )
    return name


def check_gguf_name(name: str, ctx: ResolveContext, overwrite: bool, param: str) -> str:
    name = name if name.endswith(".gguf") else f"{name}.gguf"
    check_name(name, param)
    if (ctx.roots.models / name).exists() and not overwrite:
        raise ParamError(
            f"{name} already exists in the models dir; set overwrite to replace it",
            param=param, code="output_exists",
        )
    return name


class ExportOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The GGUF export step: shared by ``export`` jobs and ``finetune.export``."""

    outtype: OutType = "F16"
    # Quantize the converted model too (llama.cpp's quantizer, as the quantize job).
    quantize: QuantType | None = None
    # GGUF file name in the models dir; unset: the model's name, or
    # <base>-<job id> for a model a job made (see made_from).
    output_name: str | None = None
    # With quantize: also keep the F16/F32 file in the models dir.
    keep_unquantized: bool = False
    overwrite: bool = False

    def names(self, stem: str) -> tuple[str, str | None]:
        """(converted file name, quantized file name or None)."""
        base = (self.output_name or stem).removesuffix(".gguf")
        if self.quantize is None:
            return f"{base}.gguf", None
        return f"{base}-{self.outtype}.gguf", f"{base}-{self.quantize}.gguf"

    def check(self, stem: str, ctx: ResolveContext, param: str) -> None:
        converted, quantized = self.names(stem)
        if quantized is None or self.keep_unquantized:
            check_gguf_name(converted, ctx, self.overwrite, f"{param}.output_name")
        if quantized is not None:
            check_gguf_name(quantized, ctx, self.overwrite, f"{param}.output_name")


def base_name(base: str) -> str:
    """The name a base model's GGUF is known by: its dir's name, or the repo's
    name for a Hugging Face cache snapshot or a repo id."""
    parts = Path(base).parts
    for i, part in enumerate(parts):
        m = _HF_CACHE_DIR.match(part)
        if m is not None and i + 2 < len(parts) and parts[i + 1] == "snapshots":
            return m.group("name")
    return base.rstrip("/").rsplit("/", 1)[-1]


# Default export names. A model's own GGUF is named for the model (its dir or
# repo), which is how an adapter trained on it finds it (general.name and the
# file name, supervisor/models/adapters.py). A model a job wrote has no name
# of its own (a fine-tune's ``merged/``): its GGUF is ``<base>-<job id>``,
# for the base it was made from and the job that writes the GGUF, so every
# export gets a new name and none is ever "merged".


def is_job_output(model_dir: Path, ctx: ResolveContext) -> bool:
    return model_dir.is_absolute() and model_dir.is_relative_to(ctx.roots.outputs.resolve())


def made_from(model_dir: Path) -> str:
    """The base model a job's output was made from: the base its fine-tune's
    adapter records (``<out>/adapter`` beside ``<out>/merged``), else the
    output's own name."""
    named = model_dir.parent if model_dir.name == "merged" else model_dir
    try:
        cfg = json.loads((named / "adapter" / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return named.name  # no adapter beside it: not a fine-tune's output
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    return base_name(base) if isinstance(base, str) and base else named.name


def job_model_name(base: str, job_id: str) -> str:
    """``<base>-<job id>``: the GGUF name of a model that a job made."""
    return f"{base}-{job_id}"


def adapter_stem(adapter_dir: Path) -> str:
    """The default GGUF name of an adapter: a fine-tune's ``<output>/adapter``
    is named for its output dir."""
    named = adapter_dir.parent if adapter_dir.name == "adapter" else adapter_dir
    return f"{named.name}-lora"


class ExportParams(JobParams, ExportOptions):
    """Convert a Hugging Face model dir to GGUF in the models dir (the families
    of ``jobs.hf_arch``: Llama, Mistral, Qwen 2 and 3, Gemma 2 and 3, Phi-3 and
    4, OLMo 2, Granite).

    A PEFT LoRA adapter dir (with ``adapter_config.json``) as ``model`` is
    converted to a GGUF LoRA adapter instead (``jobs.lora_export``); its base
    model (whose config.json gives the tensor layout) is the one the adapter
    records, or ``base``.

    Converting and quantizing are CPU and disk work: an export books no
    device (:meth:`JobParams.devices`), and chat keeps serving meanwhile.
    """

    model: str
    base: str | None = None

    def resolve(self, ctx: ResolveContext) -> None:
        path = resolve_path(self.model, ctx.roots.models, ctx.roots, "params.model")
        if (path / ADAPTER_CONFIG).is_file():
            self._resolve_adapter(path, ctx)
            return
        if self.base is not None:
            raise ParamError("base applies to adapter exports only", param="params.base")
        self.model = resolve_hf_model(self.model, ctx, "params.model")
        if self.output_name is None and not is_job_output(Path(self.model), ctx):
            self.output_name = base_name(self.model)
        if self.output_name is not None:
            self.check(self.output_name, ctx, "params")
        # else the job names it <base>-<its id> (export.export_model): new, so unchecked.

    def _resolve_adapter(self, path: Path, ctx: ResolveContext) -> None:
        self.model = str(path)
        if self.quantize is not None:
            raise ParamError("quantize applies to models, not LoRA adapters", param="params.quantize")
        if self.base is not None:
            self.base = resolve_hf_model(self.base, ctx, "params.base")
        if self.output_name is None:
            self.output_name = adapter_stem(path)
        check_gguf_name(self.output_name, ctx, self.overwrite, "params.output_name")


class FinetuneParams(JobParams, DeviceChoice):
    """LoRA supervised fine-tuning; defaults follow the well-known tools."""

    model: str
    train: str
    eval: str | None = None
    output_name: str | None = None
    overwrite: bool = False
    lora_r: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    lora_alpha: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 16
    lora_dropout: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
    target_modules: Annotated[list[str], msgspec.Meta(min_length=1, max_length=64)] = msgspec.field(
        default_factory=lambda: list(DEFAULT_TARGETS)
    )
    learning_rate: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 2e-4
    lr_scheduler: Literal["linear", "cosine", "constant"] = "linear"
    warmup_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=0.5)] = 0.03
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    max_grad_norm: Annotated[float, msgspec.Meta(ge=0.0, le=1000.0)] = 1.0
    epochs: Annotated[float, msgspec.Meta(gt=0.0, le=1000.0)] = 1.0
    # Set: train exactly this many optimizer steps, whatever ``epochs`` says.
    max_steps: PosInt | None = None
    batch_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 2
    gradient_accumulation_steps: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 4
    max_seq_len: Annotated[int, msgspec.Meta(ge=8, le=1_048_576)] = 2048
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] = 42
    save_steps: PosInt = 100
    save_total_limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 2
    # Evaluate on ``eval`` every N steps (and at the end); unset: at the end only.
    eval_steps: PosInt | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Keep only each layer's input for the backward pass and recompute the
    # rest: activations of one layer instead of all, for about a third more
    # compute. Off where the model does not support it (said in the log).
    gradient_checkpointing: bool = True
    # QLoRA: the frozen base in 4 bits (bitsandbytes NF4), about a quarter of
    # its 16-bit memory. CUDA only: refused on a machine without a GPU.
    load_in_4bit: bool = False
    # Threads for training on the CPU; 0 = torch's default (one per core),
    # which can be much slower than fewer where the cores are shared.
    cpu_threads: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    merge: bool = True
    export: ExportOptions | None = None
    # Also write the adapter as a GGUF LoRA adapter into the models dir, where
    # it is served on its base model as ``<base>:<output>-lora``.
    export_adapter: bool = False

    def resolve(self, ctx: ResolveContext, *, data: bool = True) -> None:
        """``data`` false: leave ``train`` unchecked (a memory estimate
        before the user picked the data; nothing runs on it)."""
        missing = missing_train_modules()
        if missing:
            raise ParamError(train_missing_reason("finetune", missing), param="kind",
                             code="train_extra_missing")
        self.model = resolve_hf_model(self.model, ctx, "params.model")
        if data:
            self.train = str(existing_file(self.train, ctx.roots.datasets, ctx.roots, "params.train"))
        if self.eval is not None:
            self.eval = str(existing_file(self.eval, ctx.roots.datasets, ctx.roots, "params.eval"))
        self.output_name = check_output_dir(self.output_name, ctx, self.overwrite, "params.output_name")
        self._check_fields(ctx)

    def _check_fields(self, ctx: ResolveContext) -> None:
        for name in self.target_modules:
            if not _MODULE.fullmatch(name):
                raise ParamError(f"target_modules: {name!r} is not a module name", param="params.target_modules")
        if self.eval_steps is not None and self.eval is None:
            raise ParamError("eval_steps needs an eval dataset", param="params.eval_steps")
        if self.export is not None and not self.merge:
            raise ParamError("export needs merge (the merged model is what is exported)", param="params.export")
        if self.export is not None:
            if self.export.output_name is None and self.output_name is not None:
                self.export.output_name = self.output_name
            # Unnamed, the job names it <base>-<its id> (export.export_model): new, so unchecked.
            if self.export.output_name is not None:
                self.export.check(self.export.output_name, ctx, "params.export")
        if self.export_adapter and self.output_name is not None:
            # Without an output name the adapter is named for the (new) job id.
            check_gguf_name(f"{self.output_name}-lora", ctx, self.overwrite, "params.export_adapter")

    def devices(self, available: Sequence[str]) -> list[str]:
        # One data-parallel rank per device (jobs.finetune_ddp).
        picked = self.pick(available)
        if self.load_in_4bit:
            check_4bit_machine(picked)
        return picked

    def world_size(self) -> int:
        """How many devices the job books, so how many ranks train: what
        :meth:`devices` picks, counted without the list of the machine's."""
        if self.gpu_ids is not None:
            named = {i if i == "cpu" or i.startswith("cuda:") else f"cuda:{i}" for i in self.gpu_ids}
            return len(named)
        return self.gpus


def check_4bit_machine(devices: Sequence[str]) -> None:
    """A 4-bit base needs a GPU and bitsandbytes: refuse what cannot run."""
    if all(d == "cpu" for d in devices):
        raise ParamError(
            "load_in_4bit (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit layers run on CUDA only, "
            "and this job would run on the CPU; train without load_in_4bit",
            param="params.load_in_4bit", code="needs_gpu",
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ParamError(f"load_in_4bit (QLoRA) needs bitsandbytes, which is not installed: {BNB_INSTALL_HINT}",
                         param="params.load_in_4bit", code="bitsandbytes_missing")
