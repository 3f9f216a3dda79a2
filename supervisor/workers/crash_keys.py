"""Crashes counted by who asked: one caller's crashing requests must not fail
a model for everybody, whatever bytes they change between tries.

Poison fingerprints (supervisor/workers/poison.py) hash what a request asks
the worker to read, so a crasher changed by one byte is a new request: the
first crasher and four one-byte variants made five crashes in a minute, and
the model went ``failed`` for everyone. So crashes are also counted by
*caller*: the API key a request came with (the admin token is one caller),
or the client's address (its /64 for IPv6) when authentication is off.

The rule:

- A crash is blamed on the callers that had requests in flight, shared
  evenly between them (a caller alone in flight takes a whole crash). Who
  caused it cannot be told; a caller that keeps being there can.
- A caller blamed for :data:`KEY_CRASH_LIMIT` crashes within ``window``
  seconds is refused (429 ``crash_cooldown``, with Retry-After) on every
  model, until enough of that blame is older than ``window``.
- A crash counts toward the model's crash limit only if nobody in flight
  was blamed before: with a caller blamed for an earlier crash in flight,
  that caller takes it, not the model (and, as before, a crash with only
  repeated suspect requests in flight does not count either). So one
  caller's crashes count toward a model's limit once per window, and a
  model still ends ``failed`` when it crashes on fresh callers' traffic or
  with nothing in flight.

Requests the parent makes for itself (no caller) are never blamed or refused.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence

from supervisor.errors import NO_RETRY, ApiError
from supervisor.workers.poison import PoisonTracker, fingerprint
from supervisor.workers.queue import Pending

KEY_CRASH_LIMIT = 3
WINDOW_S = 600.0
MAX_CALLERS = 10_000
# Shares of a crash are fractions of one: summed, they may miss a whole by a rounding error.
_EPSILON = 1e-9


class CrashCooldown(ApiError):
    """429: this caller's requests keep crashing model workers."""

    status = 429
    type = "requests"
    code = "crash_cooldown"

    def __init__(self, message: str, *, retry_after: int) -> None:
        # No automatic retries: they would be refused again until the cooldown ends.
        super().__init__(message, headers={"Retry-After": str(retry_after), **NO_RETRY})
        self.retry_after = retry_after


class KeyCrashes:
    """The crashes each caller was blamed for in the last ``window`` seconds."""

    def __init__(self, limit: int = KEY_CRASH_LIMIT, window: float = WINDOW_S,
                 max_callers: int = MAX_CALLERS, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window = window
        self.max_callers = max_callers
        self.clock = clock
        # caller -> (time, share) of each crash it was blamed for, oldest first;
        # callers in the order they were last blamed.
        self._blame: dict[str, deque[tuple[float, float]]] = {}

    def _current(self, caller: str, now: float) -> deque[tuple[float, float]]:
        entries = self._blame.get(caller)
        if entries is None:
            return deque()
        while entries and now - entries[0][0] >= self.window:
            entries.popleft()
        if not entries:
            del self._blame[caller]
        return entries

    def blame(self, caller: str) -> float:
        """The crashes ``caller`` is blamed for in the window."""
        return sum(share for _, share in self._current(caller, self.clock()))

    def crashed(self, callers: Sequence[str]) -> None:
        """Share one crash between the distinct ``callers`` in flight."""
        distinct = sorted(set(c for c in callers if c))
        if not distinct:
            return
        now = self.clock()
        share = 1.0 / len(distinct)
        for caller in distinct:
            entries = self._current(caller, now)
            entries.append((now, share))
            self._blame.pop(caller, None)
            self._blame[caller] = entries  # most recently blamed last
        while len(self._blame) > self.max_callers:
            del self._blame[next(iter(self._blame))]

    def retry_after(self, caller: str) -> int | None:
        """Seconds until ``caller`` may send again; None when it is not refused."""
        if not caller or self.limit <= 0:  # no caller, or refusal per caller is off
            return None
        now = self.clock()
        entries = self._current(caller, now)
        total = sum(share for _, share in entries)
        if total < self.limit - _EPSILON:
            return None
        # Refused until the oldest shares expire and the rest falls below the limit.
        for when, share in entries:
            total -= share
            if total < self.limit - _EPSILON:
                break
        return max(1, math.ceil(when + self.window - now))

    def check(self, caller: str) -> None:
        """Raise :class:`CrashCooldown` while ``caller`` is refused."""
        wait = self.retry_after(caller)
        if wait is not None:
            raise CrashCooldown(
                f"requests from this caller were in flight when model workers crashed {self.limit} times "
                f"in the last {self.window:.0f} s; they are refused for {wait} s so that they cannot take "
                "models down for others", retry_after=wait)


def crash_counts(poison: PoisonTracker, keys: KeyCrashes, model_id: str, in_flight: Sequence[Pending]) -> bool:
    """Record a crash of ``model_id``'s worker with ``in_flight``; True when it
    counts toward the model's crash limit (see the module's rule)."""
    callers = [pend.caller for pend in in_flight]
    # With refusal per caller off, the model's own crash limit is the only guard.
    blamed_before = keys.limit > 0 and any(caller and keys.blame(caller) > 0 for caller in callers)
    # The poison rule: fingerprints in flight become suspects (or poison).
    fresh_request = poison.crashed(fingerprint(model_id, pend.msg) for pend in in_flight)
    keys.crashed(callers)
    return fresh_request and not blamed_before
