"""Header values the engine meets with an abort, not an error: a block_count
past its layer arrays, or a NaN epsilon in a draft. Each crashed the worker
on every load (a SIGABRT restart loop until `failed`); they are refused from
the header, with the reason, and no worker starts for them."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from supervisor.models.demo import write_tiny_gguf
from tests.server import Server, running, short_tempdir


def _patched(src: Path, dst: Path, key: bytes, value_type: int, value: bytes) -> None:
    """``src`` with the scalar under ``key`` replaced (same type, same width)."""
    data = src.read_bytes()
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", data, at)[0] == value_type
    dst.write_bytes(data[:at + 4] + value + data[at + 4 + len(value):])


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    _patched(tiny_model_path, models / "deep.gguf", b"llama.block_count", 4, struct.pack("<I", 1000))
    draft = write_tiny_gguf(short_tempdir("gvd") / "d.gguf", seed=7, n_layer=1)
    _patched(draft, models / "nan-draft.gguf", b"llama.attention.layer_norm_rms_epsilon", 6,
             struct.pack("<f", float("nan")))
    with running(Server(models, model="tiny")) as server:
        yield server


def test_a_block_count_past_the_engine_is_refused_without_a_worker(srv: Server) -> None:
    entry = httpx.get(srv.base_url + "/api/models/deep", timeout=10).json()
    assert entry["state"] == "unusable" and "block_count 1000" in entry["reason"], entry
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "deep", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code >= 400 and "block_count 1000" in r.json()["error"]["message"], r.text
    assert not [w for w in srv.workers() if w["model"] == "deep"], srv.workers()
    assert "SIGABRT" not in srv.log_text()


def test_a_nan_epsilon_draft_is_refused_naming_the_key(srv: Server) -> None:
    r = httpx.post(srv.base_url + "/api/models/tiny/load", timeout=60,
                   json={"speculative": "draft", "draft_model": "nan-draft"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "draft_model" and "layer_norm_rms_epsilon is nan" in err["message"], err
    # The model itself serves on, without the draft.
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
