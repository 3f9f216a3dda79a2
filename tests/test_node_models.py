"""Models held on cluster nodes' own disks, after their download: removed
through the nodes' agents (bounded to each node's Hub cache), and dropped
from the records when a node's file is gone. Real node agents in this
process (tests/agent_nodes.py: no Ray), real files in Hub-cache layout,
real SQLite."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import httpx
import pytest

from supervisor.appkeys import JOB_RUNNER
from supervisor.config import ModelSettings
from supervisor.errors import Conflict, ModelNotFound, NotFound
from supervisor.lab.node_files import NodeFiles
from supervisor.lab.node_models import NodeModels
from supervisor.models.entry import ModelEntry
from supervisor.models.slots import SlotAsk
from supervisor.workers.gpu_room import GpuRoom
from supervisor.workers.node_agent import NodeAgent
from supervisor.workers.room import Room
from tests import gguf_headers as hdr
from tests.agent_nodes import AgentNodes
from tests.jobsupport import open_store
from tests.server import short_tempdir
from tests.test_cluster_devices import _gpu, _no_drop, _Nodes, _RoomConfig
from tests.test_web_ui_job_node import served

pytestmark = pytest.mark.timeout(120)

REPO = "org/Tiny-GGUF"
MODEL_ID = "org/Tiny-GGUF/Tiny-Q8_0"


def _cache(home: Path, files: dict[str, bytes], revision: str = "c0ffee", repo: str = REPO) -> list[Path]:
    """Files in a Hub cache's layout under ``home`` (an HF_HOME): each a
    snapshot symlink to its blob, as huggingface_hub leaves them; their paths."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    paths = []
    for name, content in files.items():
        blob = root / "blobs" / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        link = snapshot / name
        link.symlink_to(os.path.relpath(blob, link.parent))
        paths.append(link)
    return paths


def _agent(home: Path) -> NodeAgent:
    return NodeAgent(str(short_tempdir("gvn")), environ={"HF_HOME": str(home)})


async def test_a_node_agent_removes_files_of_its_own_hub_cache_and_nothing_else(tmp_path: Path) -> None:
    home = tmp_path / "node-a-hf"
    agent = _agent(home)
    old_model, readme = _cache(home, {"Tiny-Q8_0.gguf": b"GGUF old", "README.md": b"# tiny"}, "rev1")
    new_model, new_readme = _cache(home, {"Tiny-Q8_0.gguf": b"GGUF new", "README.md": b"# tiny"}, "rev2")
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    # A snapshot folder that is a symlink out of the cache, and a snapshot file linking out of the blobs.
    evil = home / "hub" / "models--org--Evil" / "snapshots"
    evil.mkdir(parents=True)
    (evil / "r").symlink_to(tmp_path)
    leak = home / "hub" / "models--org--Leak" / "snapshots" / "r" / "x.gguf"
    leak.parent.mkdir(parents=True)
    leak.symlink_to(outside)

    hostile = [str(evil / "r" / "precious.txt"),  # through a folder that leads out
               str(old_model.parent / ".." / ".." / ".." / ".." / ".." / "precious.txt"),
               str(outside), "relative/Tiny-Q8_0.gguf", str(home / "hub" / "token"),
               str(old_model.parent.parent)]  # the snapshots folder itself, not a file in a snapshot
    for raw in hostile:
        done = await agent.remove_hub_files([str(old_model), raw])
        assert done.refused == [raw] and done.removed == [], raw
        assert old_model.read_bytes() == b"GGUF old" and outside.read_text() == "keep me"
    assert (await agent.check_hub_files([str(old_model), str(tmp_path / "x"), str(home / "hub" / "m--x" / "f")])) \
        == {"present": [str(old_model)], "missing": [], "refused": [str(tmp_path / "x"), str(home / "hub" / "m--x" / "f")]}

    # One revision goes: its files and blobs; the blob the other revision shares (README) stays.
    done = await agent.remove_hub_files([str(old_model), str(readme)])
    assert done.removed == [str(old_model), str(readme)] and done.refused == []
    assert done.freed_bytes == len(b"GGUF old")
    assert not old_model.parent.exists()
    assert new_model.read_bytes() == b"GGUF new" and new_readme.read_bytes() == b"# tiny"
    # A link out of the repo's blobs goes; what it points to stays.
    assert (await agent.remove_hub_files([str(leak)])).removed == [str(leak)]
    assert not leak.is_symlink() and outside.read_text() == "keep me"
    # Removed again: already gone, no error. The last revision takes its repo with it.
    assert (await agent.remove_hub_files([str(old_model)])).missing == [str(old_model)]
    done = await agent.remove_hub_files([str(new_model), str(new_readme)])
    assert done.freed_bytes == len(b"GGUF new") + len(b"# tiny")
    assert not (home / "hub" / "models--org--Tiny-GGUF").exists()
    assert (await agent.check_hub_files([str(new_model)]))["missing"] == [str(new_model)]


def _download(files: list[Path], job_id: str) -> dict[str, object]:
    """A download job's result for these cached files (the model first)."""
    return {"repo_id": REPO, "revision": "main", "commit": files[0].parent.name, "model_id": MODEL_ID,
            "files": [{"path": f.name, "size": f.stat().st_size, "local_path": str(f)} for f in files]}


async def test_a_model_is_removed_from_every_node_that_holds_it_or_from_none(tmp_path: Path) -> None:
    homes = {n: tmp_path / f"{n}-hf" for n in ("node-a", "node-b")}
    held = {n: _cache(h, {"Tiny-Q8_0.gguf": b"GGUF " + n.encode(), "mmproj-Tiny-F16.gguf": b"GGUF proj"})
            for n, h in homes.items()}
    agents = {n: _agent(h) for n, h in homes.items()}
    listed: list[list[ModelEntry]] = []
    unloaded: list[tuple[str, bool]] = []

    async def unload(model_id: str) -> bool:
        # A worker serving it goes before its files do, and meanwhile no load may start one.
        unloaded.append((model_id, all(p.exists() for files in held.values() for p in files)))
        (removing,) = listed[-1]
        assert not removing.usable and removing.reason == "it is being removed from its nodes"
        return True

    async with open_store(tmp_path / "state" / "gpuvisor.db") as store:
        files = NodeFiles(store.db)
        for i, (node, paths) in enumerate(held.items()):
            await files.record_download(node, f"job_{i}", _download(paths, f"job_{i}"), None)
        # node-b is not in the cluster now: a 409 naming it, and nothing is removed anywhere.
        models = NodeModels(files, AgentNodes({"node-a": agents["node-a"]}), listed.append)
        with pytest.raises(Conflict, match="held on node node-b, which is not in the cluster now") as info:
            await models.remove(MODEL_ID, unload)
        assert info.value.status == 409 and info.value.code == "node_unreachable"
        assert all(p.exists() for paths in held.values() for p in paths)
        assert unloaded == [] and set(await files.model_files(MODEL_ID)) == {"node-a", "node-b"}

        nodes = AgentNodes(agents)
        models = NodeModels(files, nodes, listed.append)
        freed = await models.remove(MODEL_ID, unload)
        assert freed == {n: len(b"GGUF " + n.encode()) + len(b"GGUF proj") for n in held}
        assert unloaded == [(MODEL_ID, True)]
        assert sorted(n for n, _ in nodes.removals) == ["node-a", "node-b"]
        assert not any(p.exists() for paths in held.values() for p in paths)
        assert await files.model_files(MODEL_ID) == {} and await files.held_models() == []
        assert listed[-1] == []
        with pytest.raises(ModelNotFound):
            await models.remove(MODEL_ID, unload)


async def test_a_nodes_missing_file_drops_its_record_and_says_which(tmp_path: Path) -> None:
    homes = {n: tmp_path / f"{n}-hf" for n in ("node-a", "node-b")}
    held = {n: _cache(h, {"Tiny-Q8_0.gguf": b"GGUF " + n.encode()}) for n, h in homes.items()}
    listed: list[list[ModelEntry]] = []
    async with open_store(tmp_path / "state" / "gpuvisor.db") as store:
        files = NodeFiles(store.db)
        for i, (node, paths) in enumerate(held.items()):
            await files.record_download(node, f"job_{i}", _download(paths, f"job_{i}"), None)
        models = NodeModels(files, AgentNodes({n: _agent(h) for n, h in homes.items()}), listed.append)
        path_a = str(held["node-a"][0])
        assert await models.check_placed(MODEL_ID, "node-a", path_a) is None
        # Its blob is removed by hand on node-a: the snapshot link dangles.
        Path(os.path.realpath(path_a)).unlink()
        reason = await models.check_placed(MODEL_ID, "node-a", path_a)
        assert reason == (f"model {MODEL_ID}'s file {path_a} is no longer on node node-a; "
                          "its record there was dropped")
        # Listed with its other node only.
        (entry,) = listed[-1]
        assert entry.nodes == {"node-b": str(held["node-b"][0])}
        assert set(await files.model_files(MODEL_ID)) == {"node-b"}


def test_deleting_a_model_over_http_removes_it_from_its_node_or_answers_409(tiny_model_path: Path) -> None:
    home = Path(short_tempdir("gvh"))
    model, proj = _cache(home, {"Tiny-Q8_0.gguf": tiny_model_path.read_bytes(), "mmproj-Tiny-F16.gguf": b"GGUF p"})
    node_c = _agent(home)
    nodes = AgentNodes({"node-b": _agent(Path(short_tempdir("gvh")))})
    with served(tiny_model_path, nodes) as (base, (app, loop)):
        runner = app[JOB_RUNNER]

        async def record() -> None:
            assert runner.node_models is not None
            await runner.node_models.files.record_download("node-c", "job_x", _download([model, proj], "job_x"),
                                                           await node_c.read_model(str(model)))
            await runner.node_models.relist()

        asyncio.run_coroutine_threadsafe(record(), loop).result(10)
        url = f"{base}/api/models/{MODEL_ID}"
        listed = httpx.get(url, timeout=10).json()
        # Its projector, downloaded with it there, is linked: it takes images until its worker says.
        assert listed["nodes"] == ["node-c"] and listed["mmproj"] == str(proj) and listed["vision"] is True
        # A model in the shared directories is the owner's; an unknown one is a 404.
        shared = httpx.delete(f"{base}/api/models/tiny", timeout=10)
        assert shared.status_code == 409 and shared.json()["error"]["code"] == "model_not_removable"
        assert httpx.delete(f"{base}/api/models/org/Nope", timeout=10).status_code == 404
        # node-c is not in the cluster: 409 naming it, and its file stays.
        gone = httpx.delete(url, timeout=10)
        assert gone.status_code == 409, gone.text
        assert "node node-c" in gone.json()["error"]["message"] and model.exists()
        nodes.agents["node-c"] = node_c
        done = httpx.delete(url, timeout=10)
        assert done.status_code == 200, done.text
        assert done.json() == {"id": MODEL_ID, "object": "model", "deleted": True, "nodes": ["node-c"],
                               "freed_bytes": tiny_model_path.stat().st_size + len(b"GGUF p")}
        assert not model.exists() and not (home / "hub" / "models--org--Tiny-GGUF").exists()
        assert httpx.get(url, timeout=10).status_code == 404


async def test_a_load_goes_to_a_node_that_still_has_the_file_else_says_which_file_is_gone(tmp_path: Path) -> None:
    """Placement (supervisor/workers/room.py) asks the node it chose: a node
    that lost the file is dropped and the model placed on another holder;
    with none left, the load is a 404 naming the node and the file."""
    header = hdr.llama_gqa(tmp_path / "big.gguf").read_bytes()
    homes = {n: tmp_path / f"{n}-hf" for n in ("node-a", "node-b")}
    held = {n: _cache(h, {"Tiny-Q8_0.gguf": header}) for n, h in homes.items()}
    agents = {n: _agent(h) for n, h in homes.items()}
    listed: dict[str, ModelEntry] = {}

    def relist(entries: list[ModelEntry]) -> None:
        listed.clear()
        listed.update({e.id: e for e in entries})

    async with open_store(tmp_path / "state" / "gpuvisor.db") as store:
        files = NodeFiles(store.db)
        for i, (node, paths) in enumerate(held.items()):
            read = await agents[node].read_model(str(paths[0]))  # the header, as the node's agent reads it
            await files.record_download(node, f"job_{i}", _download(paths, f"job_{i}"), read)
        models = NodeModels(files, AgentNodes(agents), relist)
        await models.relist()
        # node-a has the most room.
        room = Room(_RoomConfig(), {}, {}, _no_drop, asyncio.Event(),
                    gpus=GpuRoom(None, (), lambda _d: None, 0.1, nodes=_Nodes([_gpu("node-a", 0, 20),
                                                                               _gpu("node-b", 0, 14)])))
        room.check_held = models.check_placed

        async def place() -> tuple[ModelEntry, str]:
            entry, _, placed = await room.fit_held(listed[MODEL_ID], ModelSettings(), False, SlotAsk(4, 4), False,
                                                   None, listed.get)
            return entry, placed.node

        entry, node = await place()
        assert node == "node-a" and entry.path == str(held["node-a"][0])
        Path(os.path.realpath(held["node-a"][0])).unlink()  # its blob removed by hand there
        entry, node = await place()
        assert node == "node-b" and entry.path == entry.files[0] == str(held["node-b"][0])
        assert listed[MODEL_ID].nodes == {"node-b": str(held["node-b"][0])}
        held["node-b"][0].unlink()  # its snapshot link removed there
        with pytest.raises(NotFound) as info:
            await place()
        assert info.value.status == 404 and info.value.code == "model_file_missing"
        assert info.value.message == (f"model {MODEL_ID}'s file {held['node-b'][0]} is no longer on node node-b; "
                                      "its record there was dropped")
        # Nothing of it is recorded now, but it stays listed, unusable, saying why.
        assert await files.held_models() == []
        lost = listed[MODEL_ID]
        assert not lost.usable and lost.reason == (f"its file {held['node-b'][0]} is gone from node node-b, "
                                                   "the last node that held it; download it again")
        # Deleting it forgets it.
        assert await models.remove(MODEL_ID, _unload_nothing) == {} and listed == {}
        with pytest.raises(ModelNotFound):
            await models.remove(MODEL_ID, _unload_nothing)



async def test_a_nodes_projector_goes_with_its_model_and_stays_while_another_quant_needs_it(tmp_path: Path) -> None:
    """A download with its mmproj into a node's own cache: the model is listed
    with that projector, a worker placed on a node gets that node's, and
    removing one quant of the repo keeps the projector the other still uses."""
    homes = {n: tmp_path / f"{n}-hf" for n in ("node-a", "node-b")}
    header = hdr.llama_gqa(tmp_path / "big.gguf").read_bytes()
    agents = {n: _agent(h) for n, h in homes.items()}
    listed: dict[str, ModelEntry] = {}

    def relist(entries: list[ModelEntry]) -> None:
        listed.clear()
        listed.update({e.id: e for e in entries})

    q4_id = "org/Tiny-GGUF/Tiny-Q4_K_M"
    async with open_store(tmp_path / "state" / "gpuvisor.db") as store:
        files = NodeFiles(store.db)
        q8 = {n: _cache(h, {"Tiny-Q8_0.gguf": header, "mmproj-Tiny-F16.gguf": b"GGUF proj " + n.encode(),
                            "README.md": b"# tiny"}) for n, h in homes.items()}
        for i, (node, paths) in enumerate(q8.items()):
            await files.record_download(node, f"job_{i}", _download(paths, f"job_{i}"),
                                        await agents[node].read_model(str(paths[0])))
        # A second quant of the same revision on node-a, its download fetching the projector again.
        (q4,) = _cache(homes["node-a"], {"Tiny-Q4_K_M.gguf": header})
        proj_a, readme_a = q8["node-a"][1], q8["node-a"][2]
        await files.record_download("node-a", "job_q4", {**_download([q4, proj_a, readme_a], "job_q4"),
                                                         "model_id": q4_id},
                                    await agents["node-a"].read_model(str(q4)))
        models = NodeModels(files, AgentNodes(agents), relist)
        await models.relist()
        entry = listed[MODEL_ID]
        assert entry.node_mmproj == {n: str(paths[1]) for n, paths in q8.items()}
        assert entry.mmproj is not None and listed[q4_id].node_mmproj == {"node-a": str(proj_a)}
        room = Room(_RoomConfig(), {}, {}, _no_drop, asyncio.Event(),
                    gpus=GpuRoom(None, (), lambda _d: None, 0.1, nodes=_Nodes([_gpu("node-a", 0, 14),
                                                                               _gpu("node-b", 0, 20)])))
        placed_entry, _, placed = await room.fit_held(entry, ModelSettings(), False, SlotAsk(4, 4), False, None,
                                                      listed.get)
        # On node-b, with node-b's projector: what its worker's --mmproj gets.
        assert placed.node == "node-b" and placed_entry.mmproj == str(q8["node-b"][1])

        await models.remove(MODEL_ID, _unload_nothing)
        # node-a keeps the projector and README the Q4 quant still uses; node-b's went with the model.
        assert not q8["node-a"][0].exists() and proj_a.exists() and readme_a.exists() and q4.exists()
        assert not (homes["node-b"] / "hub" / "models--org--Tiny-GGUF").exists()
        assert list(listed) == [q4_id] and listed[q4_id].node_mmproj == {"node-a": str(proj_a)}
        await models.remove(q4_id, _unload_nothing)
        assert not (homes["node-a"] / "hub" / "models--org--Tiny-GGUF").exists() and listed == {}


async def _unload_nothing(_model_id: str) -> bool:
    return False
