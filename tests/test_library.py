from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from jobs.gguf_names import group_gguf_files, hf_model_id, model_stem
from supervisor.models.library import ModelLibrary
from tests import gguf_headers as hdr

WAIT = 5.0  # generous bound for a loaded CI box; the watcher usually takes < 1 s


def header_bytes(tmp_path: Path) -> bytes:
    return hdr.llama_gqa(tmp_path / "template.gguf.src").read_bytes()


def put(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def ids(lib: ModelLibrary) -> set[str]:
    return {e.id for e in lib.list()}


def test_grouping_helpers() -> None:
    models, proj = group_gguf_files(
        [
            "a.gguf",
            "d/b-00001-of-00002.gguf",
            "d/b-00002-of-00002.gguf",
            "c-00001-of-00003.gguf",
            "d/mmproj-f16.gguf",
            "x.gguf.part",
            "notes.txt",
        ]
    )
    assert models == {
        "a": ["a.gguf"],
        "d/b": ["d/b-00001-of-00002.gguf", "d/b-00002-of-00002.gguf"],
        "c": [],
    }
    assert proj == ["d/mmproj-f16.gguf"]
    assert model_stem("Q4/M-Q4_K_M-00001-of-00002.gguf") == "M-Q4_K_M"
    assert hf_model_id("org/repo", "sub/M.gguf") == "org/repo/M"


def test_scan_dirs_shards_projectors_and_bad_files(tmp_path: Path) -> None:
    data = header_bytes(tmp_path)
    root = tmp_path / "models"
    put(root / "a.gguf", data)
    put(root / "sub" / "b.gguf", data)
    put(root / ".hidden.gguf", data)
    put(root / ".cache" / "h.gguf", data)
    put(root / "c.gguf.part", data)
    put(root / "d.tmp.gguf", data)
    put(root / "big-00001-of-00002.gguf", data)
    put(root / "big-00002-of-00002.gguf", b"x" * 1000)
    put(root / "inc-00001-of-00003.gguf", data)
    put(root / "inc-00003-of-00003.gguf", data)
    put(root / "vis" / "model.gguf", data)
    put(root / "vis" / "mmproj-model-f16.gguf", data)
    put(root / "bad.gguf", data[:200])
    lib = ModelLibrary([root], settle_s=0)
    lib.rescan()
    assert ids(lib) == {"a", "sub/b", "big", "vis/model", "bad"}
    a = lib.get("a")
    assert a is not None and a.usable and a.quantization == "Q4_K_M"
    assert a.info is not None and a.info.architecture == "llama"
    assert a.size_bytes == len(data) and a.source == "dir" and a.mmproj is None
    big = lib.get("big")
    assert big is not None and big.size_bytes == len(data) + 1000
    assert big.path.endswith("big-00001-of-00002.gguf") and len(big.files) == 2
    vis = lib.get("vis/model")
    assert (
        vis is not None and vis.mmproj is not None and vis.mmproj.endswith("mmproj-model-f16.gguf")
    )
    bad = lib.get("bad")
    assert bad is not None and not bad.usable and bad.reason and "truncated" in bad.reason
    assert lib.get("nope") is None


def test_growing_file_is_not_offered_until_settled(tmp_path: Path) -> None:
    now = [1000.0]
    wall = [time.time()]
    root = tmp_path / "m"
    f = put(root / "g.gguf", header_bytes(tmp_path))
    lib = ModelLibrary([root], settle_s=2.0, clock=lambda: now[0], wall_clock=lambda: wall[0])
    lib.rescan()
    assert ids(lib) == set() and str(f) in lib.pending
    now[0] += 1
    with f.open("ab") as out:
        out.write(b"more")
    lib.rescan()  # it changed: the settle time starts again
    now[0] += 1.5
    lib.rescan()
    assert ids(lib) == set()
    now[0] += 1
    lib.rescan()
    assert ids(lib) == {"g"} and not lib.pending


def make_hf_cache(cache: Path, data: bytes) -> None:
    repo = cache / "models--org--Model-GGUF"
    commit = "a" * 40
    snap = repo / "snapshots" / commit
    files = {
        "Model-Q4_K_M.gguf": data,
        "Q8_0/Model-Q8_0-00001-of-00002.gguf": data,
        "Q8_0/Model-Q8_0-00002-of-00002.gguf": b"y" * 10,
        "mmproj-Model-F16.gguf": data,
        "README.md": b"hi",
    }
    for i, (name, content) in enumerate(files.items()):
        blob = put(repo / "blobs" / f"{i:040x}", content)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    put(repo / "refs" / "main", commit.encode())


def test_hf_cache_layout(tmp_path: Path) -> None:
    data = header_bytes(tmp_path)
    cache = tmp_path / "hub"
    make_hf_cache(cache, data)
    lib = ModelLibrary([tmp_path / "missing"], hf_cache_dir=cache, settle_s=0)
    lib.rescan()
    assert ids(lib) == {"org/Model-GGUF/Model-Q4_K_M", "org/Model-GGUF/Model-Q8_0"}
    q4 = lib.get("org/Model-GGUF/Model-Q4_K_M")
    assert q4 is not None and q4.source == "hf_cache" and q4.repo_id == "org/Model-GGUF"
    assert q4.revision == "a" * 40 and q4.usable
    assert q4.mmproj is not None and q4.mmproj.endswith("mmproj-Model-F16.gguf")
    q8 = lib.get("org/Model-GGUF/Model-Q8_0")
    assert q8 is not None and q8.size_bytes == len(data) + 10


@pytest.fixture
async def watched(tmp_path: Path) -> AsyncIterator[tuple[ModelLibrary, Path]]:
    root = tmp_path / "models"
    root.mkdir()
    lib = ModelLibrary([root], settle_s=0.3)
    stop = asyncio.Event()
    task = asyncio.create_task(lib.watch(stop), name="library-watch")
    try:
        await asyncio.wait_for(lib.watching.wait(), WAIT)
        yield lib, root
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT)


async def until(lib: ModelLibrary, want: set[str]) -> float:
    start = time.monotonic()
    await asyncio.wait_for(lib.wait_until(lambda lb: ids(lb) == want), WAIT)
    return time.monotonic() - start


async def test_live_add_rename_remove(watched: tuple[ModelLibrary, Path], tmp_path: Path) -> None:
    lib, root = watched
    data = header_bytes(tmp_path)
    tmp = put(root / ".x.gguf.tmp", data)
    os.replace(tmp, root / "x.gguf")
    assert await until(lib, {"x"}) < 2.5
    os.replace(root / "x.gguf", root / "y.gguf")
    assert await until(lib, {"y"}) < 2.5
    (root / "y.gguf").unlink()
    assert await until(lib, set()) < 2.5


async def test_live_half_written_file(watched: tuple[ModelLibrary, Path], tmp_path: Path) -> None:
    lib, root = watched
    data = header_bytes(tmp_path)
    path = root / "slow.gguf"
    with path.open("wb") as out:
        for i in range(0, len(data), max(len(data) // 8, 1)):
            out.write(data[i : i + len(data) // 8])
            out.flush()
            await asyncio.sleep(0.1)
            assert "slow" not in ids(lib)
    assert await until(lib, {"slow"}) < 2.5
    entry = lib.get("slow")
    assert entry is not None and entry.usable


async def test_live_shard_set_appears_when_complete(
    watched: tuple[ModelLibrary, Path], tmp_path: Path
) -> None:
    lib, root = watched
    data = header_bytes(tmp_path)
    put(root / "s-00001-of-00002.gguf", data)
    await asyncio.sleep(0.8)
    assert ids(lib) == set()
    put(root / "s-00002-of-00002.gguf", data)
    await until(lib, {"s"})


async def test_hub_cache_created_after_start(tmp_path: Path) -> None:
    cache = tmp_path / "later" / "hub"
    lib = ModelLibrary([], hf_cache_dir=cache, settle_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(lib.watch(stop), name="library-watch")
    try:
        await asyncio.sleep(0.3)
        make_hf_cache(cache, header_bytes(tmp_path))
        await until(lib, {"org/Model-GGUF/Model-Q4_K_M", "org/Model-GGUF/Model-Q8_0"})
        (
            cache / "models--org--Model-GGUF" / "snapshots" / ("a" * 40) / "Model-Q4_K_M.gguf"
        ).unlink()
        await until(lib, {"org/Model-GGUF/Model-Q8_0"})
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT)
