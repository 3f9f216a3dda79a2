"""One file's facts cost that file alone.

The library reads headers of files anyone who can write to a models dir put
there (a quantize job included). A reader meets a crafted file with code
that assumed a well-formed one, and whatever it raises (an IndexError on a
tensor with fewer dimensions than expected, a KeyError, an OverflowError)
must not stop a scan: the scan would fail on every change after it, and
start-up, which waits for the first scan, would never finish. So a fault in
one file's facts makes that file unusable, with the fault as its reason, and
is logged once (one line, no traceback): a rescan meets the same fault again
on every change of the directory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

log = logging.getLogger("supervisor.models.library")

# Faults remembered as logged; beyond this many, the oldest are forgotten
# (and logged again if they recur).
MAX_REMEMBERED = 4096


class FaultLog:
    """The reason for a file's fault, logged once per file and reason."""

    def __init__(self, max_remembered: int = MAX_REMEMBERED) -> None:
        self.max_remembered = max_remembered
        self._logged: dict[tuple[str, str], None] = {}  # insertion-ordered: oldest first

    def reason(self, path: str, what: str, exc: BaseException) -> str:
        """``what`` with the exception's type and text: the file's reason."""
        reason = f"{what} ({type(exc).__name__}: {exc})"
        key = (path, reason)
        if key not in self._logged:
            log.warning("%s: %s; the file is unusable until it changes", path, reason)
            self._logged[key] = None
            while len(self._logged) > self.max_remembered:
                del self._logged[next(iter(self._logged))]
        return reason

    def keep(self, alive: Iterable[str]) -> None:
        """Forget the faults of files that are gone (a new file there is logged anew)."""
        keep = set(alive)
        self._logged = {k: v for k, v in self._logged.items() if k[0] in keep}
