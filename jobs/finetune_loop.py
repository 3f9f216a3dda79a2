"""The LoRA training loop, free of any job plumbing.

:class:`Trainer` runs optimizer steps over a :class:`~jobs.finetune_data.Schedule`
and reports through :class:`Hooks`; the ``finetune`` job turns the hooks into
events, and the benchmark runs the very same loop in-process with no hooks
to measure what the job runner costs. The learning rate is a pure function
of the step and the data order a pure function of the seed, so a run resumed
from a checkpoint continues exactly where it stopped.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from jobs.finetune_ckpt import TrainState, load_checkpoint, save_checkpoint
from jobs.finetune_data import IGNORE, Example, Schedule, collate
from jobs.finetune_params import FinetuneParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StepStats:
    step: int
    total_steps: int
    epoch: float
    loss: float
    lr: float
    tokens: int
    tokens_per_s: float
    elapsed_s: float
    eta_s: float


class Hooks(Protocol):
    def on_step(self, stats: StepStats) -> None: ...
    def on_eval(self, step: int, loss: float) -> None: ...
    def on_checkpoint(self, step: int, path: Path) -> None: ...
    def should_stop(self) -> bool: ...


class NoHooks:
    """Reports nothing and never stops (benchmarks, in-process use)."""

    def on_step(self, stats: StepStats) -> None:
        pass

    def on_eval(self, step: int, loss: float) -> None:
        pass

    def on_checkpoint(self, step: int, path: Path) -> None:
        pass

    def should_stop(self) -> bool:
        return False


def lr_at(params: FinetuneParams, step: int, total: int) -> float:
    """Learning rate of 0-based optimizer step ``step``."""
    warmup = math.ceil(total * params.warmup_ratio)
    if step < warmup:
        return params.learning_rate * (step + 1) / warmup
    if params.lr_scheduler == "constant":
        return params.learning_rate
    progress = (step - warmup) / max(1, total - warmup)
    if params.lr_scheduler == "cosine":
        return params.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))
    return params.learning_rate * (1.0 - progress)


class Trainer:
    def __init__(
        self, model: Any, params: FinetuneParams, train: list[Example], evals: list[Example],
        pad_id: int, device: torch.device, checkpoints: Path,
    ) -> None:
        import torch

        self.model = model
        self.params = params
        self.train_set = train
        self.eval_set = evals
        self.pad_id = pad_id
        self.device = device
        self.checkpoints = checkpoints
        self.schedule = Schedule(len(train), params.batch_size, params.gradient_accumulation_steps, params.seed)
        self.total = self.schedule.total_steps(params.epochs, params.max_steps)
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=params.learning_rate, weight_decay=params.weight_decay)
        self.state = TrainState(0, self.total, 0.0, None, 0, 0.0)
        self.last_saved = 0

    # ------------------------------------------------------------ checkpoints

    def restore(self, path: Path) -> TrainState:
        saved = load_checkpoint(path, self.model, self.optimizer)
        self.state = TrainState(saved.step, self.total, saved.epoch, saved.loss,
                                saved.tokens_seen, saved.train_seconds)
        self.last_saved = saved.step
        return self.state

    def save(self, hooks: Hooks) -> Path:
        path = save_checkpoint(self.checkpoints, self.model, self.optimizer, self.state,
                               self.params.save_total_limit)
        self.last_saved = self.state.step
        hooks.on_checkpoint(self.state.step, path)
        return path

    # ------------------------------------------------------------ steps

    def _batch_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Summed token loss over labelled tokens, and their count."""
        import torch.nn.functional as F

        batch = {k: v.to(self.device) for k, v in batch.items()}
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
            ignore_index=IGNORE, reduction="sum",
        )
        return loss, int((labels != IGNORE).sum())

    def _step(self, step: int) -> tuple[float, int]:
        """One optimizer step; returns (mean token loss, tokens processed)."""
        import torch

        groups = [[self.train_set[i] for i in idx] for idx in self.schedule.micro_batches(step)]
        batches = [collate(g, self.pad_id) for g in groups if g]
        n_labels = max(1, sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches))
        lr = lr_at(self.params, step, self.total)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total_loss, tokens = 0.0, 0
        for batch in batches:
            loss, _ = self._batch_loss(batch)
            (loss / n_labels).backward()  # type: ignore[no-untyped-call]
            total_loss += float(loss.detach())
            tokens += int(batch["attention_mask"].sum())
        if self.params.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], self.params.max_grad_norm
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total_loss / n_labels, tokens

    def evaluate(self) -> float:
        import torch

        self.model.eval()
        total, count = 0.0, 0
        bs = self.params.batch_size
        with torch.no_grad():
            for i in range(0, len(self.eval_set), bs):
                loss, n = self._batch_loss(collate(self.eval_set[i : i + bs], self.pad_id))
                total, count = total + float(loss), count + n
        self.model.train()
        return total / max(1, count)

    # ------------------------------------------------------------ loop

    def train(self, hooks: Hooks) -> bool:
        """Run to the last step; False when stopped early by ``hooks``."""
        self.model.train()
        start_step, start_tokens = self.state.step, self.state.tokens_seen
        base_seconds = self.state.train_seconds
        started = time.monotonic()
        while self.state.step < self.total:
            if hooks.should_stop():
                return False
            loss, tokens = self._step(self.state.step)
            elapsed = time.monotonic() - started
            st = self.state
            st.step, st.loss, st.tokens_seen = st.step + 1, loss, st.tokens_seen + tokens
            st.epoch, st.train_seconds = self.schedule.epoch_at(st.step), base_seconds + elapsed
            done = st.step - start_step
            hooks.on_step(StepStats(
                st.step, self.total, st.epoch, loss, lr_at(self.params, st.step - 1, self.total),
                tokens, (st.tokens_seen - start_tokens) / max(elapsed, 1e-9), st.train_seconds,
                (self.total - st.step) * elapsed / done,
            ))
            self._maybe_eval(hooks)
            if st.step % self.params.save_steps == 0 and st.step < self.total:
                self.save(hooks)
        return True

    def _maybe_eval(self, hooks: Hooks) -> None:
        if not self.eval_set:
            return
        every = self.params.eval_steps
        if self.state.step == self.total or (every is not None and self.state.step % every == 0):
            hooks.on_eval(self.state.step, self.evaluate())
