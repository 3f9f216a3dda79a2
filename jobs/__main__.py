"""``python -m jobs <kind>``: run one job in this process.

Reads ``{"params", "context"}`` from the first stdin line, writes NDJSON events
to stdout (see :mod:`jobs.events`) and exits with a code from
:mod:`jobs.context`. Besides events it writes a bare newline every
``keepalive_s`` seconds: the runner counts it as a heartbeat and stores
nothing, so a long native step (quantizing) is not mistaken for a hang.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import traceback
from typing import IO, Protocol

import msgspec

from jobs.context import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_USAGE,
    JobContext,
    JobError,
    JobStopped,
)
from jobs.events import JobIO
from jobs.kinds import job_kinds, stored_params
from jobs.params import JobParams


class JobModule(Protocol):
    def run(self, io: JobIO, params: JobParams, ctx: JobContext) -> dict[str, object]: ...


def _keepalive(out: IO[bytes], interval: float, stop: threading.Event) -> None:
    # BufferedWriter.write is atomic per call, so a bare newline never splits
    # an event line written by JobIO from another thread.
    while not stop.wait(interval):
        try:
            out.write(b"\n")
            out.flush()
        except (OSError, ValueError):
            return


def run_job(kind: str, io: JobIO, stdout: IO[bytes]) -> int:
    spec = job_kinds(include_test=True)[kind]
    try:
        # Read the input before the stdin watchdog starts consuming the pipe.
        job_input = io.read_input()
        params = stored_params(spec, job_input.params)
        ctx = msgspec.convert(job_input.context, JobContext)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        print(f"bad job input: {exc}", file=sys.stderr)
        return EXIT_USAGE
    io.start_watchdogs()
    stop = threading.Event()
    threading.Thread(
        target=_keepalive, args=(stdout, ctx.keepalive_s, stop), name="keepalive", daemon=True
    ).start()
    module: JobModule = importlib.import_module(spec.module)
    io.emit("started", kind=kind, pid=os.getpid())
    try:
        result = module.run(io, params, ctx)
    except JobStopped as exc:
        io.failed(str(exc))
        return EXIT_STOPPED
    except JobError as exc:
        io.failed(str(exc))
        return EXIT_FAILED
    except Exception as exc:  # noqa: BLE001 - a bug in a kind: report it, traceback to the log
        traceback.print_exc()
        io.failed(f"{type(exc).__name__}: {exc}")
        return EXIT_FAILED
    finally:
        stop.set()
    io.done(result)
    return EXIT_OK


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in job_kinds(include_test=True):
        print(f"usage: python -m jobs {{{','.join(sorted(job_kinds(include_test=True)))}}}", file=sys.stderr)
        return EXIT_USAGE
    stdout = sys.stdout.buffer
    io = JobIO(stdin=sys.stdin.buffer, stdout=stdout)
    return run_job(argv[1], io, stdout)


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    # os._exit: do not wait for the stdin watchdog thread, which blocks on read.
    os._exit(code)
