"""Data-parallel fine-tuning: the job process starts one rank per booked
device and owns them.

Decided: the ranks are ``torch.distributed`` processes that this job
process starts itself (``python -m jobs.finetune_rank``), not through
``torchrun`` or ``accelerate launch``. Both launchers put an agent process
between the job and its ranks that hides their pids and exit codes, and
handles signals its own way (torchrun's agent dies on SIGUSR1, the runner's
save-and-stop signal, and neither forwards it). Here the job process is
the agent: it holds the rendezvous (a ``TCPStore`` on a free loopback port,
so no port is guessed), sees each rank's exit at once and why, forwards
stop requests, and kills the rest when one fails. ``accelerate`` would also
read a user's saved ``accelerate config`` and change what a job does
behind its params.

How devices map to ranks: a job that books N devices runs N ranks; rank
``r`` trains on the r-th visible CUDA device (every rank sees all the job's
GPUs, which NCCL needs for peer-to-peer copies) over NCCL. Where torch has
no CUDA (a machine without a GPU whose lease lists configured device ids,
as tests do) the N ranks train on the CPU over gloo, one per booked device,
sharing the cores: ``OMP_NUM_THREADS`` (when unset) gives each a share.

What comes back: rank 0's events are the job's own (stages, progress,
evals, checkpoints); the other ranks' logs are forwarded marked with their
rank; each rank's ``done`` result (its steps, samples, tokens and memory
peak) goes into the job's result under ``ranks``. Rank 0 alone writes
checkpoints and the adapter and merged model. Any rank that fails fails the
job with that rank's reason; the others are killed then, since they would
wait for it in their next all-reduce.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec

from jobs.context import EXIT_OK, EXIT_STOPPED, JobContext, JobError, JobStopped
from jobs.events import Done, Failed, JobEvent, JobIO, Log, Started, event_type
from jobs.finetune_params import FinetuneParams

_MAX_FORWARDED_LINE = 2000


@dataclass
class Rank:
    index: int
    proc: subprocess.Popen[bytes]
    result: dict[str, Any] | None = None
    error: str | None = None
    reader: threading.Thread | None = field(default=None, repr=False)

    def reason(self, rc: int) -> str:
        if self.error:
            return self.error
        if rc < 0:
            return f"killed by {signal.Signals(-rc).name}"
        return f"exited with code {rc} (its traceback is in the job's log)"


def _rank_env(world: int, rank: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    if "OMP_NUM_THREADS" not in env:
        cores = len(os.sched_getaffinity(0))
        env["OMP_NUM_THREADS"] = str(max(1, cores // world))
    return env


def _spawn(index: int, world: int, line: bytes) -> Rank:
    # Same process group as the job: the runner's signals and its final
    # kill of the group reach the ranks too; stdin stays open, and its EOF
    # (this process gone) makes a rank exit.
    proc = subprocess.Popen([sys.executable, "-m", "jobs.finetune_rank"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=_rank_env(world, index))
    assert proc.stdin is not None
    proc.stdin.write(line + b"\n")
    proc.stdin.flush()
    return Rank(index, proc)


def _forward(io: JobIO, rank: Rank, event: JobEvent) -> None:
    match event:
        case Done():
            rank.result = event.result
        case Failed():
            rank.error = event.error
        case Started():
            pass  # the job itself said it started
        case Log() if rank.index != 0:
            data = dict(event.data)
            if "rank" not in data:
                data["message"] = f"rank {rank.index}: {event.message}"
                data["rank"] = rank.index
            io.emit("log", **data)
        case _ if rank.index == 0:
            io.emit(event_type(event), **event.data)


def _pump(io: JobIO, rank: Rank, exits: queue.Queue[tuple[int, int]]) -> None:
    """Forward one rank's events until its stdout ends, then report its exit."""
    decoder = msgspec.json.Decoder(JobEvent)
    stdout: IO[bytes] | None = rank.proc.stdout
    assert stdout is not None
    for raw in stdout:
        line = raw.strip()
        if not line:
            continue
        try:
            event = decoder.decode(line)
        except msgspec.DecodeError:
            # Something in the rank printed to stdout: keep it, as a log line.
            text = line[:_MAX_FORWARDED_LINE].decode("utf-8", "replace")
            io.emit("log", message=f"rank {rank.index}: {text}", rank=rank.index)
            continue
        _forward(io, rank, event)
    exits.put((rank.index, rank.proc.wait()))


def _stop_signal(io: JobIO, save_requested: threading.Event) -> signal.Signals | None:
    if save_requested.is_set():
        return signal.SIGUSR1
    return signal.SIGTERM if io.stop_requested else None


def _supervise(io: JobIO, ranks: list[Rank], save_requested: threading.Event,
               exits: queue.Queue[tuple[int, int]]) -> dict[int, int]:
    """Wait for every rank; raise as soon as one fails. Returns exit codes."""
    codes: dict[int, int] = {}
    forwarded: signal.Signals | None = None
    while len(codes) < len(ranks):
        sig = _stop_signal(io, save_requested)
        if sig is not None and sig != forwarded:
            # The runner signals the whole group; this covers a signal sent
            # to the job process alone.
            for r in ranks:
                if r.index not in codes:
                    r.proc.send_signal(sig)
            forwarded = sig
        try:
            index, rc = exits.get(timeout=0.2)
        except queue.Empty:
            continue
        codes[index] = rc
        # A stop signal that came before the rank's handlers were in place
        # ended it by default: stopped, not failed.
        stopped_early = forwarded is not None and rc in (-signal.SIGTERM, -signal.SIGUSR1)
        if rc in (EXIT_OK, EXIT_STOPPED) or stopped_early:
            continue
        raise JobError(f"rank {index} of {len(ranks)} failed: {ranks[index].reason(rc)}")
    return codes


def _kill_all(ranks: list[Rank]) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.kill()
    for r in ranks:
        r.proc.wait()
        if r.proc.stdin is not None:
            r.proc.stdin.close()
        if r.reader is not None:
            r.reader.join(timeout=10)


def run_ranks(io: JobIO, params: FinetuneParams, ctx: JobContext, out: Path, world: int,
              save_requested: threading.Event) -> dict[str, Any]:
    """Train on ``world`` ranks; rank 0's result, with every rank's counts."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in __all__

    store = TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    effective = params.batch_size * params.gradient_accumulation_steps * world
    io.log(f"data-parallel on {world} devices: {world} ranks, each with batch_size {params.batch_size} "
           f"x gradient_accumulation_steps {params.gradient_accumulation_steps}: {effective} samples a step")
    base = {"params": msgspec.to_builtins(params), "context": msgspec.to_builtins(ctx)}
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    ranks: list[Rank] = []
    try:
        for index in range(world):
            extra = {"rank": index, "world": world, "store_port": store.port, "out": str(out)}
            line = msgspec.json.encode({**base, "context": {**base["context"], **extra}})
            rank = _spawn(index, world, line)
            rank.reader = threading.Thread(target=_pump, args=(io, rank, exits), name=f"rank-{index}",
                                           daemon=True)
            rank.reader.start()
            ranks.append(rank)
        codes = _supervise(io, ranks, save_requested, exits)
    finally:
        _kill_all(ranks)
    if any(rc != EXIT_OK for rc in codes.values()):
        raise JobStopped(ranks[0].error or "stopped on request")
    first = ranks[0].result
    if first is None or any(r.result is None for r in ranks):
        raise JobError("a rank ended without its result")
    first["ranks"] = [(r.result or {}).get("rank") for r in ranks]
    first["world_size"] = world
    first.pop("rank", None)
    return first
