"""A run as ``code_interpreter_call`` outputs (OpenAI's Responses types).

``logs``: stdout, then stderr, each bounded by the runner, with a line that
says what was cut, how the run ended (a limit, the wall clock) and what it
could not set up. ``image``: each image file the run wrote, as a data URL,
up to ``max_image_bytes`` (a larger one is only named in the logs). Every
file written, image or not, is also listed in the logs by name and size, so
the model knows what it made.
"""

from __future__ import annotations

import base64
import signal
from typing import Any, Literal

from supervisor.sandbox.containers import CodeRun, Container, ContainerError

IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif",
               ".webp": "image/webp"}
MAX_IMAGES = 8


def _ending(run: CodeRun, wall_s: float) -> str | None:
    result = run.result
    if result.setup_error is not None:
        return f"[sandbox could not be set up: {result.setup_error}]"
    if result.timed_out:
        return f"[killed: the run passed its wall clock of {wall_s:g} s]"
    code = result.exit_code
    if code is not None and code > 128:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            name = f"signal {code - 128}"
        hint = " (CPU time limit)" if name == "SIGXCPU" else ""
        return f"[killed by {name}{hint}]"
    if code not in (0, None):
        return f"[exit status {code}]"
    return None


def logs_text(run: CodeRun, wall_s: float) -> str:
    result = run.result
    parts = [result.stdout]
    if result.stdout_truncated:
        parts.append("\n[stdout truncated]\n")
    if result.stderr:
        parts.append(result.stderr)
        if result.stderr_truncated:
            parts.append("\n[stderr truncated]\n")
    ending = _ending(run, wall_s)
    if ending is not None:
        parts.append(ending + "\n")
    if run.files:
        listed = ", ".join(f"{f.name} ({f.bytes} bytes)" for f in run.files)
        more = " and more" if run.files_truncated else ""
        parts.append(f"[files written: {listed}{more}]\n")
    return "".join(parts)


def call_outputs(run: CodeRun, container: Container, *, wall_s: float,
                 max_image_bytes: int = 4 << 20) -> list[dict[str, Any]]:
    """The ``outputs`` of a ``code_interpreter_call`` item."""
    outputs: list[dict[str, Any]] = [{"type": "logs", "logs": logs_text(run, wall_s)}]
    images = [f for f in run.files if "." + f.name.rsplit(".", 1)[-1].lower() in IMAGE_TYPES]
    for info in images[:MAX_IMAGES]:
        if info.bytes > max_image_bytes:
            continue
        try:
            data = container.read(info.name, max_image_bytes)
        except ContainerError:
            # Replaced by a link or removed since the listing: not shown.
            continue
        mime = IMAGE_TYPES["." + info.name.rsplit(".", 1)[-1].lower()]
        outputs.append({"type": "image", "url": f"data:{mime};base64,{base64.b64encode(data).decode()}"})
    return outputs


def call_status(run: CodeRun) -> Literal["completed", "incomplete", "failed"]:
    """``completed`` when the code ran to its end (even with an error of its
    own), ``incomplete`` when a limit ended it, ``failed`` when it never ran."""
    result = run.result
    if result.setup_error is not None:
        return "failed"
    if result.timed_out or (result.exit_code is not None and result.exit_code > 128):
        return "incomplete"
    return "completed"
