"""What the library tells of an hf model's images from its config.json
alone (supervisor/models/hf_vision.py), before any worker loads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from supervisor.models.hf_vision import hf_takes_images


def _dir(tmp_path: Path, name: str, config: Any) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(d)


def test_a_vision_tower_makes_a_vision_model(tmp_path: Path) -> None:
    blip2 = {"architectures": ["Blip2ForConditionalGeneration"], "vision_config": {"hidden_size": 64},
             "text_config": {"model_type": "opt"}}
    assert hf_takes_images(_dir(tmp_path, "blip2", blip2)) is True


def test_text_models_take_none(tmp_path: Path) -> None:
    assert hf_takes_images(_dir(tmp_path, "llama", {"architectures": ["LlamaForCausalLM"]})) is False
    # A family's text model alone, its config keeping the tower's settings.
    text_only = {"architectures": ["Gemma3ForCausalLM"], "vision_config": {"hidden_size": 64}}
    assert hf_takes_images(_dir(tmp_path, "gemma3-text", text_only)) is False
    # A vision_config that is no object, or no architecture at all.
    assert hf_takes_images(_dir(tmp_path, "odd", {"architectures": ["X"], "vision_config": "yes"})) is False
    assert hf_takes_images(_dir(tmp_path, "noarch", {"vision_config": {}})) is False


def test_unreadable_configs_take_none(tmp_path: Path) -> None:
    assert hf_takes_images(_dir(tmp_path, "broken", "{not json")) is False
    assert hf_takes_images(_dir(tmp_path, "list", "[1, 2]")) is False
    assert hf_takes_images(str(tmp_path / "missing")) is False


def test_a_changed_config_is_read_again(tmp_path: Path) -> None:
    d = _dir(tmp_path, "m", {"architectures": ["LlamaForCausalLM"]})
    assert hf_takes_images(d) is False
    config = Path(d) / "config.json"
    config.write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"], "vision_config": {},
                                  "text_config": {"model_type": "llama"}}))
    assert hf_takes_images(d) is True
