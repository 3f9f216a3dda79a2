"""Model lifecycle on a real server: several models, eviction, keep-alive,
coalesced loads, explicit load/unload, memory fit and live library updates."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from supervisor.models.demo import write_tiny_gguf
from tests.server import Server, short_tempdir


@pytest.fixture(scope="module")
def two_models(tiny_model_path: Path) -> Path:
    models = short_tempdir("gvm")
    (models / "alpha.gguf").symlink_to(tiny_model_path)
    write_tiny_gguf(models / "beta.gguf", seed=1)
    return models


def chat(srv: Server, model: str, **extra: object) -> httpx.Response:
    return httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra})


def loaded(srv: Server) -> dict[str, dict[str, object]]:
    return {w["model"]: w for w in srv.workers() if w["mode"] == "generate"}


def wait_until(pred: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition never held")
        time.sleep(0.05)


def test_two_models_serve_at_once(two_models: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(two_models, env={"GPUVISOR_PRELOAD": "alpha"})
    assert chat(srv, "alpha").status_code == 200
    assert chat(srv, "beta").status_code == 200
    assert set(loaded(srv)) == {"alpha", "beta"}
    assert all(w["state"] == "ready" for w in loaded(srv).values())


def test_with_one_slot_the_busy_model_is_never_evicted(two_models: Path,
                                                       start_server: Callable[..., Server]) -> None:
    srv = start_server(two_models, env={"GPUVISOR_PRELOAD": "alpha", "GPUVISOR_MAX_LOADED_MODELS": "1",
                                        "GPUVISOR_N_CTX": "4096"})
    url = srv.base_url + "/v1/chat/completions"

    async def run() -> tuple[str, httpx.Response, list[str]]:
        async with httpx.AsyncClient(timeout=60) as c:
            states: list[str] = []
            async with c.stream("POST", url, json={
                    "model": "alpha", "stream": True, "max_tokens": 3000, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "long"}]}) as stream:
                lines = stream.aiter_lines()
                await anext(lines)
                beta = asyncio.create_task(c.post(url, json={
                    "model": "beta", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}))
                body = []
                async for line in lines:
                    body.append(line)
                    if len(body) % 200 == 0:
                        ws = (await c.get(srv.base_url + "/api/workers")).json()["workers"]
                        states += [w["state"] for w in ws if w["model"] == "alpha"]
            return "\n".join(body), await beta, states

    text, beta, alpha_states = asyncio.run(run())
    assert "data: [DONE]" in text and '"error"' not in text  # alpha's stream was not cut
    assert set(alpha_states) == {"ready"}
    assert beta.status_code == 200, beta.text
    assert set(loaded(srv)) == {"beta"}


def test_an_idle_model_is_evicted_at_once(two_models: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(two_models, env={"GPUVISOR_PRELOAD": "alpha", "GPUVISOR_MAX_LOADED_MODELS": "1"})
    alpha_pid = loaded(srv)["alpha"]["pid"]
    assert chat(srv, "beta").status_code == 200
    assert set(loaded(srv)) == {"beta"}
    assert "evicted to make room for beta" in srv.log_text()
    assert alpha_pid not in [w["pid"] for w in srv.workers()]


def test_concurrent_first_requests_share_one_load(two_models: Path,
                                                  start_server: Callable[..., Server]) -> None:
    srv = start_server(two_models, env={"GPUVISOR_PRELOAD": "alpha"})

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            return list(await asyncio.gather(*(c.post(srv.base_url + "/v1/chat/completions", json={
                "model": "beta", "max_tokens": 2, "messages": [{"role": "user", "content": str(i)}]})
                for i in range(6))))

    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
    beta = [w for w in srv.workers() if w["model"] == "beta"]
    assert len(beta) == 1 and beta[0]["restarts"] == 0
    # One worker process loaded it once: its log holds one load.
    log = (srv.state_dir / "logs" / "beta.log").read_text()
    assert log.count("llama_init_from_model") <= 1 or log == ""


def test_keep_alive_expiry_and_overrides(two_models: Path, start_server: Callable[..., Server]) -> None:
    # No readiness wait: the preloaded model may already have expired.
    srv = start_server(two_models, env={"GPUVISOR_PRELOAD": "alpha", "GPUVISOR_KEEP_ALIVE": "1s"},
                       wait_ready=False)
    assert chat(srv, "beta").status_code == 200
    assert "beta" in loaded(srv)
    wait_until(lambda: "beta" not in loaded(srv), timeout=10)
    # keep_alive 0: unloaded right after the request.
    assert chat(srv, "beta", keep_alive=0).status_code == 200
    wait_until(lambda: "beta" not in loaded(srv), timeout=5)
    # Negative: stays loaded although the default is one second.
    assert chat(srv, "beta", keep_alive=-1).status_code == 200
    time.sleep(2.0)
    assert "beta" in loaded(srv)
    assert loaded(srv)["beta"]["keep_alive_expires_at"] is None
    err = chat(srv, "beta", keep_alive="soon")
    assert err.status_code == 400 and err.json()["error"]["param"] == "keep_alive"


def test_load_api_noop_reload_and_unload(two_models: Path, start_server: Callable[..., Server]) -> None:
    srv = start_server(two_models, env={"GPUVISOR_PRELOAD": "alpha"})
    url = srv.base_url + "/api/models/beta"
    first = httpx.post(url + "/load", json={"n_ctx": 512}, timeout=60).json()
    assert first["id"] == "beta" and first["fit"]["n_ctx"] == 512
    srv.wait_worker(lambda w: w["state"] == "ready", model="beta")
    pid = loaded(srv)["beta"]["pid"]
    assert loaded(srv)["beta"]["n_ctx"] == 512
    httpx.post(url + "/load", json={"n_ctx": 512}, timeout=60)
    assert loaded(srv)["beta"]["pid"] == pid  # same settings: no-op
    httpx.post(url + "/load", json={"n_ctx": 768}, timeout=60)
    w = srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid, model="beta")
    assert w["n_ctx"] == 768
    info = httpx.get(url).json()
    assert info["state"] == "ready" and info["architecture"] == "llama"
    assert info["keep_alive_expires_at"] > time.time()
    out = httpx.post(url + "/unload", timeout=60).json()
    assert out["state"] == "unloaded" and "beta" not in loaded(srv)
    bad = httpx.post(url + "/load", json={"cache_type": "q2"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_type"
    assert httpx.post(srv.base_url + "/api/models/nope/load").status_code == 404


def test_context_is_fitted_to_the_memory_budget(two_models: Path,
                                               start_server: Callable[..., Server]) -> None:
    big = short_tempdir("gvm")
    write_tiny_gguf(big / "wide.gguf", n_embd=256, n_ff=512, n_ctx=131072, extra_tokens=2000)
    (big / "alpha.gguf").symlink_to(two_models / "alpha.gguf")
    srv = start_server(big, env={"GPUVISOR_PRELOAD": "alpha", "GPUVISOR_N_CTX": "131072",
                                 "GPUVISOR_MEMORY_BUDGET_MIB": "40", "GPUVISOR_MIN_CTX": "256"})
    # The weights (~5 MiB) fit; a 131072 context does not: the largest that does is chosen.
    r = httpx.post(srv.base_url + "/api/models/wide/load", json={}, timeout=60).json()
    fit = r["fit"]
    assert fit["automatic"] and fit["n_ctx"] < 131072 and fit["n_ctx"] % 256 == 0
    assert fit["needed_bytes"] <= fit["free_bytes"]
    w = srv.wait_worker(lambda w: w["state"] == "ready", model="wide")
    assert w["n_ctx"] == fit["n_ctx"]
    # An explicit context that cannot fit is refused before loading, naming sizes.
    r2 = httpx.post(srv.base_url + "/api/models/wide/load", json={"n_ctx": 131072}, timeout=60)
    assert r2.status_code == 400
    err = r2.json()["error"]
    assert err["code"] == "model_does_not_fit" and "KV cache" in err["message"] and "GiB" in err["message"]


def test_weights_that_cannot_fit_are_refused(tiny_model_path: Path,
                                             start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "wide.gguf", n_embd=256, n_ff=512, extra_tokens=2000)
    srv = start_server(models, env={"GPUVISOR_MEMORY_BUDGET_MIB": "1"}, wait_ready=False)
    r = chat(srv, "wide")
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "model_does_not_fit"
    assert "weights" in r.json()["error"]["message"]
    assert loaded(srv) == {}


def test_library_changes_show_without_restart(tiny_model_path: Path, two_models: Path,
                                              start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    (models / "alpha.gguf").symlink_to(tiny_model_path)
    srv = start_server(models)

    def ids() -> set[str]:
        return {m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]}

    assert ids() == {"alpha"}
    shutil.copy(two_models / "beta.gguf", models / "gamma.gguf.part")
    time.sleep(1.0)
    assert ids() == {"alpha"}  # a partial download is never offered
    (models / "gamma.gguf.part").rename(models / "gamma.gguf")
    wait_until(lambda: "gamma" in ids(), timeout=5)
    assert chat(srv, "gamma").status_code == 200
    (models / "gamma.gguf").unlink()
    wait_until(lambda: "gamma" not in ids(), timeout=5)
