"""The LoRA training loop, free of any job plumbing.

:class:`Trainer` runs optimizer steps over a :class:`~jobs.finetune_data.Schedule`
and reports through :class:`Hooks`; the ``finetune`` job turns the hooks into
events, and the benchmark runs the very same loop in-process with no hooks
to measure what the job runner costs. The learning rate is a pure function
of the step and the data order a pure function of the seed, so a run resumed
from a checkpoint continues exactly where it stopped.

Data-parallel ranks (:mod:`jobs.finetune_dist`) each run this loop on their
share of every step's micro-batches. Every rank divides its summed token
loss by the labelled tokens of the whole step (all ranks' micro-batches;
the schedule tells each rank that count without asking the others), so the
summed gradients are the one mean-token-loss gradient of the single-process
loop, whatever the split.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from jobs.finetune_ckpt import TrainState, load_checkpoint, save_checkpoint
from jobs.finetune_data import IGNORE, Example, Schedule, collate
from jobs.finetune_dist import Comm, LocalComm
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
    def save_on_stop(self) -> bool: ...


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

    def save_on_stop(self) -> bool:
        return False


@dataclass
class RankCounts:
    """What this rank itself trained on (the step stats are all ranks')."""

    steps: int = 0
    samples: int = 0
    tokens: int = 0


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
        pad_id: int, device: torch.device, checkpoints: Path, comm: Comm | None = None,
    ) -> None:
        import torch

        self.comm: Comm = comm if comm is not None else LocalComm()
        self.model = model
        self.params = params
        self.train_set = train
        self.eval_set = evals
        self.pad_id = pad_id
        self.device = device
        self.checkpoints = checkpoints
        self.schedule = Schedule(len(train), params.batch_size, params.gradient_accumulation_steps,
                                 params.seed, self.comm.world)
        self.total = self.schedule.total_steps(params.epochs, params.max_steps)
        # Labelled tokens the loss counts per example (the first token predicts nothing).
        self._targets = [sum(1 for x in e.labels[1:] if x != IGNORE) for e in train]
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.comm.sync_params(self.trainable)
        self.optimizer = torch.optim.AdamW(self.trainable, lr=params.learning_rate,
                                           weight_decay=params.weight_decay)
        self.state = TrainState(0, self.total, 0.0, None, 0, 0.0)
        self.last_saved = 0
        self.counts = RankCounts()
        # Set when the ranks agreed to stop: whether a checkpoint was asked for.
        self.stop_saves = False

    # ------------------------------------------------------------ checkpoints

    def restore(self, path: Path) -> TrainState:
        saved = load_checkpoint(path, self.model, self.optimizer)
        self.state = TrainState(saved.step, self.total, saved.epoch, saved.loss,
                                saved.tokens_seen, saved.train_seconds)
        self.last_saved = saved.step
        return self.state

    def save(self, hooks: Hooks) -> None:
        """A checkpoint of this step, written once: by rank 0 (all ranks hold
        the same weights and optimizer state)."""
        self.last_saved = self.state.step
        if self.comm.is_main:
            path = save_checkpoint(self.checkpoints, self.model, self.optimizer, self.state,
                                   self.params.save_total_limit)
            hooks.on_checkpoint(self.state.step, path)

    # ------------------------------------------------------------ steps

    def _batch_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Summed token loss over labelled tokens, and their count."""
        import torch.nn.functional as F

        batch = {k: v.to(self.device) for k, v in batch.items()}
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            use_cache=False).logits
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
            ignore_index=IGNORE, reduction="sum",
        )
        return loss, int((labels != IGNORE).sum())

    def _step(self, step: int) -> tuple[float, int]:
        """One optimizer step; returns (mean token loss, tokens processed), of all ranks."""
        import torch

        every = self.schedule.micro_batches(step)
        n_labels = max(1, sum(self._targets[i] for idx in every for i in idx))
        mine = [[self.train_set[i] for i in idx] for idx in every[self.comm.rank :: self.comm.world]]
        batches = [collate(g, self.pad_id) for g in mine if g]
        lr = lr_at(self.params, step, self.total)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total_loss, tokens = 0.0, 0
        for batch in batches:
            loss, _ = self._batch_loss(batch)
            (loss / n_labels).backward()  # type: ignore[no-untyped-call]
            total_loss += float(loss.detach())
            tokens += int(batch["attention_mask"].sum())
        samples = sum(len(g) for g in mine)
        self.counts.steps += 1
        self.counts.samples += samples
        self.counts.tokens += tokens
        total_loss, all_tokens, _ = self.comm.reduce_step(self.trainable, [total_loss, tokens, samples])
        if self.params.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.trainable, self.params.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total_loss / n_labels, int(round(all_tokens))

    def evaluate(self) -> float:
        import torch

        self.model.eval()
        total, count = 0.0, 0
        bs = self.params.batch_size
        starts = range(0, len(self.eval_set), bs)
        with torch.no_grad():
            for i in starts[self.comm.rank :: self.comm.world]:
                loss, n = self._batch_loss(collate(self.eval_set[i : i + bs], self.pad_id))
                total, count = total + float(loss), count + n
        self.model.train()
        summed, labelled = self.comm.sum([total, count])
        return summed / max(1.0, labelled)

    # ------------------------------------------------------------ loop

    def train(self, hooks: Hooks) -> bool:
        """Run to the last step; False when stopped early by ``hooks``."""
        self.model.train()
        start_step, start_tokens = self.state.step, self.state.tokens_seen
        base_seconds = self.state.train_seconds
        started = time.monotonic()
        while self.state.step < self.total:
            # Every rank stops at the same step boundary, or one would wait forever.
            stop, save = self.comm.any([hooks.should_stop(), hooks.save_on_stop()])
            if stop:
                self.stop_saves = save
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
