"""One line, rate-limited, for a request aiohttp could not even parse.

aiohttp logs every malformed request line or header at ERROR with the
parser's traceback (11 lines). Those are the client's fault, come before any
auth, and cost the sender a few bytes each: 200 of them wrote 2,200 lines in
0.6 s. This filter turns each into one WARNING line naming the peer and the
parser's reason, lets ``burst`` of them through per ``window_s`` and then
says once how many it left out. Errors that are not a client's bad message
pass untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiohttp.http_exceptions import HttpProcessingError

LOGGER = "aiohttp.server"
BURST = 5
WINDOW_S = 60.0


class BadHttpFilter(logging.Filter):
    """Rewrites (or drops) aiohttp's records of unparsable requests."""

    def __init__(self, burst: int = BURST, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        self.clock = clock
        self._window_start = -window_s
        self._seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = self.clock()
        left_out = 0
        if now - self._window_start >= self.window_s:
            left_out = max(0, self._seen - self.burst)
            self._window_start, self._seen = now, 0
        self._seen += 1
        if self._seen > self.burst:
            return False
        # The parser's own text spans lines (it draws a caret under the bad
        # byte); its first line after the status says what was wrong.
        reason = " ".join(str(exc.message).split())[:200]
        said = record.getMessage()  # "Error handling request from <peer>"
        record.msg = "%s (HTTP %s: %s)%s"
        record.args = (said, exc.code, reason,
                       f"; {left_out} more left out in the last {self.window_s:.0f} s" if left_out else "")
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        return True


def install() -> None:
    """Filter aiohttp's server logger (once: a second install replaces nothing)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(f, BadHttpFilter) for f in logger.filters):
        logger.addFilter(BadHttpFilter())
