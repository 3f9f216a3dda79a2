"""LoRA adapters served live on a real gpuvisor: a tiny model fine-tuned in
the suite, its adapter exported and dropped into the models dir, then served
as ``<base>:<adapter>`` on the base model's worker, through the official
``openai`` client.

The reference outputs come from the same server: the merged-and-exported
model (``tiny-ft``) and the base model before any adapter existed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("peft", reason="needs the train extra")

import openai

from jobs.hf_convert import convert
from jobs.lora_export import convert_adapter
from tests.lora_support import finetune, random_adapter
from tests.server import Server, poll_until, running, short_tempdir
from tests.tiny_hf import build_tiny_model

pytestmark = pytest.mark.timeout(300)
QUESTION = [{"role": "user", "content": "What colour is the sky?"}]
# Logprobs of the adapter pair against the merged model: both F32, so they
# differ only by rounding (W x + s B A x against (W + s B A) x), which the
# worker's F16 KV cache then rounds again (measured: up to 4e-3). The adapter
# itself moves them by more than 0.1.
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = tmp_path_factory.mktemp("lora")
    hf = build_tiny_model(tmp / "hf" / "tiny-hf")
    result = finetune(tmp / "lab", hf)
    out = tmp / "built"
    out.mkdir()
    convert(hf, out / "tiny-hf.gguf", "F32", "tiny-hf")
    rnd = random_adapter(hf, tmp / "rnd", seed=7)
    convert_adapter(rnd, hf, out / "rnd-lora.gguf", "F32", "rnd-lora")
    other = build_tiny_model(tmp / "other" / "tiny-hf", intermediate_size=96)
    convert_adapter(random_adapter(other, tmp / "bad", seed=8), other, out / "bad-lora.gguf", "F32", "bad")
    return {"base": out / "tiny-hf.gguf", "merged": Path(result["export"]["converted"]["path"]),
            "ft": Path(result["adapter_export"]["path"]), "rnd": out / "rnd-lora.gguf",
            "bad": out / "bad-lora.gguf"}


@pytest.fixture(scope="module")
def server(artifacts: dict[str, Path]) -> Iterator[Server]:
    models = short_tempdir("gvm")
    shutil.copy(artifacts["base"], models / "tiny-hf.gguf")
    shutil.copy(artifacts["merged"], models / "tiny-ft.gguf")
    with running(Server(models, env={"GPUVISOR_PARALLEL": "4"})) as srv:
        yield srv


def _client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)


def _ask(srv: Server, model: str, **extra: Any) -> tuple[list[str], list[float]]:
    reply = _client(srv).chat.completions.create(
        model=model, messages=QUESTION, max_tokens=16, temperature=0, logprobs=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, **extra})
    content = reply.choices[0].logprobs.content if reply.choices[0].logprobs else None
    assert content, reply
    return [t.token for t in content], [t.logprob for t in content]


def _same(a: tuple[list[str], list[float]], b: tuple[list[str], list[float]]) -> bool:
    return a[0] == b[0] and all(abs(x - y) <= TOLERANCE for x, y in zip(a[1], b[1], strict=True))


def _drop_in(models: Path, src: Path, name: str) -> None:
    """Written under a hidden name and renamed, as an export does."""
    tmp = models / f".{name}.partial"
    shutil.copy(src, tmp)
    os.replace(tmp, models / name)


def _models(srv: Server) -> dict[str, Any]:
    return {m.id: m for m in _client(srv).models.list().data}


def _wait_listed(srv: Server, model_id: str) -> None:
    poll_until(lambda: _models(srv), lambda listed: model_id in listed)


@pytest.fixture(scope="module")
def refs(server: Server, artifacts: dict[str, Path]) -> dict[str, Any]:
    """Base and merged outputs before any adapter exists; then the adapters are dropped in."""
    out: dict[str, Any] = {"base": _ask(server, "tiny-hf"), "merged": _ask(server, "tiny-ft"),
                           "base_pid": server.worker("tiny-hf")["pid"]}
    for key, name in (("ft", "ft-lora.gguf"), ("rnd", "rnd-lora.gguf"), ("bad", "bad-lora.gguf")):
        _drop_in(server.models_dir, artifacts[key], name)
    _wait_listed(server, "tiny-hf:rnd-lora")
    return out


def test_adapter_output_equals_the_merged_model_and_the_base_stays_the_base(
        server: Server, refs: dict[str, Any]) -> None:
    assert not _same(refs["base"], refs["merged"]), "the fine-tune changed nothing to compare"
    pair = _ask(server, "tiny-hf:ft-lora")
    assert _same(pair, refs["merged"]), (pair, refs["merged"])
    pid = server.worker("tiny-hf")["pid"]
    # The idle worker restarted once to load the adapters that appeared...
    assert pid != refs["base_pid"]
    bare = _ask(server, "tiny-hf")
    assert _same(bare, refs["base"]), (bare, refs["base"])
    other = _ask(server, "tiny-hf:rnd-lora")
    assert not _same(other, refs["base"]) and not _same(other, pair)
    # ... and never again: each adapter, and none, on the same process.
    assert _same(_ask(server, "tiny-hf:ft-lora"), refs["merged"])
    assert server.worker("tiny-hf")["pid"] == pid
    # Scale 0 is the base alone; a scale out of bounds is refused naming the field.
    assert _same(_ask(server, "tiny-hf:ft-lora", lora_scale=0.0), refs["base"])
    assert not _same(_ask(server, "tiny-hf:ft-lora", lora_scale=0.5), refs["merged"])
    for model, scale in (("tiny-hf:ft-lora", 9.0), ("tiny-hf:ft-lora", -1.0), ("tiny-ft", 1.0)):
        with pytest.raises(openai.BadRequestError) as err:
            _ask(server, model, lora_scale=scale)
        assert err.value.status_code == 400 and err.value.param == "lora_scale", (model, scale)


def test_models_list_each_pair_and_refuse_a_mismatched_adapter(
        server: Server, refs: dict[str, Any]) -> None:
    models = _models(server)
    for pair in ("tiny-hf:ft-lora", "tiny-hf:rnd-lora"):
        assert models[pair].owned_by == "gpuvisor"
        assert models[pair].model_extra and models[pair].model_extra["parent"] == "tiny-hf"
    # The merged model has another name: the adapter is not linked to it.
    assert "tiny-ft:ft-lora" not in models
    bad = models["tiny-hf:bad-lora"].model_extra or {}
    assert bad["state"] == "unusable" and "ffn" in bad["reason"]
    pid = server.worker("tiny-hf")["pid"]
    with pytest.raises(openai.BadRequestError) as err:
        _ask(server, "tiny-hf:bad-lora")
    assert err.value.code == "adapter_mismatch" and err.value.param == "model"
    assert server.worker("tiny-hf")["pid"] == pid and server.worker("tiny-hf")["state"] == "ready"

    api = httpx.get(server.base_url + "/api/models", timeout=10).json()
    base = next(m for m in api["data"] if m["id"] == "tiny-hf")
    assert {a["adapter"]: a["model"] for a in base["adapters"]} == {
        "ft-lora": "tiny-hf:ft-lora", "rnd-lora": "tiny-hf:rnd-lora"}
    adapters = {a["id"]: a for a in api["adapters"]}
    assert adapters["ft-lora"]["base_name"] == "tiny-hf" and adapters["ft-lora"]["usable"]
    [refused] = adapters["bad-lora"]["links"]
    assert not adapters["bad-lora"]["usable"] and refused["base"] == "tiny-hf" and not refused["fits"]
    assert "96" in refused["reason"] and "128" in refused["reason"]


def test_responses_api_serves_pairs_with_their_scale(server: Server, refs: dict[str, Any]) -> None:
    client = _client(server)

    def answer(model: str, **extra: Any) -> str:
        r = client.responses.create(model=model, input="What colour is the sky?", max_output_tokens=12,
                                    temperature=0, extra_body={"ignore_eos": True, **extra})
        return r.output_text

    base, pair = answer("tiny-hf"), answer("tiny-hf:ft-lora")
    assert pair != base and answer("tiny-hf:ft-lora", lora_scale=0.0) == base
    with pytest.raises(openai.BadRequestError) as err:
        answer("tiny-hf:ft-lora", lora_scale=4.5)
    assert err.value.param == "lora_scale"


async def _stream(client: openai.AsyncOpenAI, model: str) -> str:
    stream = await client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=48, temperature=0, stream=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True})
    assert isinstance(stream, openai.AsyncStream)
    parts = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    return "".join(parts)


def test_two_adapters_and_the_bare_base_stream_concurrently(server: Server, refs: dict[str, Any]) -> None:
    models = ["tiny-hf:ft-lora", "tiny-hf:rnd-lora", "tiny-hf"]

    async def run(together: bool) -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        if together:
            return list(await asyncio.gather(*(_stream(client, m) for m in models)))
        return [await _stream(client, m) for m in models]

    alone = asyncio.run(run(False))
    assert len(set(alone)) == 3, alone
    pid = server.worker("tiny-hf")["pid"]
    for _ in range(3):
        assert asyncio.run(run(True)) == alone
    assert server.worker("tiny-hf")["pid"] == pid
