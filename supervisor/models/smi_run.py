"""Running a GPU tool (``amd-smi``, ``rocm-smi``) bounded in time and output.

A driver tool can hang (a GPU in a bad state), print without end, or leave a
child holding its stdout open after it exited. :func:`run_tool` gives up at a
deadline or past an output limit, kills the tool's whole process group, and
raises what ``subprocess.run`` would: ``FileNotFoundError`` when the tool is
not installed, ``TimeoutExpired`` or ``CalledProcessError`` otherwise, and
:class:`OutputTooLarge` past the limit.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence

MAX_OUTPUT = 4 * 1024 * 1024  # a hundred GPUs' JSON is well under 1 MiB


class OutputTooLarge(subprocess.SubprocessError):
    """The tool printed more than a reading can be."""


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone, group and all
    proc.wait()


def run_tool(argv: Sequence[str], timeout: float, limit: int = MAX_OUTPUT) -> str:
    """The tool's stdout (decoded leniently) once it exited 0 within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    assert proc.stdout is not None  # stdout=PIPE
    chunks: list[bytes] = []
    size = 0
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(list(argv), timeout)
                if not sel.select(left):
                    continue
                data = os.read(proc.stdout.fileno(), 65536)
                if not data:
                    break
                size += len(data)
                if size > limit:
                    raise OutputTooLarge(f"{argv[0]} printed more than {limit} bytes")
                chunks.append(data)
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(list(argv), timeout) from None
    except BaseException:
        _kill(proc)
        raise
    finally:
        proc.stdout.close()
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, list(argv))
    return b"".join(chunks).decode(errors="replace")
