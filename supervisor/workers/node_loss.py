"""What the worker pool does as a cluster's nodes leave and join.

supervisor/workers/cluster_nodes.py tells when a node left the cluster (or
joined it); this module acts on it for the pool (supervisor/workers/pool.py):

- **A node lost** ends the workers that ran there, each with the reason and
  the error ``node_lost`` for its requests, and loads their models again
  wherever there is room (as a request would load them: their configured
  settings). The reloads run in tasks this module owns, so that the node
  watch that told it never waits for a load.
- **Models on nodes' own disks** (a download that named a node:
  supervisor/lab/node_files.py) are listed by the library as usable while a
  node that holds them is in the cluster, else as unusable with the
  reason; a node's loss or arrival lists them afresh.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec

from supervisor.errors import ApiError
from supervisor.models.entry import ModelEntry
from supervisor.models.gpu_reading import device_node
from supervisor.workers.gpu_room import worker_devices
from supervisor.workers.handle import WorkerHandle

log = logging.getLogger("gpuvisor.pool")

Key = tuple[str, bool]


class NodeLoss:
    """The pool's side of nodes leaving and joining."""

    def __init__(self, handles: dict[Key, WorkerHandle], forget: Callable[[Key], WorkerHandle | None],
                 changed: Callable[[], None], load: Callable[[str, bool], Awaitable[object]],
                 list_models: Callable[[list[ModelEntry]], None], serving: Callable[[], list[str] | None]) -> None:
        self.handles = handles
        # The pool's: take a worker out of its books, say its workers changed, load a model.
        self._forget = forget
        self._changed = changed
        self._load = load
        # The library's list of models on nodes' own disks, and the nodes serving now (None: no cluster).
        self._list_models = list_models
        self._serving = serving
        self._replacing: set[asyncio.Task[None]] = set()
        self._node_models: list[ModelEntry] = []

    # ------------------------------------------------------------ a node's loss

    def lost(self, node: str, reason: str) -> None:
        """A cluster node left: its workers end with the reason, and their
        models are loaded again where there is room (a task owned here)."""
        self._relist_if_held(node)
        task = asyncio.create_task(self._replace(node, reason), name=f"node-lost:{node}")
        self._replacing.add(task)
        task.add_done_callback(self._replaced)

    def joined(self, node: str) -> None:
        self._relist_if_held(node)

    async def stop(self) -> None:
        """Cancel the reloads still running (the pool is stopping)."""
        for task in self._replacing:
            task.cancel()
        await asyncio.gather(*self._replacing, return_exceptions=True)

    def _replaced(self, task: asyncio.Task[None]) -> None:
        self._replacing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("placing the models of a lost node again failed", exc_info=task.exception())

    async def _replace(self, node: str, reason: str) -> None:
        keys = [k for k, h in self.handles.items() if any(device_node(d) == node for d in worker_devices(h))]
        lost = [(k, h) for k in keys if (h := self._forget(k)) is not None]
        self._changed()
        await asyncio.gather(*(h.stop(reason, "node_lost") for _, h in lost))
        for (model_id, embedding), _ in lost:
            log.warning("%s%s: %s; loading it again where there is room", model_id,
                        " (embedding)" if embedding else "", reason)
            try:
                await self._load(model_id, embedding)
            except ApiError as exc:
                log.warning("%s could not be loaded again after %s: %s", model_id, reason, exc.message)

    # ------------------------------------------------------------ models on nodes' own disks

    def set_node_models(self, entries: list[ModelEntry]) -> None:
        """The models held on nodes' own disks (the job runner's records)."""
        self._node_models = entries
        self._relist()

    def _relist_if_held(self, node: str) -> None:
        if any(node in e.nodes for e in self._node_models):
            self._relist()

    def _relist(self) -> None:
        serving = self._serving()
        alive = set(serving or ())
        listed = []
        for entry in self._node_models:
            held = ", ".join(sorted(entry.nodes))
            if serving is None:
                why = f"it is held only on the own disk of {held}, and no cluster is configured"
            elif not alive & set(entry.nodes):
                why = f"it is held only on the own disk of {held}, which is not in the cluster now"
            else:
                why = None
            listed.append(entry if why is None or not entry.usable
                          else msgspec.structs.replace(entry, usable=False, reason=why))
        self._list_models(listed)
