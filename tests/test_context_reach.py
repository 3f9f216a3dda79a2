"""The context a worker gets is the context /api/models reports, and slots by memory.

An explicit n_ctx above the model's native context (2048 for the tiny
model) is capped there, and the fit says why; past it only with YaRN
scaling, which the engine then really serves. With ``parallel`` automatic a
worker gets as many slots as fit beside its context, up to a cap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.config import AUTO_PARALLEL_MAX_CPU, AUTO_PARALLEL_MAX_GPU, Config, ModelSettings
from supervisor.errors import BadRequest
from supervisor.models.gguf_info import read_gguf_info
from supervisor.models.library import ModelEntry
from supervisor.models.memfit import ContextDecision
from supervisor.models.placement import plan_load
from supervisor.models.slots import slot_ask
from tests.server import Server

pytestmark = pytest.mark.timeout(180)

NATIVE = 2048  # write_tiny_gguf's context_length
GIB = 1 << 30


def _entry(path: Path) -> ModelEntry:
    return ModelEntry(id="tiny", path=str(path), files=[str(path)], size_bytes=path.stat().st_size,
                      source="dir", root=str(path.parent), mtime=0.0, info=read_gguf_info(path))


def _plan(path: Path, settings: ModelSettings, *, free: int = 8 * GIB, device: str = "cpu",
          kind: str = "ram") -> ContextDecision:
    d = plan_load(_entry(path), settings, explicit_ctx=settings.n_ctx is not None, target_ctx=1024,
                  min_ctx=256, free_bytes=free, memory_kind=kind, slot_ask=slot_ask(settings, device))
    assert d is not None
    return d


def test_an_n_ctx_past_the_native_context_is_capped_with_a_reason(tiny_model_path: Path) -> None:
    d = _plan(tiny_model_path, ModelSettings(n_ctx=8192))
    assert (d.n_ctx, d.requested, d.max_ctx, d.rope_scaling) == (NATIVE, 8192, NATIVE, "none")
    assert "capped at 2048" in d.reason and 'rope_scaling = "yarn"' in d.reason
    # The engine pads a slot to whole 256 cells: the fit says what it will serve.
    assert _plan(tiny_model_path, ModelSettings(n_ctx=1000)).n_ctx == 1024


def test_yarn_reaches_past_it_and_is_bounded(tiny_model_path: Path) -> None:
    d = _plan(tiny_model_path, ModelSettings(n_ctx=8192, rope_scaling="yarn"))
    assert (d.n_ctx, d.max_ctx, d.rope_scaling, d.rope_scale, d.yarn_orig_ctx) == (8192, 8192, "yarn", 4.0, NATIVE)
    # rope_scale sets the reach; an n_ctx past it is capped at it, with the reason.
    d = _plan(tiny_model_path, ModelSettings(n_ctx=20000, rope_scaling="yarn", rope_scale=2))
    assert (d.n_ctx, d.max_ctx) == (4096, 4096) and "capped at 4096" in d.reason
    # Within the native context no scaling is applied, and the reason says so.
    d = _plan(tiny_model_path, ModelSettings(n_ctx=1024, rope_scaling="yarn"))
    assert d.rope_scaling == "none" and "not used" in d.reason
    with pytest.raises(BadRequest) as refused:
        _plan(tiny_model_path, ModelSettings(n_ctx=8192, rope_scale=4))
    assert refused.value.param == "rope_scale"


def test_automatic_slots_grow_with_memory_up_to_the_cap(tiny_model_path: Path) -> None:
    roomy = _plan(tiny_model_path, ModelSettings())
    assert roomy.slots == AUTO_PARALLEL_MAX_CPU and roomy.slots_reason.startswith("automatic")
    assert _plan(tiny_model_path, ModelSettings(), device="cuda:0", kind="gpu").slots == AUTO_PARALLEL_MAX_GPU
    two = _plan(tiny_model_path, ModelSettings(parallel=2))
    # Tight memory: more than the base, fewer than the cap, and each slot
    # beyond the base takes no more than half of what the base load left free.
    free = two.needed_bytes + 3 * (roomy.needed_bytes - two.needed_bytes) // 4
    tight = _plan(tiny_model_path, ModelSettings(), free=free)
    assert 2 < tight.slots < AUTO_PARALLEL_MAX_CPU, tight.slots_reason
    assert tight.needed_bytes - two.needed_bytes <= (free - two.needed_bytes) // 2
    assert "half" in tight.slots_reason
    # An explicit count wins, whatever the memory.
    three = _plan(tiny_model_path, ModelSettings(parallel=3))
    assert three.slots == 3 and three.slots_reason == "parallel 3, as set"


def _load(srv: Server, **body: object) -> dict[str, Any]:
    r = httpx.post(f"{srv.base_url}/api/models/{srv.model}/load", json=body, timeout=90)
    assert r.status_code == 200, r.text
    srv.wait_worker(lambda w: w["state"] == "ready" and w["n_ctx"] is not None)
    model: dict[str, Any] = httpx.get(f"{srv.base_url}/api/models/{srv.model}", timeout=10).json()
    return model


def _complete(srv: Server, prompt: str) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/completions", timeout=120, json={
        "model": srv.model, "prompt": prompt, "max_tokens": 1, "temperature": 0})


# Over 2048 tokens and under 8192: the tiny vocab spells most words in pieces.
LONG_PROMPT = "the tiny model reads " * 150  # about 3,150 tokens


def test_the_worker_serves_the_capped_context_and_says_why(server: Server) -> None:
    model = _load(server, n_ctx=8192)
    fit, worker = model["fit"], model["worker"]
    assert fit["n_ctx"] == worker["n_ctx"] == NATIVE, (fit, worker)
    assert fit["requested"] == 8192 and "capped at 2048" in fit["reason"]
    r = _complete(server, LONG_PROMPT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    # Not the advice to load a larger n_ctx: that was just done, and is capped.
    assert "native context" in err["message"] and "rope_scaling" in err["message"]
    assert "For a longer context, load the model with a larger n_ctx" not in err["message"]


def test_yarn_gives_the_worker_the_larger_context(server: Server) -> None:
    model = _load(server, n_ctx=8192, rope_scaling="yarn")
    fit, worker = model["fit"], model["worker"]
    assert fit["n_ctx"] == worker["n_ctx"] == 8192, (fit, worker)
    assert fit["rope_scaling"] == "yarn" and fit["rope_scale"] == 4.0
    r = _complete(server, LONG_PROMPT)
    assert r.status_code == 200, r.text
    assert NATIVE < r.json()["usage"]["prompt_tokens"] < 8192


def test_automatic_slots_show_in_the_api_and_an_explicit_count_wins(server: Server) -> None:
    model = _load(server, n_ctx=1024)
    fit, worker = model["fit"], model["worker"]
    assert 2 < worker["parallel"] == fit["slots"] <= AUTO_PARALLEL_MAX_CPU, (fit, worker)
    assert fit["slots_reason"].startswith("automatic")
    model = _load(server, n_ctx=1024, parallel=3)
    assert model["worker"]["parallel"] == model["fit"]["slots"] == 3
    assert model["fit"]["slots_reason"] == "parallel 3, as set"


def test_the_same_capped_load_again_keeps_its_worker(server: Server) -> None:
    _load(server, n_ctx=8192)
    pid = server.worker()["pid"]
    _load(server, n_ctx=8192)
    assert server.worker()["pid"] == pid


def test_a_scale_without_scaling_in_the_config_is_a_startup_error() -> None:
    with pytest.raises(ValueError, match="rope_scale"):
        Config(model_defaults={"m": ModelSettings(rope_scale=2.0)})
    # rope_scaling = "none" turns scaling off whatever else is set.
    Config(model_defaults={"m": ModelSettings(rope_scaling="none", rope_scale=2.0)})
