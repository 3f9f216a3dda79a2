"""The simplest model source: GGUF files directly in the models dir.

A model id is the file name without ``.gguf``. Temporary and hidden names
are skipped. (The full library with shards, projectors and the Hugging Face
cache replaces this where it is wired in.)
"""

from __future__ import annotations

from pathlib import Path

from supervisor.demo_model import DEMO_MODEL_NAME, write_tiny_gguf

DEMO_MARKER = ".demo-model-written"


class ModelsDir:
    def __init__(self, root: Path) -> None:
        self.root = root

    def _files(self) -> dict[str, Path]:
        if not self.root.is_dir():
            return {}
        out: dict[str, Path] = {}
        for path in sorted(self.root.glob("*.gguf")):
            if path.name.startswith(".") or not path.is_file():
                continue
            out[path.name[: -len(".gguf")]] = path
        return out

    def resolve(self, model_id: str) -> Path | None:
        return self._files().get(model_id)

    def model_ids(self) -> list[str]:
        return list(self._files())


def ensure_demo_model(models_dir: Path, state_dir: Path) -> Path | None:
    """On the very first start with an empty models dir, write the demo model."""
    marker = state_dir / DEMO_MARKER
    if marker.exists():
        return None
    models_dir.mkdir(parents=True, exist_ok=True)
    if any(models_dir.glob("*.gguf")):
        return None
    path = write_tiny_gguf(models_dir / f"{DEMO_MODEL_NAME}.gguf")
    marker.write_text("the tiny random demo model was written on first start\n")
    return path
