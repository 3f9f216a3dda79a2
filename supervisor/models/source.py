"""The pool's view of the model library, and the first-start demo models."""

from __future__ import annotations

from pathlib import Path

from supervisor.models.adapters import AdapterEntry, AdapterLink
from supervisor.models.demo import DEMO_MODEL_NAME, write_demo_gguf
from supervisor.models.demo_hf import DEMO_HF_NAME, write_tiny_hf
from supervisor.models.library import ModelEntry, ModelLibrary

DEMO_MARKER = ".demo-model-written"


class LibrarySource:
    """Adapts :class:`ModelLibrary` to the pool's ``ModelSource`` protocol.

    An entry whose header could not be read still resolves: loading it then
    fails in the worker with exit code 3 and the reason is shown, rather than
    the model silently vanishing.
    """

    def __init__(self, library: ModelLibrary) -> None:
        self.library = library

    def resolve(self, model_id: str) -> Path | None:
        entry = self.library.get(model_id)
        return None if entry is None else Path(entry.path)

    def entry(self, model_id: str) -> ModelEntry | None:
        return self.library.get(model_id)

    def pair(self, model_id: str) -> tuple[AdapterLink, AdapterEntry] | None:
        """The adapter pair a ``<base>:<adapter>`` id names (supervisor/models/adapters.py)."""
        return self.library.pair(model_id)

    def adapters(self) -> list[AdapterEntry]:
        return self.library.adapters()

    def model_ids(self) -> list[str]:
        return sorted(e.id for e in self.library.list())

    def entries(self) -> list[ModelEntry]:
        return sorted(self.library.list(), key=lambda e: e.id)


def ensure_demo_model(models_dir: Path, state_dir: Path) -> list[Path]:
    """On the very first start with an empty models dir, write the demo model
    and its Hugging Face twin (to fine-tune offline); returns what was written."""
    marker = state_dir / DEMO_MARKER
    if marker.exists():
        return []
    models_dir.mkdir(parents=True, exist_ok=True)
    if any(models_dir.rglob("*.gguf")):
        return []
    written = [write_demo_gguf(models_dir / f"{DEMO_MODEL_NAME}.gguf")]
    if not (models_dir / DEMO_HF_NAME).exists():
        written.append(write_tiny_hf(models_dir / DEMO_HF_NAME))
    marker.write_text("the tiny random demo models were written on first start\n")
    return written
