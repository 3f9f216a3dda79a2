"""Hugging Face model dirs in the library's model dirs (kind ``hf``, served by vLLM).

A dir holding ``config.json`` and ``*.safetensors`` weights (or a shard
index) is one model; its id is its path relative to the model dir
(``org/Model-7B``). A snapshot in the Hugging Face Hub cache that holds
the same files (symlinks into the cache's blobs) is one too, its id the
repo id (``org/Model-7B``), listed after the model dirs. A PEFT adapter
dir (``adapter_config.json``) is no model. Its facts are read by
:mod:`supervisor.models.hf_info` once its files have settled, and kept
until one of them changes. A model is unusable, with the reason, when its
files cannot be read or when there is no vLLM environment to run it (``vllm_python``; ``make install-vllm`` makes one).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import msgspec

from jobs.gguf_names import is_temporary_name
from supervisor.models.entry import ModelEntry, ModelSource
from supervisor.models.hf_info import HfError, HfInfo, is_model_dir, read_hf_info

log = logging.getLogger(__name__)

Settled = Callable[[str, os.stat_result], bool]
_Key = tuple[tuple[str, int, int], ...]
_Facts = dict[str, tuple[_Key, "HfInfo | HfError"]]


def engine_problem(vllm_python: str | None) -> str | None:
    """Why ``hf`` models cannot run here, or None when a vLLM environment is set up."""
    if not vllm_python:
        return "no vLLM environment for Hugging Face models: run `make install-vllm` (or set vllm_python)"
    if not (os.path.isfile(vllm_python) and os.access(vllm_python, os.X_OK)):
        return (f"vllm_python {vllm_python} is not an executable file: run `make install-vllm`"
                " (or set vllm_python to the Python of a vLLM environment)")
    return None


def _files(model_dir: Path, names: list[str]) -> dict[str, os.stat_result]:
    """The dir's regular files by name, without temporary names (a download's
    ``.part``: a shard index names the shards still missing)."""
    stats: dict[str, os.stat_result] = {}
    for name in names:
        if is_temporary_name(name):
            continue
        try:
            st = (model_dir / name).stat()
        except FileNotFoundError:
            continue  # removed while we looked
        except OSError as exc:  # unreadable, a symlink loop, ...
            log.warning("skipping unreadable file %s: %s", model_dir / name, exc)
            continue
        if stat.S_ISREG(st.st_mode):
            stats[name] = st
    return stats


def model_dirs(root: Path) -> Iterator[tuple[Path, list[str]]]:
    """(dir, file names) of every model dir under ``root``; hidden names and
    symlinked dirs are not followed, nor dirs inside a model dir."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        names = [n for n in filenames if not n.startswith(".")]
        if is_model_dir(frozenset(names)):
            dirnames[:] = []
            yield Path(dirpath), sorted(names)


class HfScanner:
    """Finds the ``hf`` models of the model dirs; the library's rescan calls :meth:`scan`."""

    def __init__(self, vllm_python: str | None) -> None:
        self.vllm_python = vllm_python
        self._facts: _Facts = {}
        self._hub_facts: _Facts = {}

    def scan(self, roots: Sequence[Path], settled: Settled, pending: set[str],
             seen: set[str]) -> list[ModelEntry]:
        """The models of every root whose files have all settled; the others'
        files go to ``pending``."""
        problem = engine_problem(self.vllm_python)
        out: list[ModelEntry] = []
        facts: _Facts = {}
        for root in roots:
            if not root.is_dir():
                continue
            for model_dir, names in model_dirs(root):
                entry = self._one(root, model_dir, names, settled, pending, seen, self._facts, facts, problem)
                if entry is not None:
                    out.append(entry)
        self._facts = facts
        return out

    def scan_hub(self, cache_dir: Path, snapshots: Sequence[tuple[str, str, Path]], settled: Settled,
                 pending: set[str], seen: set[str]) -> list[ModelEntry]:
        """The models among the Hub cache's snapshots, each (repo id, commit,
        snapshot dir): one whose top level is a model dir, listed as the repo
        id. Its files may be links into the cache's blobs, never out of it."""
        problem = engine_problem(self.vllm_python)
        out: list[ModelEntry] = []
        facts: _Facts = {}
        for repo_id, revision, snapshot in snapshots:
            try:
                names = sorted(n for n in os.listdir(snapshot) if not n.startswith("."))
            except OSError as exc:
                log.warning("hub cache: cannot list %s: %s", snapshot, exc)
                continue
            if not is_model_dir(frozenset(names)):
                continue
            entry = self._one(cache_dir, snapshot, names, settled, pending, seen, self._hub_facts, facts,
                              problem, source="hf_cache", model_id=repo_id)
            if entry is not None:
                out.append(msgspec.structs.replace(entry, repo_id=repo_id, revision=revision))
        self._hub_facts = facts
        return out

    def _one(self, root: Path, model_dir: Path, names: list[str], settled: Settled, pending: set[str],
             seen: set[str], old: _Facts, new: _Facts, problem: str | None, *,
             source: ModelSource = "dir", model_id: str | None = None) -> ModelEntry | None:
        """The entry of one model dir once all its files have settled (else
        None, its files pending); its facts read again only when a file changed."""
        stats = _files(model_dir, names)
        waiting = [str(model_dir / n) for n, st in stats.items() if not settled(str(model_dir / n), st)]
        seen.update(str(model_dir / n) for n in stats)
        if waiting:
            pending.update(waiting)
            return None
        key = tuple(sorted((n, st.st_size, st.st_mtime_ns) for n, st in stats.items()))
        new[str(model_dir)] = (key, self._read(model_dir, root, key, old))
        return _entry(root, model_dir, stats, new[str(model_dir)][1], problem, source, model_id)

    @staticmethod
    def _read(model_dir: Path, root: Path, key: _Key, old: _Facts) -> HfInfo | HfError:
        cached = old.get(str(model_dir))
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            return read_hf_info(model_dir, root)
        except HfError as exc:
            return exc
        except (OSError, ValueError, OverflowError, MemoryError) as exc:
            # A crafted file must cost this one model, never the watcher.
            return HfError(model_dir, f"unreadable ({type(exc).__name__}: {exc})")


def _entry(root: Path, model_dir: Path, stats: dict[str, os.stat_result], facts: HfInfo | HfError,
           problem: str | None, source: ModelSource = "dir", model_id: str | None = None) -> ModelEntry:
    info = facts if isinstance(facts, HfInfo) else None
    if isinstance(facts, HfError):
        where = Path(facts.path)
        problem = f"{where.name if where != model_dir else 'model dir'}: {facts.reason}"
    weights = info.weight_files if info else sorted(n for n in stats if n.endswith(".safetensors"))
    rel = model_dir.relative_to(root).as_posix()
    if info is not None and info.draft_head is not None and problem is None:
        # Listed, so that a target can name it as its draft_model (supervisor/models/hf_draft.py).
        kind = {"eagle": "EAGLE", "eagle3": "EAGLE-3"}[info.draft_head]
        problem = (f"an {kind} draft head, not a model: it drafts for a model of its "
                   'hidden size and vocabulary (speculative = "draft", draft_model = this id)')
    return ModelEntry(
        id=model_id or (model_dir.name if rel == "." else rel),
        path=str(model_dir),
        files=[str(model_dir / n) for n in ["config.json", *weights]],
        size_bytes=sum(stats[n].st_size for n in weights if n in stats),
        source=source,
        root=str(root),
        mtime=max((st.st_mtime for st in stats.values()), default=0.0),
        quantization=info.quantization if info else None,
        usable=problem is None,
        reason=problem,
        kind="hf",
        hf=info,
    )
