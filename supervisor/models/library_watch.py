"""Keeping the model library current: a file watcher over its sources.

It rescans when a model dir or the hub cache changes, rechecks files that
have not settled yet, picks up sources that appear after start, and polls
instead where a models dir holds symlinked directories (a notify watcher
would follow them). :func:`watch_supervised` restarts it after any failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from watchfiles import Change, awatch

if TYPE_CHECKING:
    from supervisor.models.library import ModelLibrary

log = logging.getLogger("supervisor.models.library")


def source_roots(lib: ModelLibrary) -> list[Path]:
    """The library's sources that exist now."""
    roots = [*lib.model_dirs, *lib.adapter_dirs]
    if lib.hf_cache_dir is not None:
        roots.append(lib.hf_cache_dir)
    return [r for r in roots if r.is_dir()]

def relevant(change: Change, path: str) -> bool:
    name = path.rsplit(os.sep, 1)[-1]
    # Download progress in the hub cache must not cause rescans.
    return not (name.endswith((".incomplete", ".lock")) or f"{os.sep}.locks{os.sep}" in path)

async def watch_supervised(lib: ModelLibrary, stop: asyncio.Event, restart_s: float = 1.0) -> None:
    """:func:`watch`, restarted after any failure (with its traceback
    logged) until ``stop``: a models dir the library cannot follow must
    not leave the service serving a stale list forever."""
    while not stop.is_set():
        try:
            await lib.watch(stop)
        except Exception:  # supervision: any failure restarts the watcher, logged in full
            log.exception("the model library watcher failed; restarting it in %.0f s", restart_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), restart_s)

async def watch(lib: ModelLibrary, stop: asyncio.Event) -> None:
    """Rescan now, then on every change until ``stop`` is set.

    Also rechecks files that have not settled and picks up model dirs or
    the hub cache when they appear after start.
    """
    lib.bind_loop()
    await asyncio.to_thread(lib.rescan)
    tick_ms = max(int(lib.settle_s * 1000), 100)
    if lib.linked_dirs:
        log.warning("a models dir holds symlinked directories (not scanned); "
                    "polling for changes instead of watching")
        await _poll(lib, stop, tick_ms / 1000)
        return
    while not stop.is_set():
        roots = source_roots(lib)
        if not roots:
            # Nothing to watch yet: look for the roots again after a tick.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), tick_ms / 1000)
            continue
        first = True
        async for changes in awatch(
            *roots,
            watch_filter=relevant,
            stop_event=stop,
            debounce=400,
            step=50,
            rust_timeout=tick_ms,
            yield_on_timeout=True,
        ):
            roots_changed = source_roots(lib) != roots
            # The first yield comes once the watcher runs: rescan to catch
            # what changed while it was starting.
            if first or changes or lib.pending or roots_changed:
                await asyncio.to_thread(lib.rescan)
            if first:
                first = False
                lib.watching.set()
            if roots_changed:
                break  # watch the new set of roots
    lib.watching.clear()

async def _poll(lib: ModelLibrary, stop: asyncio.Event, tick_s: float) -> None:
    """Rescan every tick: for roots holding symlinked directories."""
    lib.watching.set()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), tick_s)
        await asyncio.to_thread(lib.rescan)
