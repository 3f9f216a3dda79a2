"""A fine-tune's adapter in the outputs dir is in the library at once:
``<outputs>/<run>/adapter`` is the adapter ``<run>`` on the Hugging Face base
it names, served by vLLM with no export; its checkpoints are not listed."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft", reason="needs the train extra")

from supervisor.models.demo_hf import write_tiny_hf
from supervisor.models.library import ModelLibrary
from tests.lora_support import random_adapter


def _library(models: Path, outputs: Path) -> ModelLibrary:
    lib = ModelLibrary([models], settle_s=0, vllm_python=sys.executable, adapter_dirs=[outputs])
    lib.rescan()
    return lib


def test_a_finetunes_adapter_is_listed_on_its_base_and_its_checkpoints_are_not(tmp_path: Path) -> None:
    models, outputs = tmp_path / "models", tmp_path / "outputs"
    base = write_tiny_hf(models / "tiny-twin")
    adapter = random_adapter(base, outputs / "run1" / "adapter", seed=1)
    shutil.copytree(adapter, outputs / "run1" / "checkpoints" / "checkpoint-4")
    shutil.copytree(adapter, outputs / ".hidden" / "adapter")
    (outputs / "notes.txt").write_text("not a run")
    lib = _library(models, outputs)
    [listed] = lib.adapters()
    assert (listed.id, listed.path, listed.usable) == ("run1", str(adapter), True)
    assert [(lk.base, lk.id, lk.fits) for lk in listed.links] == [("tiny-twin", "tiny-twin:run1", True)]
    assert lib.pair("tiny-twin:run1") is not None
    entry = lib.get("tiny-twin")
    assert entry is not None and [a.id for a in entry.adapters] == ["run1"]


def test_an_adapter_whose_base_is_not_in_the_library_says_why(tmp_path: Path) -> None:
    models, outputs = tmp_path / "models", tmp_path / "outputs"
    base = write_tiny_hf(tmp_path / "elsewhere" / "tiny-twin")
    models.mkdir()
    random_adapter(base, outputs / "run2" / "adapter", seed=2)
    shutil.rmtree(base)
    [listed] = _library(models, outputs).adapters()
    assert listed.id == "run2" and not listed.usable and listed.links == []
    assert listed.reason is not None and "base model" in listed.reason


def test_without_an_outputs_dir_nothing_changes(tmp_path: Path) -> None:
    models = tmp_path / "models"
    base = write_tiny_hf(models / "tiny-twin")
    random_adapter(base, tmp_path / "outputs" / "run1" / "adapter", seed=1)
    lib = ModelLibrary([models], settle_s=0, vllm_python=sys.executable)
    lib.rescan()
    assert lib.adapters() == []
