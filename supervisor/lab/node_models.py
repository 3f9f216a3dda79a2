"""The life of a model held on cluster nodes' own disks, after its download.

A download that names a node leaves the model in that node's own Hub cache
and a record of it here (supervisor/lab/node_files.py). This module owns
what happens to it later:

- **Removing it** (``DELETE /api/models/{id}``): every node that holds it
  must be in the cluster and answer, and must accept every path (its agent
  bounds them to its Hub cache, supervisor/workers/node_hub.py), before
  anything is touched; a node that is not there is a 409 naming it, and
  nothing is removed. Then its workers are unloaded, each node's agent
  removes the files, and each node's record is dropped once its files are
  gone.
- **Its file gone from a node** (removed by hand, a disk replaced): the
  pool asks before it starts a worker there (:meth:`NodeModels.check_placed`).
  A missing file drops that node's record, so the model is listed with
  its other nodes; when it was the last, the model stays listed as
  unusable with the reason until it is downloaded again, deleted, or the
  service restarts (nothing of it is left in SQLite). The load is refused
  naming the node and the file, instead of a worker that fails to load
  again and again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from supervisor.errors import Conflict, ModelNotFound, Unavailable
from supervisor.lab.node_files import NodeFiles, node_entries
from supervisor.lab.node_jobs import JobNodes
from supervisor.models.entry import ModelEntry
from supervisor.workers.node_hub import Removal

log = logging.getLogger(__name__)


class NodeModels:
    def __init__(self, files: NodeFiles, nodes: JobNodes,
                 on_node_models: Callable[[list[ModelEntry]], None] | None) -> None:
        self.files = files
        self.nodes = nodes
        # Told the models held on nodes after each change (the library lists them).
        self.on_node_models = on_node_models
        # Models whose last node lost the file: listed unusable, with why (in memory).
        self._lost: dict[str, ModelEntry] = {}
        # Models being removed: listed unusable meanwhile, so no load starts a worker on them.
        self._removing: set[str] = set()

    async def relist(self) -> None:
        """Tell the library the recorded models, and those lost since."""
        entries = node_entries(await self.files.held_models())
        for entry in entries:
            self._lost.pop(entry.id, None)  # downloaded again
        entries = [msgspec.structs.replace(e, usable=False, reason="it is being removed from its nodes")
                   if e.id in self._removing else e for e in entries]
        if self.on_node_models is not None:
            self.on_node_models([*entries, *self._lost.values()])

    async def remove(self, model_id: str, unload: Callable[[str], Awaitable[object]]) -> dict[str, int]:
        """Remove the model from every node that holds it; each node -> the
        bytes freed there. 409 (nothing removed) when a node that holds it is
        not in the cluster, does not answer, or refuses a path."""
        held = await self.files.model_files(model_id)
        if not held and self._lost.pop(model_id, None) is not None:
            await self.relist()  # its files are gone already: it is forgotten
            return {}
        if not held:
            raise ModelNotFound(f"model '{model_id}' is held on no cluster node's own disk")
        try:
            alive = set(await self.nodes.node_names())
        except OSError as exc:  # ClusterError: the cluster does not answer
            raise Unavailable(f"the cluster does not answer ({exc}); nothing of model {model_id} was removed",
                              code="cluster_unavailable") from exc
        gone = sorted(set(held) - alive)
        if gone:
            raise Conflict(f"model {model_id} is held on node {', '.join(gone)}, which is not in the cluster now; "
                           "nothing was removed: delete it again once that node is back", code="node_unreachable")
        # Every node checks every path before any is removed: one silent or refusing node removes nothing.
        for node, paths in held.items():
            try:
                found = await self.nodes.check_hub_files(node, paths)
            except OSError as exc:
                raise Conflict(f"node {node}, which holds model {model_id}, does not answer ({exc}); "
                               "nothing was removed", code="node_unreachable") from exc
            if found["refused"]:
                raise Conflict(f"node {node} refuses to remove {found['refused'][0]}: it is no file of a "
                               "snapshot in its own Hub cache; nothing was removed", code="path_refused")
        # A worker serving it holds its file open there: it goes first, and no
        # load may start another while its files go.
        self._removing.add(model_id)
        freed: dict[str, int] = {}
        try:
            await self.relist()
            await unload(model_id)
            for node, paths in held.items():
                done = await self._remove_on(node, model_id, paths, freed)
                await self.files.drop(node, paths)
                freed[node] = done.freed_bytes
                log.info("model %s removed from node %s: %d file(s), %d bytes", model_id, node,
                         len(done.removed), done.freed_bytes)
        finally:
            self._removing.discard(model_id)
            await self.relist()
        return freed

    async def _remove_on(self, node: str, model_id: str, paths: list[str],
                         freed: dict[str, int]) -> Removal:
        try:
            done = await self.nodes.remove_hub_files(node, paths)
        except OSError as exc:
            # It answered the check a moment ago: the nodes already done stay done.
            before = f"; it was removed from {', '.join(freed)}" if freed else ""
            raise Conflict(f"node {node} did not remove model {model_id} ({exc}); its record there "
                           f"stays{before}", code="node_unreachable") from exc
        if done.refused:
            raise Conflict(f"node {node} refused to remove {done.refused[0]}; its record there stays",
                           code="path_refused")
        return done

    async def check_placed(self, model_id: str, node: str, path: str) -> str | None:
        """Before a worker starts on ``node``: None when the model's file is
        there; else its record on that node is dropped (the library lists it
        with its other nodes, or not at all) and the reason is returned."""
        try:
            found = await self.nodes.check_hub_files(node, [path])
        except OSError as exc:
            # The start itself goes through that agent and says why it fails.
            log.warning("node %s did not say whether %s is there: %s", node, path, exc)
            return None
        if found["present"] or found["refused"]:
            # Refused: the path is outside the node's Hub cache now (its HF_HOME
            # changed); the worker loads it by its path, and says so if it cannot.
            return None
        dropped = await self.files.drop(node, (await self.files.model_files(model_id)).get(node, [path]))
        log.warning("model %s: its file %s is no longer on node %s; dropped its record there (%d file(s))",
                    model_id, path, node, dropped)
        why = f"model {model_id}'s file {path} is no longer on node {node}; its record there was dropped"
        if not await self.files.model_files(model_id):
            self._lost[model_id] = ModelEntry(
                id=model_id, path=path, files=[path], size_bytes=0, source="node", root="", mtime=time.time(),
                usable=False, reason=f"its file {path} is gone from node {node}, the last node that held it; "
                                     "download it again")
        await self.relist()
        return why
