"""``gpuvisor pull`` against a running server and a local Hub: the download job
runs with progress, the model appears in the library by itself, and pull
reports the id ``/v1/models`` lists, read back from the service."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

from tests.fake_hub import FakeFile, FakeHub, FakeRepo
from tests.server import REPO, Server, short_tempdir

MODEL_ID = "acme/tiny-GGUF/tiny-Q8_0"
_DONE = re.compile(r"done: model (\S+) is listed in /v1/models")


@asynccontextmanager
async def local_hub(data: bytes) -> AsyncIterator[tuple[FakeHub, dict[str, str]]]:
    """A fake Hub with one GGUF repo (two quantizations), and the environment
    that points huggingface_hub at it (no cache setting of its own)."""
    hub = FakeHub(repos={"acme/tiny-GGUF": FakeRepo({
        "tiny-Q8_0.gguf": FakeFile(data), "tiny-F32.gguf": FakeFile(data + b"\0" * 64),
        "README.md": FakeFile(b"# tiny\n", lfs=False)})})
    url = await hub.start()
    try:
        yield hub, {"HF_ENDPOINT": url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    finally:
        await hub.close()


async def start(start_server: Callable[..., Server], tiny_model_path: Path, env: dict[str, str]) -> Server:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    return await asyncio.to_thread(start_server, models, env)


async def pull(srv: Server, *extra: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "supervisor", "pull", "acme/tiny-GGUF:Q8_0", "--url", srv.base_url,
        "--state-dir", str(srv.state_dir), *extra, cwd=REPO, env=srv.env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def listed(srv: Server) -> set[str]:
    return {m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]}


async def test_pull_with_the_default_config_serves(tiny_model_path: Path,
                                                   start_server: Callable[..., Server]) -> None:
    """No cache setting anywhere, only HF_HOME as a user's environment has it:
    the pulled model is listed by the time pull returns, and answers chat."""
    home = short_tempdir("gvhf")
    async with local_hub(tiny_model_path.read_bytes()) as (hub, env):
        srv = await start(start_server, tiny_model_path, {**env, "HF_HOME": str(home)})
        code, text = await pull(srv)
        assert code == 0, text
        assert "100.0%" in text
        # Only the chosen quantization was fetched, into HF_HOME's hub cache.
        assert hub.gets("tiny-Q8_0.gguf") >= 1 and hub.gets("tiny-F32.gguf") == 0
        assert list((home / "hub").glob("models--acme--tiny-GGUF/snapshots/*/tiny-Q8_0.gguf"))
        # The id pull prints is the one /v1/models lists, already when it returns.
        found = _DONE.search(text)
        assert found is not None and found.group(1) == MODEL_ID, text
        assert MODEL_ID in listed(srv)
        r = await asyncio.to_thread(httpx.post, srv.base_url + "/v1/chat/completions", json={
            "model": MODEL_ID, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] is not None


async def test_an_explicit_cache_dir_wins(tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    """hf_cache_dir set: downloads go there and it is listed, whatever HF_HUB_CACHE says."""
    cache, elsewhere = short_tempdir("gvhf"), short_tempdir("gvhf")
    async with local_hub(tiny_model_path.read_bytes()) as (_, env):
        srv = await start(start_server, tiny_model_path, {
            **env, "HF_HUB_CACHE": str(elsewhere), "GPUVISOR_HF_CACHE_DIR": str(cache)})
        code, text = await pull(srv)
        assert code == 0, text
        assert f"done: model {MODEL_ID} is listed in /v1/models" in text
        assert list(cache.glob("models--acme--tiny-GGUF/snapshots/*/tiny-Q8_0.gguf"))
        assert not list(elsewhere.iterdir())


async def test_a_pull_that_is_not_listed_fails(tiny_model_path: Path,
                                               start_server: Callable[..., Server]) -> None:
    """hf_cache_dir = "off": the file downloads, but pull never claims it is served."""
    home = short_tempdir("gvhf")
    async with local_hub(tiny_model_path.read_bytes()) as (_, env):
        srv = await start(start_server, tiny_model_path, {
            **env, "HF_HOME": str(home), "GPUVISOR_HF_CACHE_DIR": "off"})
        code, text = await pull(srv, "--wait", "1")
        assert code == 1, text
        assert "done:" not in text, text
        assert f"the service does not list model {MODEL_ID} after 1 s" in text, text
        assert 'hf_cache_dir = "off"' in text, text
        assert MODEL_ID not in listed(srv)


async def test_a_pull_shadowed_by_a_models_dir_file_fails(tiny_model_path: Path,
                                                          start_server: Callable[..., Server]) -> None:
    """A models dir file with the pulled model's id is listed first: pull says
    the id is taken rather than that the pulled file is served."""
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    (models / "acme" / "tiny-GGUF").mkdir(parents=True)
    (models / "acme" / "tiny-GGUF" / "tiny-Q8_0.gguf").symlink_to(tiny_model_path)
    async with local_hub(tiny_model_path.read_bytes()) as (_, env):
        srv = await asyncio.to_thread(start_server, models, {**env, "HF_HOME": str(short_tempdir("gvhf"))})
        code, text = await pull(srv, "--wait", "5")
        assert code == 1, text
        assert f"model id {MODEL_ID} is taken by {models}/acme/tiny-GGUF/tiny-Q8_0.gguf" in text, text
