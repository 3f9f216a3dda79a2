"""After ``gpuvisor pull``: the model id the service really lists, read back.

The download job's result names the id the library gives its file
(jobs/gguf_names.py), but a finished download is not yet a served model: the
library lists it only once its watcher has rescanned, only when it lists that
Hub cache at all (``hf_cache_dir``, supervisor/models/hub_cache.py), and not
when a model dir already holds a model of the same id. So ``/v1/models`` is
polled, for a bounded time, until the id shows, and the entry behind it is
checked to be the pulled file's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import aiohttp

# Polls of the listing: the library rescans within about a second of a change.
POLL_S = 0.25


@dataclass(frozen=True)
class Verdict:
    """What to print (line by line) and the exit code."""

    lines: list[str]
    code: int


async def _get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
        resp.raise_for_status()
        return await resp.json()


async def wait_listed(http: aiohttp.ClientSession, url: str, model_id: str,
                      timeout_s: float) -> dict[str, Any] | None:
    """The ``/v1/models`` item of ``model_id`` once listed, or None after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        body = await _get(http, url + "/v1/models")
        for item in body.get("data", []):
            if item.get("id") == model_id:
                return dict(item)
        if loop.time() >= deadline:
            return None
        await asyncio.sleep(POLL_S)


def _snapshot_dir(result: dict[str, Any]) -> str:
    files = result.get("files") or []
    return str(PurePosixPath(files[0]["local_path"]).parent) if files else "the Hugging Face cache"


async def check(http: aiohttp.ClientSession, url: str, result: dict[str, Any],
                timeout_s: float, scan_off: bool) -> Verdict:
    """Read the pulled model back from the service (``scan_off``: this
    config turns the Hub cache listing off, which explains a miss)."""
    model_id = result.get("model_id")
    count = len(result.get("files") or [])
    if not model_id:
        return Verdict([f"done: {count} file(s) downloaded; none of them is a model to list"], 0)
    item = await wait_listed(http, url, str(model_id), timeout_s)
    if item is None:
        why = ('this config sets hf_cache_dir = "off", so the service lists no Hugging Face cache'
               if scan_off else
               "the service lists the Hugging Face cache of its hf_cache_dir setting (unset: the one its "
               "HF_HUB_CACHE or HF_HOME names); check the service's log for the cache it lists")
        return Verdict([f"gpuvisor: downloaded {count} file(s) to {_snapshot_dir(result)}, but the service "
                        f"does not list model {model_id} after {timeout_s:g} s", f"  {why}"], 1)
    library = await _get(http, url + "/api/models")
    entry = next((m for m in library.get("data", []) if m.get("id") == model_id), None)
    if entry is not None and entry.get("repo_id") != result.get("repo_id"):
        return Verdict([f"gpuvisor: model id {model_id} is taken by {entry.get('path')}, which the "
                        "service lists first; the pulled file is not served under it"], 1)
    if item.get("state") == "unusable":
        return Verdict([f"gpuvisor: model {model_id} is listed but unusable: {item.get('reason')}"], 1)
    return Verdict([f"done: model {model_id} is listed in /v1/models"], 0)
