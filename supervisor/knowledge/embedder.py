"""The embedding model a knowledge base uses, reached the way /v1/embeddings
reaches it: the worker pool's embedding worker for that model.

The model is a setting (``file_search_embedding_model``); with none set, or
one the library cannot serve, every use is a 409 that names the setting, so
an operator knows what to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from supervisor.errors import Conflict
from supervisor.knowledge.chunking import EMBED_MAX_TOKENS
from supervisor.knowledge.vectors import Vector, unit

SETTING = "file_search_embedding_model"


class ModelPool(Protocol):
    """What the knowledge base needs of the worker pool."""

    async def embed(self, model: str, inputs: list[str], caller: str = "") -> _Embeddings: ...

    async def tokenize(self, model: str, text: str, add_special: bool = True,
                       embedding: bool = False) -> list[int]: ...


class _Embeddings(Protocol):
    @property
    def vectors(self) -> list[list[float]]: ...


class Library(Protocol):
    def model_ids(self) -> list[str]: ...


class NoEmbeddingModel(Conflict):
    code = "embedding_model_unavailable"


class Embedder:
    def __init__(self, pool: ModelPool, library: Library, model: str) -> None:
        self.pool = pool
        self.library = library
        self.model = model

    def current(self) -> str:
        """The model new vector stores are made with; 409 naming the setting without one."""
        if not self.model:
            raise NoEmbeddingModel(f"vector stores need an embedding model: set {SETTING} to a model id "
                                   "from /v1/models", param=SETTING)
        self.check(self.model)
        return self.model

    def check(self, model: str) -> None:
        if model not in self.library.model_ids():
            raise NoEmbeddingModel(f"the embedding model {model!r} ({SETTING}) is not in the model library; "
                                   f"set {SETTING} to a model id from /v1/models", param=SETTING)

    async def count(self, model: str, text: str) -> int:
        """Tokens the model's embedding worker makes of ``text`` (special ones included)."""
        return len(await self.pool.tokenize(model, text, add_special=True, embedding=True))

    async def embed(self, model: str, texts: Sequence[str], caller: str) -> list[Vector]:
        self.check(model)
        out = await self.pool.embed(model, list(texts), caller)
        return [unit(v) for v in out.vectors]

    @staticmethod
    def input_limit() -> int:
        return EMBED_MAX_TOKENS
