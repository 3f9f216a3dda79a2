"""The automatic context is the model's native one (capped by memory): agent
clients send prompts of 20,000 tokens and more."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from supervisor.models.demo import write_tiny_gguf
from tests.server import Server, short_tempdir

pytestmark = pytest.mark.timeout(180)


def test_automatic_context_is_the_native_one(start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvc")
    write_tiny_gguf(models / "long.gguf", n_ctx=32768, name="long")
    srv = start_server(models, env={"GPUVISOR_N_CTX": "0"})
    fit = httpx.get(srv.base_url + "/api/models/long", timeout=10).json()["fit"]
    assert fit["automatic"] and fit["n_ctx"] == 32768, fit
    assert srv.worker("long")["n_ctx"] == 32768
    # About 20,000 tokens (the tiny vocab spells words out in bytes): served.
    prompt = " ".join(["the", "a", "is", "of"] * 1800)
    r = httpx.post(srv.base_url + "/v1/completions", timeout=150,
                   json={"model": "long", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 19000
