"""The model library: every GGUF model on disk, kept current by a watcher
(supervisor/models/library_watch.py).

Sources, in priority order:

1. the configured model dirs, scanned recursively (hidden names skipped);
2. the Hugging Face hub cache (``huggingface_hub.scan_cache_dir``; which
   one: supervisor/models/hub_cache.py), one revision per repo: the one
   ``main`` points to, else the newest. A snapshot holding a safetensors
   model is one ``hf`` model named by its repo id (supervisor/models/hf_scan.py).

Model ids are stable and readable:

- in a model dir: the path relative to that dir, without ``.gguf`` and
  without a shard suffix, with ``/`` separators:
  ``qwen/Qwen3-8B-Q4_K_M.gguf`` -> ``qwen/Qwen3-8B-Q4_K_M``;
- in the hub cache: ``<repo_id>/<file stem>`` (folders inside the repo are
  dropped): ``bartowski/Qwen3-8B-GGUF/Qwen3-8B-Q4_K_M``.

When two files claim the same id the first source wins.

A sharded set ``name-00001-of-0000N.gguf`` is one model whose size is the sum
of its shards; it is listed only when every shard is present and settled.
Files named ``*mmproj*.gguf`` are vision projectors: never listed as models,
linked to the models in the same folder (or the same hub snapshot) that they
fit by their headers (supervisor/models/projector_match.py); a model left
without one says why in ``projector_note``.

A file is offered only once it is settled: not a temporary name
(``.part``, ``.tmp``, ``.incomplete``...), and either last modified more than
``settle_s`` ago or seen with the same size and mtime on two looks at least
``settle_s`` apart. A file whose header cannot be read is listed as
unusable, with the reason.

A GGUF LoRA adapter (``general.type = adapter``) is no model: it is listed
apart (:meth:`ModelLibrary.adapters`) and linked to the base models it fits
(supervisor/models/adapters.py); each base entry holds its fitting adapters,
and each pair is served as ``<base id>:<adapter id>`` (:meth:`ModelLibrary.pair`).
A PEFT adapter dir is linked the same way to the Hugging Face model it names
(supervisor/models/peft_adapters.py), served by vLLM.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from jobs.gguf_names import (
    group_gguf_files,
    hf_model_id,
    is_temporary_name,
)
from supervisor.models import library_watch, peft_adapters
from supervisor.models.adapters import (
    AdapterEntry,
    AdapterLink,
    AdapterLinker,
    AdapterRef,
)
from supervisor.models.entry import ModelEntry as ModelEntry
from supervisor.models.gguf_info import GgufError, GgufInfo, read_gguf_info
from supervisor.models.hf_scan import HfScanner
from supervisor.models.projector_match import link_projector

log = logging.getLogger(__name__)

class _Look(msgspec.Struct):
    size: int
    mtime_ns: int
    at: float  # monotonic time of the first look with this size/mtime


class ModelLibrary:
    """Scans model dirs and the hub cache; ``watch()`` keeps it current.

    Reads (``get``/``list``) are cheap and never block. ``rescan()`` does file
    I/O and header parsing: the watcher runs it in a thread. Waiters learn of
    changes through :meth:`wait_for_change`.
    """

    def __init__(
        self,
        model_dirs: Sequence[Path],
        hf_cache_dir: Path | None = None,
        *,
        settle_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        vllm_python: str | None = None,
        adapter_dirs: Sequence[Path] = (),
    ) -> None:
        self.model_dirs = [Path(d) for d in model_dirs]
        # Fine-tune outputs dirs: their adapters are served on an hf base at
        # once, with no export (supervisor/models/peft_adapters.py).
        self.adapter_dirs = [Path(d) for d in adapter_dirs]
        self.hf_cache_dir = Path(hf_cache_dir) if hf_cache_dir is not None else None
        self.settle_s = settle_s
        self._clock = clock
        self._wall = wall_clock
        self._entries: dict[str, ModelEntry] = {}
        self._adapters: dict[str, AdapterEntry] = {}
        self._pairs: dict[str, tuple[AdapterLink, AdapterEntry]] = {}
        self._linker = AdapterLinker()
        # Hugging Face safetensors dirs (kind hf, served by vLLM from vllm_python).
        self._hf = HfScanner(vllm_python)
        self._looks: dict[str, _Look] = {}
        # Set by a scan that met a symlinked directory (see watch).
        self.linked_dirs = False
        self._headers: dict[str, tuple[int, int, GgufInfo | GgufError]] = {}
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._version = 0
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.watching = asyncio.Event()  # set while watch() is live
        # Models held only on cluster nodes' own disks, which no scan here sees:
        # set from the parent's records (supervisor/lab/node_files.py).
        self._node_entries: dict[str, ModelEntry] = {}

    # -- reads -----------------------------------------------------------

    def get(self, model_id: str) -> ModelEntry | None:
        return self._entries.get(model_id) or self._node_entries.get(model_id)

    def list(self) -> builtins.list[ModelEntry]:
        # A model in the parent's directories shadows a node's copy: every node sees those.
        return [*self._entries.values(), *(e for i, e in self._node_entries.items() if i not in self._entries)]

    def set_node_models(self, entries: builtins.list[ModelEntry]) -> None:
        """The models held on cluster nodes' own disks, as recorded (on the loop's thread)."""
        found = {e.id: e for e in entries}
        if found != self._node_entries:
            self._node_entries = found
            self._version += 1
            self._signal()

    def adapters(self) -> builtins.list[AdapterEntry]:
        return list(self._adapters.values())

    def pair(self, model_id: str) -> tuple[AdapterLink, AdapterEntry] | None:
        """The (link, adapter) a ``<base>:<adapter>`` id names, fitting or not."""
        return self._pairs.get(model_id)

    @property
    def version(self) -> int:
        """Bumped on every change of the listing."""
        return self._version

    @property
    def pending(self) -> frozenset[str]:
        """Files seen but not settled yet (still growing or just written)."""
        return frozenset(self._pending)

    async def wait_for_change(self, version: int) -> int:
        """Return once :attr:`version` differs from ``version``; the new version."""
        self.bind_loop()
        while self._version == version:
            await self._changed.wait()
        return self._version

    async def wait_until(self, predicate: Callable[[ModelLibrary], bool]) -> None:
        """Wait until ``predicate(self)`` holds (checked after every change)."""
        while not predicate(self):
            await self.wait_for_change(self._version)

    # -- scanning --------------------------------------------------------

    def rescan(self) -> None:
        """Look at every source again and publish the new listing."""
        with self._lock:
            entries: dict[str, ModelEntry] = {}
            pending: set[str] = set()
            seen: set[str] = set()
            for root in self.model_dirs:
                for entry in self._scan_dir(root, pending, seen):
                    self._add(entries, entry)
            for entry in self._hf.scan(self.model_dirs, self._settled, pending, seen):
                self._add(entries, entry)
            gguf_hub, snapshots = self._scan_hf_cache()
            for entry in gguf_hub:
                self._add(entries, entry)
            if self.hf_cache_dir is not None:
                for entry in self._hf.scan_hub(self.hf_cache_dir, snapshots, self._settled, pending, seen):
                    self._add(entries, entry)
            peft = peft_adapters.scan(self.model_dirs, entries, self._settled, pending, seen, self.adapter_dirs)
            self._pending = pending
            alive = seen | {f for e in entries.values() for f in e.files}
            self._looks = {p: v for p, v in self._looks.items() if p in seen}
            self._headers = {p: v for p, v in self._headers.items() if p in alive}
            entries, adapters = self._linker.split(entries, alive)
            entries, adapters = self._with_peft(entries, adapters, peft)
            if entries != self._entries or adapters != self._adapters:
                self._entries = entries
                self._adapters = adapters
                self._pairs = {lk.id: (lk, a) for a in adapters.values() for lk in a.links}
                self._version += 1
                self._signal()

    @staticmethod
    def _with_peft(entries: dict[str, ModelEntry], adapters: dict[str, AdapterEntry],
                   found: dict[str, AdapterEntry]) -> tuple[dict[str, ModelEntry], dict[str, AdapterEntry]]:
        """The PEFT adapter dirs (supervisor/models/peft_adapters.py) added to
        the adapters, and each to the ``hf`` base it fits."""
        refs: dict[str, builtins.list[AdapterRef]] = {}
        for adapter in found.values():
            if adapter.id in adapters:
                log.warning("adapter id %s: %s is shadowed by %s", adapter.id, adapter.path,
                            adapters[adapter.id].path)
                continue
            adapters[adapter.id] = adapter
            for lk in adapter.links:
                refs.setdefault(lk.base, []).append(
                    AdapterRef(id=adapter.id, path=adapter.path, size_bytes=adapter.size_bytes,
                               mtime=adapter.mtime))
        for base, more in refs.items():
            entries[base] = msgspec.structs.replace(entries[base], adapters=[*entries[base].adapters, *more])
        return entries, adapters

    def _signal(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._wake()
        else:
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    @staticmethod
    def _add(entries: dict[str, ModelEntry], entry: ModelEntry) -> None:
        if entry.id in entries:
            log.warning(
                "model id %s: %s is shadowed by %s", entry.id, entry.path, entries[entry.id].path
            )
            return
        entries[entry.id] = entry

    def _settled(self, path: str, st: os.stat_result) -> bool:
        now = self._clock()
        look = self._looks.get(path)
        if look is None or (look.size, look.mtime_ns) != (st.st_size, st.st_mtime_ns):
            look = self._looks[path] = _Look(st.st_size, st.st_mtime_ns, now)
        if self._wall() - st.st_mtime >= self.settle_s:
            return True
        return now - look.at >= self.settle_s

    def _walk(self, root: Path) -> dict[str, os.stat_result]:
        found: dict[str, os.stat_result] = {}
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            # Never descended into (os.walk does not follow them), but a
            # notify watcher would follow them, e.g. into all of "/".
            if any(os.path.islink(os.path.join(dirpath, d)) for d in dirnames):
                self.linked_dirs = True
            for name in filenames:
                if not name.lower().endswith(".gguf") or is_temporary_name(name):
                    continue
                full = Path(dirpath) / name
                try:
                    st = full.stat()
                except FileNotFoundError:
                    continue  # removed while we looked
                except OSError as exc:  # unreadable, a symlink loop, ...
                    log.warning("skipping unreadable model file %s: %s", full, exc)
                    continue
                if not stat.S_ISREG(st.st_mode):
                    # A FIFO would block the open() forever; a directory or a
                    # device named .gguf is no model either.
                    log.warning("skipping %s: not a regular file", full)
                    continue
                rel = full.relative_to(root).as_posix()
                found[rel] = st
        return found

    def _scan_dir(self, root: Path, pending: set[str], seen: set[str]) -> builtins.list[ModelEntry]:
        if not root.is_dir():
            return []
        stats = self._walk(root)
        settled = {}
        for rel, st in stats.items():
            full = str(root / rel)
            seen.add(full)
            if self._settled(full, st):
                settled[rel] = st
            else:
                pending.add(full)
        models, projectors = group_gguf_files(settled)
        by_dir: dict[str, builtins.list[str]] = {}
        for proj in projectors:
            by_dir.setdefault(proj.rpartition("/")[0], []).append(proj)
        out = []
        for key, files in models.items():
            if not files:
                continue  # incomplete shard set
            try:
                out.append(
                    self._entry(
                        model_id=key,
                        root=root,
                        files=[root / f for f in files],
                        source="dir",
                        projectors=[root / p for p in by_dir.get(key.rpartition("/")[0], [])],
                    )
                )
            except FileNotFoundError:
                continue  # removed while we looked; the watcher rescans
        return out

    def _scan_hf_cache(self) -> tuple[builtins.list[ModelEntry], builtins.list[tuple[str, str, Path]]]:
        """The GGUF models of the hub cache, and each repo's chosen snapshot
        (repo id, commit, dir) for the ``hf`` scan."""
        if self.hf_cache_dir is None or not self.hf_cache_dir.is_dir():
            return [], []
        from huggingface_hub import scan_cache_dir
        from huggingface_hub.errors import CacheNotFound

        try:
            info = scan_cache_dir(self.hf_cache_dir)
        except CacheNotFound:
            return [], []  # removed since we looked
        for warning in info.warnings:
            log.warning("hub cache: %s", warning)
        out: builtins.list[ModelEntry] = []
        snapshots: builtins.list[tuple[str, str, Path]] = []
        for repo in sorted(info.repos, key=lambda r: r.repo_id):
            if repo.repo_type != "model" or not repo.revisions:
                continue
            rev = max(
                repo.revisions, key=lambda r: ("main" in r.refs, bool(r.refs), r.last_modified)
            )
            snapshots.append((repo.repo_id, rev.commit_hash, rev.snapshot_path))
            rel = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f for f in rev.files}
            models, projectors = group_gguf_files(rel)
            for key, files in models.items():
                if not files:
                    continue
                try:
                    out.append(
                        self._entry(
                            model_id=hf_model_id(repo.repo_id, key + ".gguf"),
                            root=self.hf_cache_dir,
                            files=[rel[f].file_path for f in files],
                            source="hf_cache",
                            projectors=[rel[p].file_path for p in projectors],
                            repo_id=repo.repo_id,
                            revision=rev.commit_hash,
                        )
                    )
                except FileNotFoundError:
                    continue  # removed while we looked; the watcher rescans
        return out, snapshots

    def _entry(
        self,
        *,
        model_id: str,
        root: Path,
        files: builtins.list[Path],
        source: Literal["dir", "hf_cache"],
        projectors: Sequence[Path],
        repo_id: str | None = None,
        revision: str | None = None,
    ) -> ModelEntry:
        stats = [f.stat() for f in files]
        header = self._header(files[0], stats[0])
        info = header if isinstance(header, GgufInfo) else None
        reason = header.reason if isinstance(header, GgufError) else None
        if info is not None and info.is_projector:
            reason = "a vision projector (mmproj), not a model"
        elif info is not None and len(files) > 1 and info.split_count not in (0, len(files)):
            reason = f"shard set has {len(files)} files but the header says {info.split_count}"
        mmproj, projector_note = link_projector(files[0], info, projectors)
        return ModelEntry(
            id=model_id,
            path=str(files[0]),
            files=[str(f) for f in files],
            size_bytes=sum(s.st_size for s in stats),
            source=source,
            root=str(root),
            mtime=max(s.st_mtime for s in stats),
            repo_id=repo_id,
            revision=revision,
            mmproj=str(mmproj) if mmproj else None,
            projector_note=projector_note,
            quantization=info.quantization if info else None,
            info=info,
            usable=reason is None,
            reason=reason,
        )

    def _header(self, path: Path, st: os.stat_result) -> GgufInfo | GgufError:
        key = str(path)
        cached = self._headers.get(key)
        if cached is not None and cached[:2] == (st.st_size, st.st_mtime_ns):
            return cached[2]
        try:
            result: GgufInfo | GgufError = read_gguf_info(path)
        except GgufError as exc:
            result = exc
        except Exception as exc:  # a crafted header costs this one file, never the watcher (file_faults.py)
            result = GgufError(path, f"unreadable header ({type(exc).__name__}: {exc})")
            # Once per file version: the result is cached until the file changes.
            log.warning("%s: %s; the file is unusable until it changes", path, result.reason)
        self._headers[key] = (st.st_size, st.st_mtime_ns, result)
        return result

    # -- watching (supervisor/models/library_watch.py) --------------------

    def bind_loop(self) -> None:
        """Wake this event loop's waiters on changes, also from rescans in threads."""
        self._loop = asyncio.get_running_loop()

    async def watch(self, stop: asyncio.Event) -> None:
        """Rescan now, then on every change until ``stop`` is set."""
        await library_watch.watch(self, stop)

    async def watch_supervised(self, stop: asyncio.Event, restart_s: float = 1.0) -> None:
        """:meth:`watch`, restarted after any failure until ``stop``."""
        await library_watch.watch_supervised(self, stop, restart_s)
