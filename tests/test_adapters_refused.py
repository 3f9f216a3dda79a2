"""One bad LoRA adapter on a real gpuvisor costs itself alone: the base's
other adapters are served, ``/v1/models`` says why the bad one is not
(``adapter_error``), a request to it is a 400 ``adapter_unusable``, and
fixing or removing its file heals it without an unload.

Two kinds of bad: one whose tensor index the engine would refuse (the
library finds it from the header: a tensor type whose blocks its rows do
not fill) and one only the engine refuses (the worker finds it when it
starts). A truncated adapter is an unusable file like any other.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("peft", reason="needs the train extra")

from jobs.hf_convert import convert
from jobs.lora_export import convert_adapter
from tests.lora_support import engine_refused_copy, random_adapter, retyped_copy, truncated_copy
from tests.server import Server, poll_until, running, short_tempdir
from tests.tiny_hf import build_tiny_model

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = tmp_path_factory.mktemp("lora-refused")
    hf = build_tiny_model(tmp / "hf" / "tiny-hf")
    convert(hf, tmp / "tiny-hf.gguf", "F16", "tiny-hf")
    for name, seed in (("good", 1), ("fixed", 2)):
        convert_adapter(random_adapter(hf, tmp / name, seed=seed), hf, tmp / f"{name}.gguf", "F16", name)
    return {"base": tmp / "tiny-hf.gguf", "good": tmp / "good.gguf", "fixed": tmp / "fixed.gguf",
            "refused": engine_refused_copy(tmp / "fixed.gguf", tmp / "refused.gguf"),
            "retyped": retyped_copy(tmp / "good.gguf", tmp / "retyped.gguf"),
            "truncated": truncated_copy(tmp / "good.gguf", tmp / "truncated.gguf")}


@pytest.fixture(scope="module")
def server(built: dict[str, Path]) -> Iterator[Server]:
    models = short_tempdir("gvr")
    shutil.copy(built["base"], models / "tiny-hf.gguf")
    for name in ("good", "refused", "retyped", "truncated"):
        shutil.copy(built[name], models / f"{name}.gguf")
    with running(Server(models)) as srv:
        yield srv


def _listed(srv: Server) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]}


def _pairs(srv: Server) -> dict[str, dict[str, Any]]:
    return {k: m for k, m in _listed(srv).items() if m.get("parent") == "tiny-hf"}


def _ask(srv: Server, model: str) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": "user What colour", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})


def _text(srv: Server, model: str) -> str:
    reply = _ask(srv, model)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def _refused(reply: httpx.Response, why: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "adapter_unusable" and error["param"] == "model", error
    assert why in error["message"], error


def test_one_bad_adapter_costs_itself_alone_and_heals_without_an_unload(
        server: Server, built: dict[str, Path]) -> None:
    listed = poll_until(lambda: _listed(server), lambda p: {"tiny-hf:good", "tiny-hf:refused",
                                                            "tiny-hf:retyped", "truncated"} <= set(p))
    # The retyped file is refused from its header, before any worker.
    retyped = listed["tiny-hf:retyped"]
    assert retyped["state"] == "unusable" and "block size 32" in retyped["adapter_error"], retyped
    assert listed["tiny-hf:good"]["adapter_error"] is None
    assert listed["truncated"]["state"] == "unusable" and "truncated" in listed["truncated"]["reason"]
    _refused(_ask(server, "tiny-hf:retyped"), "block size 32")

    base = _text(server, "tiny-hf")
    good = _text(server, "tiny-hf:good")
    assert good != base
    pid = server.worker("tiny-hf")["pid"]
    # The engine refused the other; the worker holds the good one and says which it refused.
    refused = _pairs(server)["tiny-hf:refused"]
    assert refused["state"] == "unusable" and "refused it" in refused["adapter_error"], refused
    assert _pairs(server)["tiny-hf:good"]["state"] == "ready"
    _refused(_ask(server, "tiny-hf:refused"), "refused it")
    api = httpx.get(server.base_url + "/api/models", timeout=10).json()
    by_id = {a["id"]: a for a in api["adapters"]}
    assert "refused it" in by_id["refused"]["adapter_error"] and by_id["good"]["adapter_error"] is None
    # Asking again neither restarts the worker nor changes the answer.
    _refused(_ask(server, "tiny-hf:refused"), "refused it")
    assert _text(server, "tiny-hf:good") == good and server.worker("tiny-hf")["pid"] == pid

    # Fixed on disk (a good adapter under the same name): served after one
    # restart of the idle worker, no unload asked for.
    tmp = server.models_dir / ".refused.gguf.partial"
    shutil.copy(built["fixed"], tmp)
    os.replace(tmp, server.models_dir / "refused.gguf")
    # (Unlisted for a moment, while the new file settles.)
    poll_until(lambda: _pairs(server).get("tiny-hf:refused"), lambda m: m is not None and m["adapter_error"] is None)
    fixed = _text(server, "tiny-hf:refused")
    assert fixed not in (base, good)
    restarted = server.worker("tiny-hf")["pid"]
    assert restarted != pid
    assert _text(server, "tiny-hf:good") == good

    # The retyped one removed: gone from the list, the others untouched.
    (server.models_dir / "retyped.gguf").unlink()
    poll_until(lambda: _pairs(server), lambda p: "tiny-hf:retyped" not in p)
    assert _text(server, "tiny-hf:refused") == fixed and _text(server, "tiny-hf:good") == good
    assert server.worker("tiny-hf")["pid"] == restarted
