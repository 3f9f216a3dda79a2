"""The failed-authentication budget: per client address, over budget 429."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from supervisor.api.proxies import client_key
from supervisor.errors import ApiError


class TooManyRequests(ApiError):
    """Too many failed authentications from this client (429, Retry-After)."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class FailureLimiter:
    """Failed authentications per client (``client_key``): a bucket of
    ``limit`` that refills evenly over ``window`` seconds."""

    def __init__(self, limit: int = 10, window: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, max_clients: int = 10_000) -> None:
        self.limit = float(limit)
        self.rate = limit / window
        self.clock = clock
        self.max_clients = max_clients
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when)

    def _tokens(self, key: str, now: float) -> float:
        tokens, then = self._buckets.get(key, (self.limit, now))
        return min(self.limit, tokens + (now - then) * self.rate)

    def check(self, client: str) -> None:
        """Raise TooManyRequests while ``client`` has no failure left."""
        tokens = self._tokens(client_key(client), self.clock())
        if tokens < 1:
            wait = max(1, math.ceil((1 - tokens) / self.rate))
            raise TooManyRequests(f"too many failed authentications from this address; retry in {wait} s",
                                  retry_after=wait)

    def record(self, client: str) -> None:
        key, now = client_key(client), self.clock()
        self._buckets[key] = (self._tokens(key, now) - 1, now)
        if len(self._buckets) > self.max_clients:
            self._prune(now)

    def _prune(self, now: float) -> None:
        for key in [k for k in self._buckets if self._tokens(k, now) >= self.limit]:
            del self._buckets[key]
        # Still full: the oldest go (so many addresses outrun any per-address budget).
        while len(self._buckets) > self.max_clients:
            del self._buckets[next(iter(self._buckets))]
