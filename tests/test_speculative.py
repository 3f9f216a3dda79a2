"""Prompt-lookup speculative decoding changes speed, never the greedy text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from tests.server import Server, short_tempdir


def test_draft_ngram_keeps_greedy_output(tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = start_server(models)
    body = {"model": "tiny", "temperature": 0, "max_tokens": 48, "ignore_eos": True,
            # Longer than one prefill batch (512 tokens): drafting keeps every
            # position's logits, which once overflowed a batch-sized buffer.
            "messages": [{"role": "user", "content": " ".join(["the model"] * 70)}]}

    def answer() -> str:
        r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    plain = answer()
    pid = srv.worker()["pid"]
    loaded = httpx.post(srv.base_url + "/api/models/tiny/load", json={"draft_ngram": 4}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid)
    assert answer() == plain
