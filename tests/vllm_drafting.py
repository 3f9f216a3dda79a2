"""What the real-vLLM drafting test of a model's own MTP layers
(tests/test_vllm_mtp.py) uses: a server on a models dir with one tiny model, and
the check that a model reloaded to draft keeps its greedy text, drafts, and
that vLLM counts the drafter's KV pages in the exact budget the worker gave
it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.server import Server, running

N_CTX = 1024
# vLLM's start on a busy 2-core machine.
START_S = 240
# The page of 128 tokens (the CPU build's block) that vLLM's block pool holds back.
HELD_PAGE_TOKENS = 128


@contextmanager
def drafting_server(models: Path, model: str, vllm_python: str) -> Iterator[Server]:
    """A server serving ``model`` from ``models``, 2 sequences of N_CTX tokens."""
    env = {"GPUVISOR_VLLM_PYTHON": vllm_python, "GPUVISOR_PARALLEL": "2", "GPUVISOR_N_CTX": str(N_CTX)}
    with running(Server(models, env=env, model=model)) as server:
        yield server


def _complete(srv: Server, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": "one two three one two three one two", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True}
    r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=START_S)
    assert r.status_code == 200, r.text
    return dict(r.json())


def drafts_and_keeps_its_text(srv: Server, model: str, load: dict[str, Any]) -> dict[str, Any]:
    """``model``'s greedy text, then ``model`` reloaded with the drafting
    settings ``load``: the same text (the model verifies every drafted
    token), drafts counted. Its /api/models item, for the caller's checks."""
    plain = _complete(srv, model)["choices"][0]["text"]
    pid = srv.worker(model)["pid"]
    r = httpx.post(f"{srv.base_url}/api/models/{model}/load", timeout=START_S, json=load)
    assert r.status_code == 200, r.text
    srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid, model, timeout=START_S)
    drafted = _complete(srv, model)
    assert drafted["choices"][0]["text"] == plain and drafted["usage"]["completion_tokens"] == 48
    state = srv.wait_worker(lambda w: bool(w["stats"]) and w["stats"]["draft_tokens"] > 0, model,
                            timeout=30)["stats"]
    assert 0 <= state["draft_accepted"] <= state["draft_tokens"], state
    return dict(httpx.get(f"{srv.base_url}/api/models/{model}", timeout=10).json())


def assert_budget(srv: Server, model: str, item: dict[str, Any], bytes_per_token: int,
                  n_ctx: int = N_CTX) -> None:
    """The fit holds ``n_ctx`` tokens for each of 2 sequences (and the held
    page) at ``bytes_per_token``, and vLLM's log counts as many tokens in it."""
    tokens = n_ctx * 2 + HELD_PAGE_TOKENS
    assert item["fit"]["kv_bytes"] == tokens * bytes_per_token, item["fit"]
    log = httpx.get(f"{srv.base_url}/api/models/{model}/log", timeout=10).text
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    assert found and int(found[-1].replace(",", "")) == tokens, log[-2000:]
