"""What a user key sees of the machine: its own work, not the internals.

A user key (one of several callers of a shared service) is shown its own
jobs and the models, but not the service's insides: the Python stack and
file paths in a failed job's log tail, a model worker's log, or which job of
which other caller holds the GPU (its id, kind and label). Admins, and
everyone when authentication is off, see everything as before.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from supervisor.errors import ApiError, BusyJob, DeviceBusy, NotFound, UpstreamError

# A traceback's frame line ("  File "/x/y.py", line 3, in f"), and the
# source line that follows it, indented deeper.
_FRAME = re.compile(r'^\s*File "[^"\n]*", line \d+(?:, in .*)?\n(?:[ \t]{4,}\S.*\n?)?', re.MULTILINE)
# An absolute path of two or more parts: shown by its last part only.
_PATH = re.compile(r"(?<![\w.~-])/(?:[\w.+-]+/)+([\w.+-]+)")
OTHERS_JOB = "another caller's job"
log = logging.getLogger("gpuvisor.api")
# How the lease names a job in a sentence ("held by job job_0123abcd... (sleep)").
_JOB_MENTION = re.compile(r"\bjob (job_[0-9a-f]{16})(?: \([^)]*\))?")


def scrub(text: str) -> str:
    """``text`` without stack frames, and with paths cut to their last part."""
    return _PATH.sub(r"\1", _FRAME.sub("", text))


# Worker error codes whose message is the engine's own text (a C++
# exception's what(): "std::bad_alloc", a file path): a user key gets a
# plain sentence instead, the log keeps the text under the request id.
ENGINE_TEXT_CODES = frozenset({"engine_error", "worker_error"})


def engine_error(err: ApiError, request_id: str) -> ApiError:
    """``err`` as a user key sees it: the engine's raw text replaced."""
    if not isinstance(err, UpstreamError) or err.code not in ENGINE_TEXT_CODES:
        return err
    log.warning("request %s: %s (shown to the caller without the engine's text)", request_id, err.message)
    shown = UpstreamError(f"the engine failed on this request; the service log has its reason "
                          f"under request id {request_id}", code=err.code, headers=err.headers)
    return shown


def job(view: dict[str, Any]) -> dict[str, Any]:
    """A job's API view as its (user key) owner sees it."""
    if isinstance(view.get("error"), str):
        view["error"] = scrub(view["error"])
    return view


OwnerOf = Callable[[str], Awaitable[str | None]]


def owner_reader(get: Callable[[str], Awaitable[Any]]) -> OwnerOf:
    """``owner_of(job_id)`` over a store's ``get`` (None for a job gone since)."""

    async def owner_of(job_id: str) -> str | None:
        try:
            found = await get(job_id)
        except NotFound:
            return None
        owner = getattr(found, "owner", None)
        return owner if isinstance(owner, str) else None

    return owner_of


class _Mine:
    """Whether a job is this caller's, each job's owner read once."""

    def __init__(self, me: str, owner_of: OwnerOf) -> None:
        self.me, self.owner_of = me, owner_of
        self._owners: dict[str, str | None] = {}

    async def __call__(self, job_id: str) -> bool:
        if job_id not in self._owners:
            self._owners[job_id] = await self.owner_of(job_id)
        return self._owners[job_id] == self.me

    async def sentence(self, text: str) -> str:
        """``text`` with every mention of another caller's job unnamed."""
        out, at = [], 0
        for m in _JOB_MENTION.finditer(text):
            out += [text[at:m.start()], m.group(0) if await self(m.group(1)) else OTHERS_JOB]
            at = m.end()
        return "".join([*out, text[at:]])


async def busy(exc: DeviceBusy, me: str, owner_of: OwnerOf) -> None:
    """A 503 gpu_busy as a user key sees it: another caller's job by its progress only."""
    mine = _Mine(me, owner_of)
    exc.message = await mine.sentence(exc.message)
    found = exc.job
    if found is not None and not await mine(found.id):
        exc.job = BusyJob("", "", OTHERS_JOB, found.state, found.progress, found.eta_s, found.jobs_waiting)


async def gpu(state: dict[str, Any], me: str, owner_of: OwnerOf) -> dict[str, Any]:
    """``/api/gpu`` with other callers' holders and waiters unnamed."""
    mine = _Mine(me, owner_of)

    async def describe(entry: dict[str, Any]) -> dict[str, Any]:
        if await mine(str(entry.get("job_id"))):
            return entry
        return {**entry, "job_id": None, "label": OTHERS_JOB}

    for device in state.get("devices", []):
        if device.get("holder"):
            device["holder"] = await describe(device["holder"])
        if isinstance(device.get("why"), str):
            device["why"] = await mine.sentence(device["why"])
        device["waiters"] = [w if await mine(w) else None for w in device.get("waiters", [])]
    state["waiters"] = [await describe(w) for w in state.get("waiters", [])]
    return state
