"""The ``finetune`` kind: LoRA supervised fine-tuning with transformers + peft.

Output, under ``<outputs>/<output_name or job id>/``: ``checkpoints/`` (every
``save_steps``), ``adapter/`` (the LoRA adapter and tokenizer) and, with
``merge``, ``merged/`` (the merged model in safetensors with its tokenizer
and chat template), then optionally a GGUF export into the models dir, and
with ``export_adapter`` the adapter as a GGUF LoRA adapter there too.

Stopping: SIGTERM stops at the next step boundary; SIGUSR1 does the same but
first writes a checkpoint (cancel with save, and the supervisor's shutdown).
A resumed job runs again with the same id (``ctx.attempt`` > 1) and continues
from the newest complete checkpoint, step count included.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.context import JobContext, JobError, JobStopped
from jobs.events import JobIO
from jobs.export import export_adapter, export_model, resolve_model_dir
from jobs.finetune_ckpt import newest_checkpoint, write_dir_atomically
from jobs.finetune_data import CHATML, encode_all, read_chat_jsonl
from jobs.finetune_loop import StepStats, Trainer
from jobs.finetune_params import FinetuneParams, adapter_stem
from jobs.params import JobParams

if TYPE_CHECKING:
    import torch


class JobHooks:
    """Trainer hooks -> job events; stop requests from SIGTERM or SIGUSR1."""

    def __init__(self, io: JobIO, save_requested: threading.Event) -> None:
        self.io = io
        self.save_requested = save_requested

    def on_step(self, s: StepStats) -> None:
        self.io.progress(
            s.step / s.total_steps, step=s.step, total_steps=s.total_steps, epoch=s.epoch,
            loss=round(s.loss, 6), lr=s.lr, tokens=s.tokens, tokens_per_s=round(s.tokens_per_s, 1),
            elapsed_s=round(s.elapsed_s, 3), eta_s=round(s.eta_s, 1),
            message=f"step {s.step}/{s.total_steps} loss {s.loss:.4f}",
        )

    def on_eval(self, step: int, loss: float) -> None:
        self.io.emit("metric", step=step, eval_loss=round(loss, 6), message=f"eval loss {loss:.4f}")

    def on_checkpoint(self, step: int, path: Path) -> None:
        self.io.emit("metric", step=step, checkpoint=str(path), message=f"checkpoint at step {step}")

    def should_stop(self) -> bool:
        return self.io.stop_requested or self.save_requested.is_set()


def _out_dir(params: FinetuneParams, ctx: JobContext) -> Path:
    out = Path(ctx.outputs_dir) / (params.output_name or ctx.job_id)
    if ctx.attempt == 1 and out.exists():
        if not params.overwrite:
            raise JobError(f"{out.name} already exists in the outputs dir; set overwrite to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _device_and_dtype(params: FinetuneParams) -> tuple[torch.device, torch.dtype]:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if params.dtype != "auto":
        return device, getattr(torch, params.dtype)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return device, torch.bfloat16
    return device, torch.float32


def _load(io: JobIO, params: FinetuneParams, model_dir: Path) -> tuple[Any, Any, torch.device]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.is_fast:
        raise JobError("finetune needs a fast (tokenizers) tokenizer to locate assistant tokens")
    if tokenizer.chat_template is None:
        io.log("the model has no chat template: using ChatML")
        tokenizer.chat_template = CHATML
    device, dtype = _device_and_dtype(params)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.to(device)  # type: ignore[arg-type]  # transformers' stubs misname the parameter
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in params.target_modules if t in present]
    if not targets:
        raise JobError(f"none of target_modules {params.target_modules} exist in this model")
    if len(targets) < len(params.target_modules):
        io.log(f"target modules not in this model, skipped: {sorted(set(params.target_modules) - present)}")
    lora = LoraConfig(r=params.lora_r, lora_alpha=params.lora_alpha, lora_dropout=params.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")
    return tokenizer, get_peft_model(model, lora), device


def build_trainer(
    io: JobIO, params: FinetuneParams, model_dir: Path, checkpoints: Path
) -> tuple[Trainer, Any]:
    """Load model and data; shared with the benchmark."""
    import torch

    torch.manual_seed(params.seed)
    if params.cpu_threads:
        torch.set_num_threads(params.cpu_threads)
    tokenizer, model, device = _load(io, params, model_dir)
    train = encode_all(tokenizer, read_chat_jsonl(Path(params.train)), params.max_seq_len)
    evals = encode_all(tokenizer, read_chat_jsonl(Path(params.eval)), params.max_seq_len) if params.eval else None
    io.log(f"{len(train.examples)} train examples ({train.skipped} without assistant tokens skipped, "
           f"{train.truncated} truncated to {params.max_seq_len} tokens)")
    if not train.examples:
        raise JobError("no training example has assistant tokens within max_seq_len")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = Trainer(model, params, train.examples, evals.examples if evals else [], int(pad or 0),
                      device, checkpoints)
    return trainer, tokenizer


def _cpu_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def _train(io: JobIO, trainer: Trainer, hooks: JobHooks, params: FinetuneParams) -> bool:
    import torch

    try:
        return trainer.train(hooks)
    except torch.OutOfMemoryError as exc:
        raise JobError(
            f"out of memory at step {trainer.state.step + 1} (batch_size {params.batch_size}, "
            f"max_seq_len {params.max_seq_len}): lower batch_size or max_seq_len, and raise "
            "gradient_accumulation_steps to keep the effective batch size"
        ) from exc


def _save_outputs(
    io: JobIO, trainer: Trainer, tokenizer: Any, params: FinetuneParams, out: Path
) -> dict[str, str]:
    io.stage("saving")
    model = trainer.model

    def write_adapter(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    paths = {"adapter_path": str(write_dir_atomically(out / "adapter", write_adapter))}
    if params.merge:
        io.stage("merging")
        merged = model.merge_and_unload()
        dtype = getattr(merged.config, "dtype", None)
        if dtype is not None and dtype != next(merged.parameters()).dtype:
            merged = merged.to(dtype)  # back to the base model's own dtype

        def write_merged(tmp: Path) -> None:
            merged.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)

        paths["merged_path"] = str(write_dir_atomically(out / "merged", write_merged))
    return paths


def run(io: JobIO, params: JobParams, ctx: JobContext) -> dict[str, Any]:
    if not isinstance(params, FinetuneParams):
        raise JobError("finetune needs FinetuneParams")
    save_requested = threading.Event()
    # Installed first: the runner's save-and-stop signal must never kill us.
    signal.signal(signal.SIGUSR1, lambda _s, _f: save_requested.set())
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    out = _out_dir(params, ctx)
    io.stage("loading")
    model_dir = resolve_model_dir(params.model)
    trainer, tokenizer = build_trainer(io, params, model_dir, out / "checkpoints")
    resumed_from = 0
    checkpoint = newest_checkpoint(out / "checkpoints")
    if checkpoint is not None:
        resumed_from = trainer.restore(checkpoint).step
        io.log(f"attempt {ctx.attempt}: resuming from {checkpoint.name} (step {resumed_from})")
    elif ctx.attempt > 1:
        io.log(f"attempt {ctx.attempt}: no complete checkpoint yet, starting from step 0")
    hooks = JobHooks(io, save_requested)
    io.stage("training")
    started = time.monotonic()
    if not _train(io, trainer, hooks, params):
        if save_requested.is_set() and trainer.state.step > trainer.last_saved:
            trainer.save(hooks)
        saved = f"; checkpoint at step {trainer.last_saved}" if trainer.last_saved else ""
        raise JobStopped(f"stopped on request at step {trainer.state.step}{saved}")
    seconds = time.monotonic() - started
    result: dict[str, Any] = {
        "output_dir": str(out),
        "steps": trainer.state.step,
        "resumed_from_step": resumed_from,
        "final_loss": trainer.state.loss,
        "train_tokens": trainer.state.tokens_seen,
        "train_seconds": round(trainer.state.train_seconds, 3),
        "tokens_per_s": round(trainer.state.tokens_seen / max(trainer.state.train_seconds, 1e-9), 1),
        "attempt_seconds": round(seconds, 3),
        "cpu_threads": _cpu_threads(),
    }
    result.update(_save_outputs(io, trainer, tokenizer, params, out))
    if params.export is not None:
        result["export"] = export_model(io, Path(result["merged_path"]), params.export,
                                        Path(ctx.models_dir), ctx.job_id)
    if params.export_adapter:
        out = Path(ctx.models_dir) / f"{adapter_stem(Path(result['adapter_path']))}.gguf"
        # The precision of the model export, when there is one: the pair then
        # computes as the merged model does.
        outtype = params.export.outtype if params.export is not None else "F16"
        result["adapter_export"] = export_adapter(io, Path(result["adapter_path"]), model_dir, out,
                                                  outtype, params.overwrite, ctx.job_id)
    return result
