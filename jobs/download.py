"""The ``download`` job: fetch GGUF files from the Hugging Face Hub.

Files go into the hub cache through ``huggingface_hub`` (so the library finds
them by itself), one after the other, with progress events (bytes done and
total, rate, ETA) at least every half second and at every file boundary.

- Choice: glob ``patterns``, a ``quant`` name (the matching file or complete
  shard set) or the repo's only GGUF model; plus its vision projector.
- Preflight: the bytes still to fetch (files whose blob is already cached are
  subtracted) must fit the free disk of the cache, else the job fails before
  downloading, or with ``fallback_smaller`` takes the largest smaller variant
  that fits.
- Cancel: SIGTERM stops within one read chunk; the partial file is removed
  and files already finished stay cached, so a rerun fetches only the rest.
- ``HF_HUB_OFFLINE``: nothing is fetched; the job succeeds only when the
  chosen files are already cached.
- The token comes from ``HF_TOKEN`` in the job's environment (the parent puts
  its setting there). It is never written to events, logs or errors.

Run by the jobs dispatcher as ``run(io, params, ctx)``; ``python -m
jobs.download`` runs it standalone with the same stdin/stdout protocol.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Self, cast

import msgspec

from jobs.context import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_STOPPED,
    JobContext,
    JobError,
    JobStopped,
    check_stop,
)
from jobs.download_params import DownloadParams

# Read granularity: progress and cancel react within one chunk.
from jobs.download_plan import (
    RemoteFile,
    cache_repo_dir,
    choose_files,
    free_disk,
    gb,
    plan_download,
    redact,
)
from jobs.events import JobIO
from jobs.gguf_names import hf_model_id
from jobs.hub_advice import hub_unreachable, hub_unreachable_help

CHUNK_BYTES = 1024 * 1024
PROGRESS_INTERVAL_S = 0.5


class Reporter:
    """Turns byte counts from the download threads into throttled progress events."""

    def __init__(self, io: JobIO, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._io = io
        self._total = total
        self._clock = clock
        self._lock = threading.Lock()
        self._done = 0
        self._file = ""
        self._index = 0
        self._count = 0
        self._last = 0.0
        self._samples: deque[tuple[float, int]] = deque()

    def start_file(self, name: str, index: int, count: int) -> None:
        with self._lock:
            self._file, self._index, self._count = name, index, count
        self.emit(force=True)

    def add(self, n: int) -> None:
        with self._lock:
            self._done += n
        if self._io.stop_requested:
            raise JobStopped(f"stopped on request while downloading {self._file}")
        self.emit()

    def emit(self, *, force: bool = False) -> None:
        with self._lock:
            now = self._clock()
            if not force and now - self._last < PROGRESS_INTERVAL_S:
                return
            self._last = now
            self._samples.append((now, self._done))
            while len(self._samples) > 2 and now - self._samples[0][0] > 5.0:
                self._samples.popleft()
            t0, b0 = self._samples[0]
            rate = (self._done - b0) / (now - t0) if now > t0 else 0.0
            left = max(self._total - self._done, 0)
            data: dict[str, Any] = {
                "bytes_done": self._done,
                "bytes_total": self._total,
                "rate": round(rate, 1),
                "eta_s": round(left / rate, 1) if rate > 0 else None,
                "file": self._file,
                "file_index": self._index,
                "files": self._count,
            }
            fraction = self._done / self._total if self._total else 1.0
        self._io.progress(fraction, **data)


class _ByteBar:
    """Stands in for tqdm inside huggingface_hub: forwards bytes to the reporter."""

    def __init__(self, reporter: Reporter, **_: Any) -> None:
        self._reporter = reporter

    def update(self, n: float = 1) -> None:
        self._reporter.add(int(n))

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _remote_files(params: DownloadParams, token: str | None) -> tuple[str, list[RemoteFile]]:
    """(commit, files) of the repo at the revision, with sizes and blob ids."""
    from huggingface_hub import HfApi

    info = HfApi(token=token).model_info(
        params.repo_id, revision=params.revision, files_metadata=True
    )
    files = []
    for s in info.siblings or []:
        if s.lfs is not None:
            files.append(RemoteFile(s.rfilename, s.lfs.size, s.lfs.sha256))
        elif s.size is not None and s.blob_id is not None:
            files.append(RemoteFile(s.rfilename, s.size, s.blob_id))
    return info.sha or params.revision, files


def _offline(io: JobIO, params: DownloadParams, cache_dir: Path) -> dict[str, object]:
    """HF_HUB_OFFLINE: succeed only if the choice is already in the cache."""
    repo = cache_repo_dir(cache_dir, params.repo_id)
    ref = repo / "refs" / params.revision
    commit = ref.read_text().strip() if ref.is_file() else params.revision
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise JobError(
            f"offline (HF_HUB_OFFLINE) and {params.repo_id}@{params.revision} is not in the cache"
        )
    paths = [p for p in snapshot.rglob("*") if p.is_file()]
    files = [RemoteFile(p.relative_to(snapshot).as_posix(), p.stat().st_size, "") for p in paths]
    chosen, key = choose_files(files, params)
    io.log(f"offline: {len(chosen)} file(s) already cached")
    return _result(
        params,
        commit,
        chosen,
        key,
        [str(snapshot / f.path) for f in chosen],
        0,
        sum(f.size for f in chosen),
    )


def _result(
    params: DownloadParams,
    commit: str,
    files: list[RemoteFile],
    key: str | None,
    local: list[str],
    fetched: int,
    reused: int,
) -> dict[str, object]:
    return {
        "repo_id": params.repo_id,
        "revision": params.revision,
        "commit": commit,
        "model_id": hf_model_id(params.repo_id, key + ".gguf") if key else None,
        "files": [
            {"path": f.path, "size": f.size, "local_path": p}
            for f, p in zip(files, local, strict=True)
        ],
        "bytes_downloaded": fetched,
        "bytes_reused": reused,
    }


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def run(io: JobIO, params: DownloadParams, ctx: JobContext) -> dict[str, object]:
    """Download what ``params`` chooses into the hub cache; the result lists the files."""
    import httpx2
    from huggingface_hub.errors import HFValidationError

    token = os.environ.get("HF_TOKEN") or None
    try:
        return _run(io, params, token)
    except (OSError, httpx2.HTTPError, HFValidationError) as exc:
        # Hub, network and disk errors: a clear failure, never the token.
        raw = redact(f"{type(exc).__name__}: {exc}", token)
        if not hub_unreachable(exc):
            raise JobError(raw) from None
        # No Hub at all: the error says what to do instead, the log keeps the raw one.
        from huggingface_hub import constants

        io.log(raw)
        print(raw, file=sys.stderr)  # the job's log file: the job page shows its tail
        advice = hub_unreachable_help(constants.ENDPOINT, ctx.models_dir, str(hub_cache_dir()))
        raise JobError("\n".join(advice)) from None


def _run(io: JobIO, params: DownloadParams, token: str | None) -> dict[str, object]:
    from huggingface_hub import constants, hf_hub_download

    cache_dir = hub_cache_dir()
    if constants.is_offline_mode():
        return _offline(io, params, cache_dir)
    io.stage("listing")
    commit, remote = _remote_files(params, token)
    check_stop(io, "after listing the repo")
    plan = plan_download(remote, params, cache_dir, free_disk(cache_dir), io.log)
    reused = sum(f.size for f in plan.files if f.path in plan.cached)
    io.log(
        f"{len(plan.files)} file(s), {gb(plan.to_fetch)} to fetch, {gb(reused)} already cached"
    )
    reporter = Reporter(io, plan.to_fetch)
    bar = partial(_ByteBar, reporter)
    io.stage("downloading")
    local: list[str] = []
    # A smaller read chunk than the library's 10 MiB: finer progress, quicker cancel.
    saved_chunk = constants.DOWNLOAD_CHUNK_SIZE
    constants.DOWNLOAD_CHUNK_SIZE = CHUNK_BYTES
    try:
        for i, f in enumerate(plan.files, 1):
            check_stop(io, f"before {f.path}")
            reporter.start_file(f.path, i, len(plan.files))
            path = hf_hub_download(
                params.repo_id,
                f.path,
                revision=params.revision,
                cache_dir=cache_dir,
                token=token,
                tqdm_class=cast(Any, bar),
            )
            local.append(str(path))
    finally:
        constants.DOWNLOAD_CHUNK_SIZE = saved_chunk
    reporter.emit(force=True)
    return _result(params, commit, plan.files, plan.model_key, local, plan.to_fetch, reused)


def main() -> int:
    """Standalone entry point with the jobs protocol (the dispatcher does the same)."""
    io = JobIO()
    job_input = io.read_input()
    params = msgspec.convert(job_input.params, DownloadParams)
    ctx = msgspec.convert(job_input.context, JobContext)
    io.start_watchdogs()
    io.emit("started", kind="download", pid=os.getpid())
    try:
        result = run(io, params, ctx)
    except JobStopped as exc:
        io.failed(str(exc))
        return EXIT_STOPPED
    except JobError as exc:
        io.failed(str(exc))
        return EXIT_FAILED
    io.done(result)
    return EXIT_OK


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # the stdin watchdog thread blocks on read
