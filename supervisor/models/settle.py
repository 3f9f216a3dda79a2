"""The settle wait: after an eviction or a job's end, memory comes back late.

A process that exited may still show its memory in use for a while: the
driver frees it when the context is torn down. Whoever frees memory on a GPU
says how much it expects to see free there (:meth:`Settler.expect`); whoever
measures for the next placement first waits (:meth:`Settler.wait`) until the
readings show it, or until a bound passes. Clock and sleep are injected so
tests never really sleep.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import msgspec

from supervisor.models.devices import DeviceSource, GpuReading

log = logging.getLogger("gpuvisor.settle")

# Of what an evicted worker was planned to use, the share that must show up
# free again: the plan is an estimate (the engine may have used less).
EVICTED_SHARE = 0.75
# A job's devices count as back once their free memory is within this share
# of the total of what it was before the job started.
JOB_TOLERANCE = 0.05


class Settled(msgspec.Struct, frozen=True, kw_only=True):
    """How a wait ended: ``settled`` false when the bound passed first."""

    settled: bool
    waited_s: float
    pending: list[int] = []  # GPU indices still short of their expected free memory


class Settler:
    """Expected free memory per GPU index, and the bounded wait for it."""

    def __init__(self, source: DeviceSource, *, timeout: float = 10.0, interval: float = 0.25,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.source = source
        self.timeout = timeout
        self.interval = interval
        self._clock = clock
        self._sleep = sleep
        self._expected: dict[int, int] = {}  # index -> free bytes it should show

    def expect(self, index: int, free_bytes: int) -> None:
        """The GPU should soon show at least ``free_bytes`` free."""
        self._expected[index] = max(free_bytes, self._expected.get(index, 0))

    def expect_freed(self, before: Iterable[GpuReading], freed: dict[int, int]) -> None:
        """An eviction: ``freed`` bytes (the plan) per index leave the ``before`` readings."""
        for r in before:
            if r.index in freed:
                self.expect(r.index, r.free_bytes + int(freed[r.index] * EVICTED_SHARE))

    def expect_back(self, baseline: Iterable[GpuReading]) -> None:
        """A job ended: its GPUs should be about as free as before it started."""
        for r in baseline:
            self.expect(r.index, r.free_bytes - int(r.total_bytes * JOB_TOLERANCE))

    def pending(self) -> list[int]:
        return sorted(self._expected)

    async def read(self) -> list[GpuReading]:
        return await asyncio.to_thread(self.source.read)

    async def wait(self, indices: Iterable[int] | None = None) -> Settled:
        """Poll until every expectation on ``indices`` (None: all) is met, or the bound."""
        watch = set(self._expected) if indices is None else set(indices) & set(self._expected)
        start = self._clock()
        while watch:
            free = {r.index: r.free_bytes for r in await self.read()}
            for index in list(watch):
                # A GPU gone from the readings cannot be waited for.
                if index not in free or free[index] >= self._expected.get(index, 0):
                    watch.discard(index)
                    self._expected.pop(index, None)
            if not watch:
                break
            if self._clock() - start >= self.timeout:
                log.warning("GPU memory on %s not freed within %.1fs; placing with what is free now",
                            ", ".join(f"cuda:{i}" for i in sorted(watch)), self.timeout)
                for index in watch:
                    self._expected.pop(index, None)
                return Settled(settled=False, waited_s=round(self._clock() - start, 3),
                               pending=sorted(watch))
            await self._sleep(self.interval)
        return Settled(settled=True, waited_s=round(self._clock() - start, 3))
