"""Queueing one request on a worker, and waiting for a loading worker's facts.

The worker-side refusals become typed :mod:`supervisor.errors` exceptions
here, before any output: a caller whose requests keep crashing workers (429,
supervisor/workers/crash_keys.py), a request that crashed the worker twice (400), a
full queue or a model that is not accepting (503), a failed model (its load
failed; load it again to retry). The pool checks the GPU lease first.
"""

from __future__ import annotations

from supervisor.errors import BadRequest, ModelFailed, Unavailable
from supervisor.workers.crash_keys import KeyCrashes
from supervisor.workers.handle import NotAccepting, WorkerHandle, WorkerState
from supervisor.workers.poison import PoisonTracker, fingerprint
from supervisor.workers.queue import Pending, QueueFull
from worker import protocol as p


def submit(handle: WorkerHandle, msg: p.Generate | p.Embed | p.Tokenize, poison: PoisonTracker,
           keys: KeyCrashes | None = None, caller: str = "") -> Pending:
    """Queue ``msg`` for ``caller`` on the worker, or raise the refusal as an API error."""
    if keys is not None:
        keys.check(caller)
    # No fingerprint is taken (a hash of the whole prompt) until a crash was seen.
    if poison and poison.is_poison(fingerprint(handle.spec.model_id, msg)):
        raise BadRequest(
            f"this request crashed the model worker of '{handle.spec.model_id}' twice; "
            "it is refused so that it cannot take the model down for others", code="request_crashed_worker")
    try:
        return handle.submit(msg, caller)
    except QueueFull as exc:
        raise Unavailable(str(exc), retry_after=2, code="queue_full") from exc
    except NotAccepting as exc:
        if exc.state is WorkerState.FAILED:
            raise ModelFailed(f"model '{handle.spec.model_id}' failed: {exc.reason}; "
                              f"load it again to retry (POST /api/models/{handle.spec.model_id}/load)") from exc
        raise Unavailable(f"model '{handle.spec.model_id}' is {exc.state.value}: {exc.reason}",
                          retry_after=5, code="model_unavailable") from exc


async def wait_facts(handle: WorkerHandle, model_id: str) -> p.ModelFacts:
    """The facts the worker reports once loaded; raises if it fails or stops first."""
    while handle.facts is None:
        if handle.state is WorkerState.FAILED:
            raise ModelFailed(f"model '{model_id}' failed: {handle.reason}; "
                              f"load it again to retry (POST /api/models/{model_id}/load)")
        if handle.state in (WorkerState.STOPPING, WorkerState.STOPPED):
            # Unloaded before it was ever ready: nothing will fill the facts in.
            raise Unavailable(f"model '{model_id}' was unloaded while it loaded",
                              retry_after=1, code="model_unavailable")
        handle.changed.clear()
        await handle.changed.wait()
    return handle.facts
