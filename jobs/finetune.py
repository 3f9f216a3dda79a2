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

A job that books one device trains in this process. One that books N trains
data-parallel on all N: this process starts one rank per device and owns
them (:mod:`jobs.finetune_ddp`); rank 0 writes the events, checkpoints and
outputs, and this process exports them once the ranks are done.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.context import JobContext, JobError, JobStopped
from jobs.events import JobIO
from jobs.export import export_adapter, export_model, resolve_model_dir
from jobs.finetune_ckpt import newest_checkpoint, write_dir_atomically
from jobs.finetune_data import encode_all, read_chat_jsonl
from jobs.finetune_dist import Comm, LocalComm
from jobs.finetune_loop import StepStats, Trainer
from jobs.finetune_memory import MemoryEstimate, PeakMemory, estimate_memory
from jobs.finetune_model import default_device, load_model, load_tokenizer, merged_model, train_dtype
from jobs.finetune_params import FinetuneParams, adapter_stem
from jobs.params import JobParams

if TYPE_CHECKING:
    import torch


class JobHooks:
    """Trainer hooks -> job events; stop requests from SIGTERM or SIGUSR1.

    ``report`` false: a rank other than rank 0, whose steps rank 0 reports."""

    def __init__(self, io: JobIO, save_requested: threading.Event, report: bool = True) -> None:
        self.io = io
        self.save_requested = save_requested
        self.report = report

    def on_step(self, s: StepStats) -> None:
        if not self.report:
            return
        self.io.progress(
            s.step / s.total_steps, step=s.step, total_steps=s.total_steps, epoch=s.epoch,
            loss=round(s.loss, 6), lr=s.lr, tokens=s.tokens, tokens_per_s=round(s.tokens_per_s, 1),
            elapsed_s=round(s.elapsed_s, 3), eta_s=round(s.eta_s, 1),
            message=f"step {s.step}/{s.total_steps} loss {s.loss:.4f}",
        )

    def on_eval(self, step: int, loss: float) -> None:
        if self.report:
            self.io.emit("metric", step=step, eval_loss=round(loss, 6), message=f"eval loss {loss:.4f}")

    def on_checkpoint(self, step: int, path: Path) -> None:
        self.io.emit("metric", step=step, checkpoint=str(path), message=f"checkpoint at step {step}")

    def should_stop(self) -> bool:
        return self.io.stop_requested or self.save_requested.is_set()

    def save_on_stop(self) -> bool:
        return self.save_requested.is_set()


def out_dir(params: FinetuneParams, ctx: JobContext) -> Path:
    out = Path(ctx.outputs_dir) / (params.output_name or ctx.job_id)
    if ctx.attempt == 1 and out.exists():
        if not params.overwrite:
            raise JobError(f"{out.name} already exists in the outputs dir; set overwrite to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


@dataclass
class Prepared:
    trainer: Trainer
    tokenizer: Any
    checkpointing: bool
    estimate: MemoryEstimate | None


def prepare(io: JobIO, params: FinetuneParams, model_dir: Path, checkpoints: Path,
            device: torch.device, comm: Comm) -> Prepared:
    """Load model and data for one process (the only one, or one rank)."""
    import torch

    torch.manual_seed(params.seed)
    if params.cpu_threads:
        torch.set_num_threads(params.cpu_threads)
    # Ranks other than 0 load quietly (their words are dropped with the
    # buffer): rank 0 says it once for all.
    say = io if comm.is_main else JobIO(stdin=BytesIO(), stdout=BytesIO())
    tokenizer = load_tokenizer(say, model_dir)
    model, checkpointing = load_model(say, params, model_dir, device)
    train = encode_all(tokenizer, read_chat_jsonl(Path(params.train)), params.max_seq_len)
    evals = encode_all(tokenizer, read_chat_jsonl(Path(params.eval)), params.max_seq_len) if params.eval else None
    say.log(f"{len(train.examples)} train examples ({train.skipped} without assistant tokens skipped, "
            f"{train.truncated} truncated to {params.max_seq_len} tokens)")
    if not train.examples:
        raise JobError("no training example has assistant tokens within max_seq_len")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = Trainer(model, params, train.examples, evals.examples if evals else [], int(pad or 0),
                      device, checkpoints, comm)
    longest = max(len(e.input_ids) for e in train.examples)
    estimate = estimate_memory(model_dir, params, train_dtype(params, device).itemsize, longest, comm.world)
    if estimate is None:
        say.log("memory estimate: none (the weights are not in safetensors files)")
    else:
        say.log(f"memory estimate per device: {estimate.describe()}")
    return Prepared(trainer, tokenizer, checkpointing, estimate)


def build_trainer(
    io: JobIO, params: FinetuneParams, model_dir: Path, checkpoints: Path
) -> tuple[Trainer, Any]:
    """Load model and data in this process; shared with the benchmark."""
    prepared = prepare(io, params, model_dir, checkpoints, default_device(), LocalComm())
    return prepared.trainer, prepared.tokenizer


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
    io: JobIO, trainer: Trainer, tokenizer: Any, params: FinetuneParams, model_dir: Path, out: Path
) -> dict[str, str]:
    io.stage("saving")
    model = trainer.model

    def write_adapter(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    adapter = write_dir_atomically(out / "adapter", write_adapter)
    paths = {"adapter_path": str(adapter)}
    if params.merge:
        io.stage("merging")
        merged = merged_model(io, model, params, model_dir, adapter)

        def write_merged(tmp: Path) -> None:
            merged.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)

        paths["merged_path"] = str(write_dir_atomically(out / "merged", write_merged))
    return paths


def train_and_save(io: JobIO, params: FinetuneParams, ctx: JobContext, out: Path,
                   save_requested: threading.Event, device: torch.device, comm: Comm) -> dict[str, Any]:
    """Train (resuming from the newest checkpoint) and, on rank 0, save the
    adapter and merged model: the whole job of one process or of one rank."""
    main = comm.is_main
    if main:
        io.stage("loading")
    peak = PeakMemory(device)
    model_dir = resolve_model_dir(params.model)
    prepared = prepare(io, params, model_dir, out / "checkpoints", device, comm)
    trainer = prepared.trainer
    resumed_from = 0
    checkpoint = newest_checkpoint(out / "checkpoints")
    if checkpoint is not None:
        resumed_from = trainer.restore(checkpoint).step
        if main:
            io.log(f"attempt {ctx.attempt}: resuming from {checkpoint.name} (step {resumed_from})")
    elif ctx.attempt > 1 and main:
        io.log(f"attempt {ctx.attempt}: no complete checkpoint yet, starting from step 0")
    hooks = JobHooks(io, save_requested, report=main)
    if main:
        io.stage("training")
    started = time.monotonic()
    if not _train(io, trainer, hooks, params):
        if trainer.stop_saves and trainer.state.step > trainer.last_saved:
            trainer.save(hooks)
        saved = f"; checkpoint at step {trainer.last_saved}" if trainer.last_saved else ""
        raise JobStopped(f"stopped on request at step {trainer.state.step}{saved}")
    seconds = time.monotonic() - started
    memory_line, memory = peak.report(prepared.estimate)
    counts = trainer.counts
    rank = {"rank": comm.rank, "device": str(device), "steps": counts.steps, "samples": counts.samples,
            "tokens": counts.tokens, "memory": memory}
    who = f"rank {comm.rank} of {comm.world} on {device}" if comm.world > 1 else f"trained on {device}"
    io.emit("log", message=f"{who}: {counts.steps} steps, {counts.samples} samples, {counts.tokens} tokens; "
            f"{memory_line}", rank=comm.rank, time=time.time())
    if not main:
        return {"rank": rank}
    st = trainer.state
    result: dict[str, Any] = {
        "output_dir": str(out),
        "steps": st.step,
        "resumed_from_step": resumed_from,
        "final_loss": st.loss,
        "train_tokens": st.tokens_seen,
        "train_seconds": round(st.train_seconds, 3),
        "tokens_per_s": round(st.tokens_seen / max(st.train_seconds, 1e-9), 1),
        "attempt_seconds": round(seconds, 3),
        "cpu_threads": _cpu_threads(),
        "gradient_checkpointing": prepared.checkpointing,
        "load_in_4bit": params.load_in_4bit,
        "world_size": comm.world,
        "memory": memory,
        "rank": rank,
    }
    result.update(_save_outputs(io, trainer, prepared.tokenizer, params, model_dir, out))
    return result


def run(io: JobIO, params: JobParams, ctx: JobContext) -> dict[str, Any]:
    if not isinstance(params, FinetuneParams):
        raise JobError("finetune needs FinetuneParams")
    save_requested = threading.Event()
    # Installed first: the runner's save-and-stop signal must never kill us.
    signal.signal(signal.SIGUSR1, lambda _s, _f: save_requested.set())
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    out = out_dir(params, ctx)
    world = params.world_size()
    if world > 1:
        from jobs.finetune_ddp import run_ranks

        result = run_ranks(io, params, ctx, out, world, save_requested)
    else:
        result = train_and_save(io, params, ctx, out, save_requested, default_device(), LocalComm())
        result.pop("rank")
    model_dir = resolve_model_dir(params.model)
    if params.export is not None:
        result["export"] = export_model(io, Path(result["merged_path"]), params.export,
                                        Path(ctx.models_dir), ctx.job_id)
    if params.export_adapter:
        target = Path(ctx.models_dir) / f"{adapter_stem(Path(result['adapter_path']))}.gguf"
        # The precision of the model export, when there is one: the pair then
        # computes as the merged model does.
        outtype = params.export.outtype if params.export is not None else "F16"
        result["adapter_export"] = export_adapter(io, Path(result["adapter_path"]), model_dir, target,
                                                  outtype, params.overwrite, ctx.job_id)
    return result
