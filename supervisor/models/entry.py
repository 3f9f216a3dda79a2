"""One model of the library (:mod:`supervisor.models.library`): a GGUF file
(or shard set) served by llama.cpp, or a Hugging Face safetensors dir (kind
``hf``, :mod:`supervisor.models.hf_info`) served by vLLM."""

from __future__ import annotations

from typing import Literal

import msgspec

from supervisor.models.adapters import AdapterRef
from supervisor.models.gguf_info import GgufInfo
from supervisor.models.hf_info import HfInfo

ModelKind = Literal["gguf", "hf"]
# "node": held only in cluster nodes' own Hub caches (supervisor/lab/node_files.py).
ModelSource = Literal["dir", "hf_cache", "node"]
# The engine each kind of model is served by.
ENGINES: dict[str, str] = {"gguf": "llama.cpp", "hf": "vllm"}


class ModelEntry(msgspec.Struct, kw_only=True):
    """One model the library offers (or lists as unusable, with the reason)."""

    id: str
    # The file to load (the first shard of a set); for an hf model its dir.
    path: str
    files: list[str]
    size_bytes: int
    source: ModelSource
    root: str
    mtime: float
    repo_id: str | None = None
    revision: str | None = None  # hub commit hash
    mmproj: str | None = None
    # Why no projector of the model's folder was linked, or why the link is unchecked.
    projector_note: str | None = None
    quantization: str | None = None
    info: GgufInfo | None = None
    usable: bool = True
    reason: str | None = None
    # The LoRA adapters that fit this model (loaded with its worker).
    adapters: list[AdapterRef] = []
    kind: ModelKind = "gguf"
    hf: HfInfo | None = None  # the facts of an hf model
    # A model on cluster nodes' own disks: each node that holds it -> its path there.
    # Empty for a model in the parent's directories, which every node sees.
    nodes: dict[str, str] = {}
    # Its vision projector on each of those nodes that has one (its download's
    # mmproj there); the worker placed on a node gets that node's.
    node_mmproj: dict[str, str] = {}

    @property
    def engine(self) -> str:
        return ENGINES[self.kind]
