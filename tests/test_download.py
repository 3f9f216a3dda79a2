from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from jobs.download_params import DownloadParams, parse_download_params, parse_pull_spec
from supervisor.models.library import ModelLibrary
from tests import gguf_headers as hdr
from tests.fake_hub import FakeFile, FakeHub, FakeRepo

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "hf_sEcReTtOkEn1234567890"
MIB = 1024 * 1024
REPO = "org/Model-GGUF"


def blob(n: int, seed: int) -> bytes:
    return (bytes((i * 7 + seed) % 251 for i in range(256)) * (n // 256 + 1))[:n]


@dataclass
class JobRun:
    proc: asyncio.subprocess.Process
    events: list[dict[str, Any]] = field(default_factory=list)
    stderr: bytes = b""

    async def next(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 30
    ) -> dict[str, Any]:
        async def scan() -> dict[str, Any]:
            assert self.proc.stdout is not None
            while True:
                line = await self.proc.stdout.readline()
                if not line:
                    raise AssertionError(f"job ended without a matching event: {self.events}")
                if not line.strip():
                    continue
                event: dict[str, Any] = json.loads(line)
                self.events.append(event)
                if pred(event):
                    return event

        return await asyncio.wait_for(scan(), timeout)

    async def finish(self, timeout: float = 60) -> tuple[int, dict[str, Any]]:
        last = await self.next(lambda e: e["type"] in ("done", "failed"), timeout)
        assert self.proc.stderr is not None and self.proc.stdin is not None
        self.stderr = await self.proc.stderr.read()
        # stdin stays open until the job exits: EOF would mean "parent gone" (exit 70).
        rc = await asyncio.wait_for(self.proc.wait(), timeout)
        self.proc.stdin.close()
        return rc, last


@dataclass
class Env:
    hub: FakeHub
    cache: Path
    base: dict[str, str]

    async def start(self, params: dict[str, Any], **extra_env: str) -> JobRun:
        env = {**self.base, **extra_env}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "jobs.download",
            cwd=ROOT,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        context = {"job_id": "j1", "models_dir": "m", "datasets_dir": "d", "outputs_dir": "o"}
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"params": params, "context": context}).encode() + b"\n")
        await proc.stdin.drain()
        return JobRun(proc)

    async def run(
        self, params: dict[str, Any], **extra_env: str
    ) -> tuple[int, dict[str, Any], JobRun]:
        job = await self.start(params, **extra_env)
        rc, last = await job.finish()
        return rc, last, job


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    hub = FakeHub()
    url = await hub.start()
    cache = tmp_path / "hub-cache"
    base = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(ROOT),
        "HOME": str(tmp_path),
        "HF_ENDPOINT": url,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_TOKEN": TOKEN,
    }
    try:
        yield Env(hub, cache, base)
    finally:
        await hub.close()


def gguf_repo(tmp_path: Path, sizes: dict[str, int]) -> FakeRepo:
    """GGUF files that start with a real header, padded to the given sizes."""
    head = hdr.llama_gqa(tmp_path / "head.gguf.src").read_bytes()
    files = {}
    for i, (name, size) in enumerate(sizes.items()):
        files[name] = FakeFile(head + blob(max(size - len(head), 0), i))
    files["README.md"] = FakeFile(b"# model\n", lfs=False)
    return FakeRepo(files)


def assert_no_token(job: JobRun) -> None:
    assert TOKEN not in json.dumps(job.events) and TOKEN.encode() not in job.stderr


def test_params_validation() -> None:
    assert parse_pull_spec("org/x:Q4_K_M") == DownloadParams(repo_id="org/x", quant="Q4_K_M")
    assert parse_pull_spec("org/x@v2").revision == "v2"
    bad_params: list[dict[str, object]] = [
        {"repo_id": "a b"},
        {"repo_id": "org/x", "quant": "Q4 K"},
        {"repo_id": "org/x", "quant": "Q4_0", "patterns": ["*.gguf"]},
        {"repo_id": "org/x", "patterns": ["../x"]},
        {"repo_id": "org/x", "extra": 1},
    ]
    for bad in bad_params:
        with pytest.raises(msgspec.ValidationError):
            parse_download_params(bad)


async def test_download_with_progress_and_library_sees_it(env: Env, tmp_path: Path) -> None:
    env.hub.repos[REPO] = gguf_repo(
        tmp_path, {"Model-Q4_K_M.gguf": 3 * MIB, "mmproj-Model-F16.gguf": MIB}
    )
    env.hub.rate = 4 * MIB
    rc, last, job = await env.run({"repo_id": REPO})
    assert rc == 0, job.stderr.decode()
    assert last["type"] == "done"
    result = last["data"]["result"]
    assert result["model_id"] == f"{REPO}/Model-Q4_K_M"
    assert [f["path"] for f in result["files"]] == ["Model-Q4_K_M.gguf", "mmproj-Model-F16.gguf"]
    progress = [e["data"] for e in job.events if e["type"] == "progress"]
    assert progress[-1]["bytes_done"] == progress[-1]["bytes_total"] == result["bytes_downloaded"]
    mid = [p for p in progress if 0 < p["bytes_done"] < p["bytes_total"]]
    assert mid and all(p["rate"] >= 0 for p in mid)  # progress inside the big file
    assert {p["file"] for p in progress} == {"Model-Q4_K_M.gguf", "mmproj-Model-F16.gguf"}
    assert all(r.authorization == f"Bearer {TOKEN}" for r in env.hub.requests)
    assert_no_token(job)
    lib = ModelLibrary([], hf_cache_dir=env.cache, settle_s=0)
    lib.rescan()
    entry = lib.get(f"{REPO}/Model-Q4_K_M")
    assert entry is not None and entry.usable and entry.mmproj is not None
    assert entry.size_bytes == 3 * MIB


async def test_quant_selects_file_or_shard_set(env: Env, tmp_path: Path) -> None:
    env.hub.repos[REPO] = gguf_repo(
        tmp_path,
        {
            "Model-Q4_K_M.gguf": 300_000,
            "Model-IQ4_XS.gguf": 200_000,
            "Model-Q4_K.gguf": 250_000,
            "Q6_K/Model-Q6_K-00001-of-00002.gguf": 300_000,
            "Q6_K/Model-Q6_K-00002-of-00002.gguf": 100_000,
        },
    )
    rc, last, job = await env.run({"repo_id": REPO, "quant": "q6_k", "mmproj": False})
    assert rc == 0, job.stderr.decode()
    result = last["data"]["result"]
    assert [f["path"] for f in result["files"]] == [
        "Q6_K/Model-Q6_K-00001-of-00002.gguf",
        "Q6_K/Model-Q6_K-00002-of-00002.gguf",
    ]
    assert result["model_id"] == f"{REPO}/Model-Q6_K"
    rc, last, _ = await env.run({"repo_id": REPO, "quant": "Q4_K"})
    assert [f["path"] for f in last["data"]["result"]["files"]] == ["Model-Q4_K.gguf"]
    rc, last, _ = await env.run({"repo_id": REPO, "quant": "Q2_K"})
    assert (
        rc == 1
        and "no Q2_K file" in last["data"]["error"]
        and "Model-IQ4_XS" in last["data"]["error"]
    )
    rc, last, _ = await env.run({"repo_id": REPO})
    assert rc == 1 and "choose one with quant" in last["data"]["error"]
    lib = ModelLibrary([], hf_cache_dir=env.cache, settle_s=0)
    lib.rescan()
    assert {e.id for e in lib.list()} == {f"{REPO}/Model-Q6_K", f"{REPO}/Model-Q4_K"}


async def test_cancel_then_resume_skips_finished_files(env: Env, tmp_path: Path) -> None:
    names = ["Model-Q8_0-00001-of-00002.gguf", "Model-Q8_0-00002-of-00002.gguf"]
    env.hub.repos[REPO] = gguf_repo(tmp_path, {names[0]: 2 * MIB, names[1]: 6 * MIB})
    env.hub.rate = 4 * MIB
    job = await env.start({"repo_id": REPO, "quant": "Q8_0"})
    await job.next(
        lambda e: (
            e["type"] == "progress"
            and e["data"]["file_index"] == 2
            and e["data"]["bytes_done"] > 2 * MIB
        )
    )
    job.proc.send_signal(signal.SIGTERM)
    rc, last = await job.finish()
    assert rc == 4 and last["type"] == "failed" and "stopped on request" in last["data"]["error"]
    blobs = env.cache / "models--org--Model-GGUF" / "blobs"
    assert not list(blobs.glob("*.incomplete")), "the partial file is removed"
    assert len([p for p in blobs.iterdir()]) == 1, "the finished shard stays cached"
    env.hub.rate = 0
    rc, last, job = await env.run({"repo_id": REPO, "quant": "Q8_0"})
    assert rc == 0, job.stderr.decode()
    result = last["data"]["result"]
    assert result["bytes_reused"] == 2 * MIB and result["bytes_downloaded"] == 6 * MIB
    assert env.hub.gets(names[0]) == 1 and env.hub.gets(names[1]) == 2
    assert_no_token(job)


async def test_disk_full_preflight_and_fallback(env: Env, tmp_path: Path) -> None:
    repo = gguf_repo(tmp_path, {"Model-Q8_0.gguf": 100_000, "Model-Q4_K_M.gguf": 100_000})
    # The hub claims more bytes than any test disk has free: it must refuse before fetching.
    repo.files["Model-Q8_0.gguf"].claimed_size = 2**60
    env.hub.repos[REPO] = repo
    rc, last, job = await env.run({"repo_id": REPO, "quant": "Q8_0"})
    assert rc == 1 and "not enough disk space" in last["data"]["error"]
    assert env.hub.gets(".gguf") == 0
    assert_no_token(job)
    rc, last, job = await env.run({"repo_id": REPO, "quant": "Q8_0", "fallback_smaller": True})
    assert rc == 0, job.stderr.decode()
    assert last["data"]["result"]["model_id"] == f"{REPO}/Model-Q4_K_M"
    assert any("falling back to Model-Q4_K_M" in e["data"].get("message", "") for e in job.events)


async def test_errors_and_offline_never_leak_the_token(env: Env, tmp_path: Path) -> None:
    rc, last, job = await env.run({"repo_id": "org/missing"})
    assert rc == 1 and "org/missing" in last["data"]["error"]
    assert_no_token(job)
    env.hub.repos[REPO] = gguf_repo(tmp_path, {"Model-Q4_K_M.gguf": 100_000})
    rc, last, job = await env.run({"repo_id": REPO}, HF_HUB_OFFLINE="1")
    assert rc == 1 and "offline" in last["data"]["error"]
    rc, _, _ = await env.run({"repo_id": REPO})
    assert rc == 0
    count = len(env.hub.requests)
    rc, last, job = await env.run({"repo_id": REPO}, HF_HUB_OFFLINE="1")
    assert rc == 0, job.stderr.decode()
    assert last["data"]["result"]["model_id"] == f"{REPO}/Model-Q4_K_M"
    assert len(env.hub.requests) == count, "offline mode made no request"
