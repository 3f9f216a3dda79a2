"""Which files a download fetches: the GGUF variant and projector chosen
from the repo listing, what the Hub cache already holds, and whether it fits
on the cache disk (else a smaller variant, when allowed).
"""

from __future__ import annotations

import fnmatch
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from jobs.context import (
    JobError,
)
from jobs.download_params import DownloadParams
from jobs.gguf_names import group_gguf_files, model_stem

# Read granularity: progress and cancel react within one chunk.
# Kept free on the cache's disk beyond the files themselves.
DISK_MARGIN_BYTES = 64 * 1024 * 1024


class RemoteFile(msgspec.Struct, frozen=True):
    path: str
    size: int
    blob: str  # the cache's blob name: LFS sha256, else the git blob id


class Plan(msgspec.Struct):
    files: list[RemoteFile]
    cached: list[str]  # paths whose blob is already in the cache
    model_key: str | None  # the GGUF model chosen, when the choice was by model

    @property
    def to_fetch(self) -> int:
        return sum(f.size for f in self.files if f.path not in self.cached)


def redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def quant_matches(stem: str, quant: str) -> bool:
    """``Q4_K`` matches ``x-Q4_K`` but not ``x-Q4_K_M``; ``Q4_XS`` not ``IQ4_XS``."""
    pattern = rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])"
    return re.search(pattern, stem, re.IGNORECASE) is not None


def _variants(files: Sequence[RemoteFile]) -> tuple[dict[str, list[RemoteFile]], list[RemoteFile]]:
    by_path = {f.path: f for f in files}
    models, projectors = group_gguf_files(by_path)
    complete = {k: [by_path[p] for p in v] for k, v in models.items() if v}
    return complete, [by_path[p] for p in projectors]


def _projector(projectors: list[RemoteFile]) -> list[RemoteFile]:
    if not projectors:
        return []
    f16 = [p for p in projectors if "f16" in p.path.lower()]
    return [min(f16 or projectors, key=lambda p: p.path)]


def choose_files(
    files: Sequence[RemoteFile], params: DownloadParams
) -> tuple[list[RemoteFile], str | None]:
    """The files to fetch and the GGUF model key they make up (if any)."""
    if params.patterns:
        chosen = [f for f in files if any(fnmatch.fnmatch(f.path, p) for p in params.patterns)]
        if not chosen:
            raise JobError(f"no file in {params.repo_id} matches {', '.join(params.patterns)}")
        return chosen, None
    variants, projectors = _variants(files)
    if not variants:
        raise JobError(f"{params.repo_id} has no complete GGUF model")
    if params.quant is not None:
        keys = [k for k in variants if quant_matches(model_stem(k + ".gguf"), params.quant)]
        if not keys:
            raise JobError(
                f"{params.repo_id} has no {params.quant} file;"
                f" available: {', '.join(sorted(variants))}"
            )
        if len(keys) > 1:
            raise JobError(
                f"{params.quant} is ambiguous in {params.repo_id}: {', '.join(sorted(keys))}"
            )
    elif len(variants) == 1:
        keys = list(variants)
    else:
        raise JobError(
            f"{params.repo_id} has {len(variants)} GGUF models; choose one with quant or patterns:"
            f" {', '.join(sorted(variants))}"
        )
    extra = _projector(projectors) if params.mmproj else []
    return variants[keys[0]] + extra, keys[0]


def cache_repo_dir(cache_dir: Path, repo_id: str) -> Path:
    return cache_dir / ("models--" + repo_id.replace("/", "--"))


def cached_blobs(cache_dir: Path, repo_id: str, files: Sequence[RemoteFile]) -> list[str]:
    """Paths of ``files`` whose blob is already complete in the cache."""
    blobs = cache_repo_dir(cache_dir, repo_id) / "blobs"
    out = []
    for f in files:
        blob = blobs / f.blob
        if blob.is_file() and blob.stat().st_size == f.size:
            out.append(f.path)
    return out


def free_disk(path: Path) -> int:
    """Free bytes on the disk that holds (or will hold) ``path``."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def plan_download(
    files: Sequence[RemoteFile],
    params: DownloadParams,
    cache_dir: Path,
    free_bytes: int,
    log: Callable[[str], None],
) -> Plan:
    """Choose the files and check they fit on disk (or fall back to a smaller variant)."""
    chosen, key = choose_files(files, params)
    plan = Plan(chosen, cached_blobs(cache_dir, params.repo_id, chosen), key)
    if plan.to_fetch + DISK_MARGIN_BYTES <= free_bytes:
        return plan
    need = (
        f"{params.repo_id}: {gb(plan.to_fetch)} to download but only {gb(free_bytes)}"
        " free on the cache disk"
    )
    if not params.fallback_smaller or key is None:
        raise JobError(f"not enough disk space: {need}")
    variants, projectors = _variants(files)
    size = sum(f.size for f in variants[key])
    smaller = sorted(
        ((sum(f.size for f in v), k) for k, v in variants.items() if sum(f.size for f in v) < size),
        reverse=True,
    )
    extra = _projector(projectors) if params.mmproj else []
    for _, other in smaller:
        candidate = variants[other] + extra
        alt = Plan(candidate, cached_blobs(cache_dir, params.repo_id, candidate), other)
        if alt.to_fetch + DISK_MARGIN_BYTES <= free_bytes:
            log(f"not enough disk for {key}; falling back to {other}")
            return alt
    raise JobError(f"not enough disk space even for the smallest variant: {need}")


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"
