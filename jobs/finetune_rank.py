"""``python -m jobs.finetune_rank``: one data-parallel rank of a finetune job.

Started by the job process (:mod:`jobs.finetune_ddp`), never by the parent.
It speaks the job protocol to the job process: one JSON line on stdin
(the job's params, and its context with this rank's ``rank``, ``world``,
``store_port`` and ``out``), NDJSON events on stdout, the exit codes of
:mod:`jobs.context`. As a job does, it exits when its stdin closes, stops
at the next step boundary on SIGTERM, and checkpoints first on SIGUSR1.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from jobs.context import EXIT_FAILED, EXIT_OK, EXIT_STOPPED, EXIT_USAGE, JobContext, JobError, JobStopped
from jobs.events import JobIO
from jobs.finetune_params import FinetuneParams

if TYPE_CHECKING:
    import torch


class RankPlace(msgspec.Struct):
    rank: int
    world: int
    store_port: int
    out: str


def rank_device(rank: int, world: int) -> torch.device:
    """The r-th visible GPU, or the CPU where torch has no CUDA (simulated devices)."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count < world:
        raise JobError(f"the job booked {world} GPUs but sees {count} CUDA devices")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def _train(io: JobIO, params: FinetuneParams, ctx: JobContext, place: RankPlace,
           save_requested: threading.Event) -> dict[str, Any]:
    from jobs.finetune import train_and_save
    from jobs.finetune_dist import TorchComm
    from jobs.finetune_model import check_4bit

    device = rank_device(place.rank, place.world)
    if params.load_in_4bit:
        check_4bit(device)  # before joining: every rank fails the same way, at once
    comm = TorchComm(place.rank, place.world, place.store_port, device)
    result = train_and_save(io, params, ctx, Path(place.out), save_requested, device, comm)
    comm.close()
    return result


def main() -> int:
    save_requested = threading.Event()
    # First: the save-and-stop signal must never kill a rank.
    signal.signal(signal.SIGUSR1, lambda _s, _f: save_requested.set())
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    io = JobIO(stdin=sys.stdin.buffer, stdout=sys.stdout.buffer)
    try:
        job_input = io.read_input()
        params = msgspec.convert(job_input.params, FinetuneParams)
        ctx = msgspec.convert(job_input.context, JobContext)
        place = msgspec.convert(job_input.context, RankPlace)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        print(f"bad rank input: {exc}", file=sys.stderr)
        return EXIT_USAGE
    io.start_watchdogs()
    try:
        result = _train(io, params, ctx, place, save_requested)
    except JobStopped as exc:
        io.failed(str(exc))
        return EXIT_STOPPED
    except JobError as exc:
        io.failed(str(exc))
        return EXIT_FAILED
    except Exception as exc:  # noqa: BLE001 - a bug or a dead peer: report it, traceback to the log
        traceback.print_exc()
        io.failed(f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED
    io.done(result)
    return EXIT_OK


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # os._exit: do not wait for the stdin watchdog thread, which blocks on read;
    # nor for a process group whose peers may be gone.
    os._exit(code)
