"""Finetune benchmark: training tokens/s of a finetune job under the job runner
against the very same training loop run in this process with no gpuvisor
around it (the cost of the job process, its events and the runner storing
them), and the HF -> GGUF conversion (+ Q8_0) time of the model.

The two sides alternate (A B A B ...). Besides whole-run tokens/s, each side
reports the median of its per-step tokens/s: a burst of load from a noisy
neighbour on the machine slows a few steps, not the median. Needs the
``train`` extra.

Run: python -m bench.finetune [--steps 60] [--rounds 2] [--hidden 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import io as _io
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from jobs.events import JobIO
from jobs.export import export_model
from jobs.finetune import build_trainer
from jobs.finetune_loop import NoHooks, StepStats
from jobs.finetune_params import ExportOptions, FinetuneParams
from jobs.hf_convert import convert
from jobs.kinds import validate_params
from jobs.params import ResolveContext
from tests.jobsupport import running_lab, wait_finished
from tests.tiny_hf import build_tiny_model, copy_model, write_chat_dataset


def _raw_params(steps: int) -> dict[str, Any]:
    return {
        "model": "bench-hf", "train": "qa.train.jsonl", "max_steps": steps, "learning_rate": 5e-3,
        "batch_size": 4, "gradient_accumulation_steps": 1, "save_steps": 10_000, "merge": False,
    }


class StepClock(NoHooks):
    """Records each step's (tokens, elapsed) as the job's progress events do."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []

    def on_step(self, stats: StepStats) -> None:
        self.steps.append((stats.tokens, stats.elapsed_s))


def step_rate(steps: list[tuple[int, float]]) -> float:
    """Median per-step tokens/s from (tokens, cumulative elapsed) pairs."""
    rates, last = [], 0.0
    for tokens, elapsed in steps:
        if elapsed > last:
            rates.append(tokens / (elapsed - last))
        last = elapsed
    return statistics.median(rates)


def in_process(base: Path, steps: int) -> tuple[float, float]:
    """(whole-run tokens/s, median step tokens/s) of the loop called directly."""
    params = FinetuneParams(
        **{**_raw_params(steps), "model": str(base / "models" / "bench-hf"),
           "train": str(base / "datasets" / "qa.train.jsonl")}
    )
    quiet = JobIO(stdin=_io.BytesIO(), stdout=_io.BytesIO())
    trainer, _ = build_trainer(quiet, params, Path(params.model), base / "inproc-ckpt")
    clock = StepClock()
    trainer.train(clock)
    return trainer.state.tokens_seen / trainer.state.train_seconds, step_rate(clock.steps)


async def through_runner(base: Path, steps: int, round_: int) -> tuple[float, float, float, float]:
    """(whole-run tokens/s, median step tokens/s, job wall s, parent CPU s while it ran)."""
    async with running_lab(base / f"lab{round_}") as lab:
        copy_model(base / "models" / "bench-hf", lab.roots.models, "bench-hf")
        write_chat_dataset(lab.roots.datasets / "qa.train.jsonl", repeats=8)
        params = validate_params("finetune", _raw_params(steps), ResolveContext(lab.roots))
        started, cpu = time.monotonic(), time.process_time()
        job, _ = await lab.runner.submit("finetune", params)
        done = await wait_finished(lab.store, job.id, timeout=1800)
        wall, cpu = time.monotonic() - started, time.process_time() - cpu
        events = await lab.store.events_after(job.id, 0, 100_000)
    if done.status != "succeeded" or done.result is None:
        raise RuntimeError(f"finetune job {done.status}: {done.error}")
    result = done.result
    steps_seen = [(e.data["tokens"], e.data["elapsed_s"]) for e in events
                  if e.type == "progress" and "tokens" in e.data]
    return result["train_tokens"] / result["train_seconds"], step_rate(steps_seen), wall, cpu


def conversion(base: Path) -> tuple[float, float]:
    """(seconds to convert to F16, seconds to convert + quantize Q8_0)."""
    src = base / "models" / "bench-hf"
    started = time.monotonic()
    convert(src, base / "bench-f16.gguf", "F16", "bench")
    f16 = time.monotonic() - started
    out = base / "gguf"
    out.mkdir()
    quiet = JobIO(stdin=_io.BytesIO(), stdout=_io.BytesIO())
    started = time.monotonic()
    export_model(quiet, src, ExportOptions(quantize="Q8_0"), out, "bench")
    return f16, time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny model")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads on both sides (spinning OpenMP threads collapse on a busy machine)")
    args = ap.parse_args()
    # Set before torch is imported here; job processes inherit the environment.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="gvbench") as tmp:
        base = Path(tmp)
        build_tiny_model(base / "models" / "bench-hf", hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden)
        write_chat_dataset(base / "datasets" / "qa.train.jsonl", repeats=8)
        direct, runner, walls, cpus = [], [], [], []
        for r in range(args.rounds):
            direct.append(in_process(base, args.steps))
            whole, median, wall, cpu = asyncio.run(through_runner(base, args.steps, r))
            runner.append((whole, median))
            walls.append(wall)
            cpus.append(cpu)
            print(f"round {r + 1}: in-process {direct[-1][0]:.0f} tok/s (step median "
                  f"{direct[-1][1]:.0f}), job {whole:.0f} tok/s (step median {median:.0f}); "
                  f"job wall {wall:.1f} s, parent CPU {cpu:.2f} s")
        f16, q8 = conversion(base)
    for i, what in ((0, "whole-run"), (1, "per-step median")):
        d = statistics.median(x[i] for x in direct)
        j = statistics.median(x[i] for x in runner)
        print(f"training tokens/s, {what}: in-process {d:.0f}, through the job runner {j:.0f}, "
              f"ratio {j / d:.3f} (target >= 0.95)")
    print(f"job wall time (process start, model load, {args.steps} steps, save): "
          f"{statistics.median(walls):.1f} s; parent CPU meanwhile (runner, SQLite, events): "
          f"{statistics.median(cpus):.2f} s")
    print(f"conversion of the tiny model: HF -> GGUF F16 {f16 * 1000:.0f} ms; "
          f"-> F16 + Q8_0 {q8 * 1000:.0f} ms")


if __name__ == "__main__":
    main()
