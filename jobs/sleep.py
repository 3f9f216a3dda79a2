"""The ``sleep`` kind: N cheap steps with progress, for tests and benchmarks.

It can misbehave on purpose (exit, SIGKILL or SIGSTOP itself at a given
step, ignore SIGTERM) so the runner's failure paths are tested with a real
process.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from jobs.context import JobContext, JobError, check_stop
from jobs.events import JobIO
from jobs.params import JobParams, SleepParams


def _misbehave(how: str) -> None:
    sys.stdout.flush()
    if how == "exit":
        print("crashing on purpose: exit 3", file=sys.stderr, flush=True)
        os._exit(3)
    if how == "kill":
        print("crashing on purpose: SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "stop":
        # A hung process: no events and no keepalives until someone kills it.
        os.kill(os.getpid(), signal.SIGSTOP)


def run(io: JobIO, params: JobParams, ctx: JobContext) -> dict[str, object]:
    if not isinstance(params, SleepParams):
        raise JobError("sleep needs SleepParams")
    io.stage("sleeping")
    emitted = 0
    for step in range(params.steps):
        if not params.ignore_term:
            check_stop(io, f"at step {step}")
        if params.crash != "none" and step == params.crash_at_step:
            _misbehave(params.crash)
        if params.step_seconds:
            time.sleep(params.step_seconds)
        if params.log_lines:
            # Its log (stderr), for the tests of a log read while the job runs.
            print("\n".join(f"step {step + 1} line {n}" for n in range(params.log_lines)), file=sys.stderr,
                  flush=True)
        frac = (step + 1) / params.steps
        for i in range(params.events_per_step):
            # t: wall time at emission, for the SSE latency benchmark.
            io.progress(frac, step=step + 1, i=i, t=time.time())
            emitted += 1
    return {"steps": params.steps, "events": emitted}
