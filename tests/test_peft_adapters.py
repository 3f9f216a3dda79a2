"""PEFT adapter dirs in the library: linked to the Hugging Face base they name
(or the one whose dir holds them), listed with the reason when they have none,
and loaded with their base's worker (``ModelEntry.adapters``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from supervisor.models.demo import write_tiny_gguf
from supervisor.models.library import ModelLibrary
from tests.test_hf_library import write_model, write_safetensors


def write_adapter(d: Path, base: str | None, config: Any = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    if config is None:
        config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
        if base is not None:
            config["base_model_name_or_path"] = base
    (d / "adapter_config.json").write_text(json.dumps(config))
    write_safetensors(d / "adapter_model.safetensors",
                      {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": ("BF16", [4, 256])})
    return d


def library(root: Path) -> ModelLibrary:
    lib = ModelLibrary([root], settle_s=0, vllm_python=sys.executable)
    lib.rescan()
    return lib


def test_adapters_link_to_the_hf_base_they_name(tmp_path: Path) -> None:
    base = write_model(tmp_path / "org" / "base")
    write_model(tmp_path / "other")
    write_tiny_gguf(tmp_path / "tiny.gguf")
    write_adapter(tmp_path / "by-path", str(base))  # as PEFT writes it after a local load
    write_adapter(tmp_path / "by-id", "org/base")
    write_adapter(tmp_path / "by-hub-name", "someone/base")  # the base dir has the repo's name
    write_adapter(base / "inside", None)  # no name: the base whose dir holds it
    write_adapter(tmp_path / "for-gguf", "tiny")  # llama.cpp loads GGUF adapters only
    write_adapter(tmp_path / "broken", None, config=[1, 2])
    lib = library(tmp_path)
    assert {e.id for e in lib.list()} == {"org/base", "other", "tiny"}  # no adapter is a model
    adapters = {a.id: a for a in lib.adapters()}
    for aid in ("by-path", "by-id", "by-hub-name", "org/base/inside"):
        assert [(lk.base, lk.id, lk.fits) for lk in adapters[aid].links] == [("org/base", f"org/base:{aid}", True)]
        assert lib.pair(f"org/base:{aid}") is not None
    entry = lib.get("org/base")
    assert entry is not None
    assert sorted(a.id for a in entry.adapters) == ["by-hub-name", "by-id", "by-path", "org/base/inside"]
    assert {a.path for a in entry.adapters} == {str(adapters[a].path) for a in
                                                 ("by-path", "by-id", "by-hub-name", "org/base/inside")}
    for aid in ("for-gguf", "broken"):
        assert not adapters[aid].usable and not adapters[aid].links and adapters[aid].reason, adapters[aid]
    assert "adapter_config.json" in (adapters["broken"].reason or "")


def test_an_adapter_waits_until_its_files_settle(tmp_path: Path) -> None:
    write_model(tmp_path / "base")
    lib = ModelLibrary([tmp_path], settle_s=3600, vllm_python=sys.executable)
    write_adapter(tmp_path / "fresh", "base")
    lib.rescan()
    assert not lib.adapters() and str(tmp_path / "fresh" / "adapter_model.safetensors") in lib.pending
