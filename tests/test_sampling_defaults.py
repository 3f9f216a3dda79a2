"""A model's own sampling defaults fill what a request leaves out.

Precedence, field by field: the request, then ``[model_defaults.<id>]``,
then the model's file (GGUF ``general.sampling.*``, an hf model's
generation_config.json), then ours. The effect is checked where a user sees
it: a file that says ``top_k = 1`` samples greedily, so a random model's
answers stop depending on the seed, while ours (top_k 40) do; and
``/api/models`` says which value is in effect and where it came from.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import httpx
import pytest

from supervisor.config import ConfigError, ModelSettings, load_config
from supervisor.generation.sampling import fill, in_effect
from supervisor.models.demo import write_tiny_gguf
from supervisor.models.gguf_info import read_gguf_info
from supervisor.models.hf_info import read_hf_info
from supervisor.models.library import ModelEntry
from supervisor.models.sampling_defaults import MAX_IGNORED, gguf_sampling
from tests.server import Server, running, short_tempdir
from tests.test_hf_library import write_model
from worker.protocol import SamplingParams

SEEDS = range(1, 7)
PROMPT = [{"role": "user", "content": "hello"}]


def greedy_keys(w: gguf.GGUFWriter) -> None:
    """An author who asks for greedy decoding and a cooler temperature."""
    w.add_sampling_top_k(1)
    w.add_sampling_temp(0.6)
    w.add_sampling_penalty_repeat(1.05)


def hostile_keys(w: gguf.GGUFWriter) -> None:
    w.add_sampling_temp(math.nan)
    w.add_sampling_top_k(-5)
    w.add_sampling_top_p(7.0)
    w.add_sampling_min_p(math.inf)
    w.add_string(gguf.Keys.General.SAMPLING_PENALTY_REPEAT, "1.1")
    w.add_sampling_mirostat(2)


def write_with(path: Path, keys: Callable[[gguf.GGUFWriter], None]) -> Path:
    return write_tiny_gguf(path, more_keys=keys)


# ------------------------------------------------------------ the library


def test_a_gguf_s_sampling_keys_are_read_as_its_author_meant(tmp_path: Path) -> None:
    info = read_gguf_info(write_with(tmp_path / "m.gguf", greedy_keys))
    # float32 0.6 reads back as 0.6000000238...: the value meant is kept.
    assert info.sampling.values == {"temperature": 0.6, "top_k": 1, "repeat_penalty": 1.05}
    assert info.sampling.ignored == {}
    assert read_gguf_info(write_tiny_gguf(tmp_path / "plain.gguf")).sampling.values == {}


def test_hostile_sampling_values_are_ignored_with_a_reason(tmp_path: Path) -> None:
    info = read_gguf_info(write_with(tmp_path / "m.gguf", hostile_keys))
    assert info.sampling.values == {}
    why = info.sampling.ignored
    assert why["general.sampling.temp"] == "is nan, not a finite number"
    assert why["general.sampling.top_k"] == "is -5, outside [0, 1048576]"
    assert why["general.sampling.top_p"] == "is 7.0, outside (0, 1]"
    assert why["general.sampling.min_p"] == "is inf, not a finite number"
    assert why["general.sampling.penalty_repeat"] == "is str, not a number"
    assert "does not apply" in why["general.sampling.mirostat"]


def test_the_ignored_list_is_bounded() -> None:
    kv: dict[str, Any] = {f"general.sampling.x{i}": 1 for i in range(10_000)}
    kv["general.sampling.top_k"] = 20
    sampling = gguf_sampling(kv)
    assert sampling.values == {"top_k": 20}
    assert len(sampling.ignored) == MAX_IGNORED


def test_an_hf_model_s_generation_config_gives_its_defaults(tmp_path: Path) -> None:
    d = write_model(tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
         "min_p": -1, "typical_p": 0.9, "eos_token_id": [1, 2]}))
    sampling = read_hf_info(d).sampling
    assert sampling.values == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repeat_penalty": 1.05}
    assert sampling.ignored["generation_config.json:min_p"] == "is -1.0, outside [0, 1]"
    assert "generation_config.json:typical_p" in sampling.ignored


def test_an_unreadable_generation_config_costs_only_its_defaults(tmp_path: Path) -> None:
    d = write_model(tmp_path / "m")
    (d / "generation_config.json").write_text("{not json")
    info = read_hf_info(d)
    assert info.sampling.values == {}
    assert "not valid JSON" in info.sampling.ignored["generation_config.json"]
    (d / "generation_config.json").write_bytes(b"{" + b" " * (2 << 20) + b"}")
    assert "byte limit" in read_hf_info(d).sampling.ignored["generation_config.json"]


def test_precedence_request_then_config_then_model_then_ours(tmp_path: Path) -> None:
    path = write_with(tmp_path / "m.gguf", greedy_keys)
    entry = ModelEntry(id="m", path=str(path), files=[str(path)], size_bytes=1, source="dir",
                       root=str(tmp_path), mtime=0.0, info=read_gguf_info(path))
    effect = in_effect(entry, ModelSettings(temperature=0.9))
    assert {f: (s.value, s.source) for f, s in effect.items()} == {
        "temperature": (0.9, "config"), "top_p": (1.0, "default"), "top_k": (1, "model"),
        "min_p": (0.05, "default"), "repeat_penalty": (1.05, "model")}
    params = fill(SamplingParams(temperature=1.5, top_k=7), {"temperature", "top_k"}, effect)
    assert (params.temperature, params.top_k, params.repeat_penalty) == (1.5, 7, 1.05)
    # An unknown model (or one whose header failed) gets ours.
    assert {s.source for s in in_effect(None, ModelSettings()).values()} == {"default"}


@pytest.mark.parametrize("toml", ["temperature = 5", "top_p = 0", "top_k = -1", "min_p = nan",
                                  "repeat_penalty = inf", 'temperature = "hot"'])
def test_a_bad_sampling_default_in_the_config_is_a_startup_error(tmp_path: Path, toml: str) -> None:
    (tmp_path / "config.toml").write_text(f'[model_defaults."m"]\n{toml}\n')
    with pytest.raises(ConfigError, match=toml.split()[0]):
        load_config({"state_dir": str(tmp_path)}, environ={})


# ------------------------------------------------------------ served


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    files = tmp_path_factory.mktemp("sampling")
    models = short_tempdir("gvs")
    write_tiny_gguf(models / "plain.gguf")
    greedy = write_with(files / "greedy.gguf", greedy_keys)
    (models / "greedy.gguf").symlink_to(greedy)
    # The same file under another id, whose config entry overrides its top_k.
    (models / "greedy-overridden.gguf").symlink_to(greedy)
    write_with(models / "hostile.gguf", hostile_keys)
    hf = write_model(models / "hf-model")
    (hf / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 20}))
    state = short_tempdir("gvss")
    (state / "config.toml").write_text('[model_defaults."greedy-overridden"]\ntop_k = 40\n')
    try:
        with running(Server(models, state_dir=state, model="plain",
                            env={"GPUVISOR_MAX_LOADED_MODELS": "4"})) as srv:
            yield srv
    finally:
        shutil.rmtree(models, ignore_errors=True)


def chat(srv: Server, model: str, seed: int, **extra: Any) -> str:
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": PROMPT, "max_tokens": 12, "seed": seed, **extra})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def answers(srv: Server, model: str, **extra: Any) -> set[str]:
    return {chat(srv, model, seed, **extra) for seed in SEEDS}


def sampling_of(srv: Server, model: str) -> dict[str, Any]:
    r = httpx.get(f"{srv.base_url}/api/models/{model}", timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_api_models_shows_each_value_and_its_source(served: Server) -> None:
    plain = sampling_of(served, "plain")
    assert plain["sampling"]["top_k"] == {"value": 40, "source": "default"}
    assert plain["sampling_ignored"] is None
    greedy = sampling_of(served, "greedy")["sampling"]
    assert greedy["top_k"] == {"value": 1, "source": "model"}
    assert greedy["temperature"] == {"value": 0.6, "source": "model"}
    assert greedy["min_p"] == {"value": 0.05, "source": "default"}
    overridden = sampling_of(served, "greedy-overridden")["sampling"]
    assert overridden["top_k"] == {"value": 40, "source": "config"}
    assert overridden["temperature"] == {"value": 0.6, "source": "model"}
    hostile = sampling_of(served, "hostile")
    assert {s["source"] for s in hostile["sampling"].values()} == {"default"}
    assert hostile["sampling_ignored"]["general.sampling.temp"] == "is nan, not a finite number"
    # A hostile header costs its defaults, not the model.
    assert hostile["usable"] is True
    # An hf model (served by vLLM) the same way, from its generation_config.json.
    hf = sampling_of(served, "hf-model")["sampling"]
    assert hf["temperature"] == {"value": 0.7, "source": "model"}
    assert hf["top_k"] == {"value": 20, "source": "model"}
    assert hf["top_p"] == {"value": 1.0, "source": "default"}


def test_the_model_s_top_k_is_used_where_the_request_sets_none(served: Server) -> None:
    # Ours (top_k 40, temperature 1) samples: the seed changes the answer.
    assert len(answers(served, "plain")) > 1
    # The file's top_k = 1 is greedy: every seed gives the same answer.
    assert len(answers(served, "greedy")) == 1
    # The request's own value wins over the file's.
    assert len(answers(served, "greedy", top_k=40, temperature=1.0)) > 1
    # [model_defaults] wins over the file's.
    assert len(answers(served, "greedy-overridden")) > 1


def test_responses_use_the_model_s_defaults_too(served: Server) -> None:
    def respond(model: str, **extra: Any) -> str:
        r = httpx.post(served.base_url + "/v1/responses", timeout=60, json={
            "model": model, "input": "hello", "max_output_tokens": 12, "store": False, **extra})
        assert r.status_code == 200, r.text
        return str(r.json()["output"][0]["content"][0]["text"])

    # No seed in the Responses API: the engine draws one per request.
    assert len({respond("greedy") for _ in SEEDS}) == 1
    assert len({respond("plain") for _ in SEEDS}) > 1
    # A request's temperature leaves the file's top_k in place: still greedy.
    assert len({respond("greedy", temperature=2.0) for _ in SEEDS}) == 1


def test_sampling_is_no_load_option(served: Server) -> None:
    r = httpx.post(served.base_url + "/api/models/plain/load", json={"temperature": 0.5}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "temperature"
    assert "model_defaults" in r.json()["error"]["message"]
