"""``gpuvisor pull`` against a running server and a local Hub: the download job
runs with progress, and the model appears in the library by itself."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.fake_hub import FakeFile, FakeHub, FakeRepo
from tests.server import REPO, Server, short_tempdir


async def test_pull_downloads_and_serves(tiny_model_path: Path, start_server: Callable[..., Server]) -> None:
    data = tiny_model_path.read_bytes()
    hub = FakeHub(repos={"acme/tiny-GGUF": FakeRepo({
        "tiny-Q8_0.gguf": FakeFile(data), "tiny-F32.gguf": FakeFile(data + b"\0" * 64),
        "README.md": FakeFile(b"# tiny\n", lfs=False)})})
    url = await hub.start()
    cache = short_tempdir("gvhf")
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    env = {"HF_ENDPOINT": url, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "GPUVISOR_HF_CACHE_DIR": str(cache)}
    try:
        srv = await asyncio.to_thread(start_server, models, env)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "supervisor", "pull", "acme/tiny-GGUF:Q8_0", "--url", srv.base_url,
            "--state-dir", str(srv.state_dir), cwd=REPO, env={**srv.env()},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        text = out.decode()
        assert proc.returncode == 0, text
        assert "100.0%" in text and "done: model" in text
        # Only the chosen quantization was fetched.
        assert hub.gets("tiny-Q8_0.gguf") >= 1 and hub.gets("tiny-F32.gguf") == 0

        def ids() -> set[str]:
            return {m["id"] for m in httpx.get(srv.base_url + "/v1/models").json()["data"]}

        deadline = time.monotonic() + 10
        while not any(i.endswith("tiny-Q8_0") for i in ids()):
            assert time.monotonic() < deadline, ids()
            await asyncio.sleep(0.1)
        model = next(i for i in ids() if i.endswith("tiny-Q8_0"))
        r = await asyncio.to_thread(httpx.post, srv.base_url + "/v1/chat/completions", json={
            "model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        await hub.close()
