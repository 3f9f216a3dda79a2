"""The code_interpreter sandbox, its containers and outputs, for real: each
run is a child process in its own namespaces (supervisor/sandbox/)."""

from __future__ import annotations

import asyncio
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai.types.responses import ResponseCodeInterpreterToolCall

from supervisor.config import ConfigError, load_config
from supervisor.sandbox.containers import ContainerError, ContainerPool, PoolFull, UnknownContainer
from supervisor.sandbox.outputs import call_outputs, call_status
from supervisor.sandbox.runner import SandboxSpec, run_code
from supervisor.sandbox.settings import hidden_paths, open_pool
from tests.sandbox_support import FAST, sandbox_python_or_skip

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="session")
def sandbox_python() -> str:
    return sandbox_python_or_skip()


@pytest.fixture
def pool(tmp_path: Path, sandbox_python: str) -> Iterator[ContainerPool]:
    p = ContainerPool(tmp_path / "containers", SandboxSpec(python=sandbox_python, limits=FAST))
    yield p
    p.close()


def _png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\x00")) + chunk(b"IEND", b""))


async def test_code_reads_an_upload_and_its_files_come_back(pool: ContainerPool) -> None:
    container = pool.create()
    assert container.id.startswith("cntr_")
    pool.upload(container, "data.csv", b"a,b\n1,2\n3,4\n")
    code = ("import csv\nrows = list(csv.DictReader(open('data.csv')))\n"
            "print(sum(int(r['b']) for r in rows))\n"
            "open('result.txt', 'w').write('six')\n"
            f"open('plot.png', 'wb').write({_png()!r})\n")
    run = await pool.run(container, code)
    assert run.result.exit_code == 0, run.result.stderr
    assert run.result.stdout == "6\n"
    # The upload is not listed back: only what the run wrote.
    assert [(f.name, f.bytes) for f in run.files] == [("plot.png", len(_png())), ("result.txt", 3)]
    outputs = call_outputs(run, container, wall_s=FAST.wall_s)
    item = ResponseCodeInterpreterToolCall.model_validate({
        "id": "ci_1", "type": "code_interpreter_call", "code": code, "container_id": container.id,
        "status": call_status(run), "outputs": outputs}, strict=True)
    assert item.status == "completed"
    assert item.outputs is not None and item.outputs[0].type == "logs"
    assert "6\n" in item.outputs[0].logs and "result.txt (3 bytes)" in item.outputs[0].logs
    assert item.outputs[1].type == "image" and item.outputs[1].url.startswith("data:image/png;base64,")
    # A second run in the same container sees the first one's files.
    again = await pool.run(container, "print(open('result.txt').read())")
    assert again.result.stdout == "six\n" and again.files == []


async def test_an_error_in_the_code_is_logs_not_a_failure(pool: ContainerPool) -> None:
    container = pool.create()
    run = await pool.run(container, "print('before')\n1/0\n")
    assert run.result.exit_code == 1
    logs = call_outputs(run, container, wall_s=FAST.wall_s)[0]["logs"]
    assert "before" in logs and "ZeroDivisionError" in logs and "[exit status 1]" in logs
    assert call_status(run) == "completed"


async def test_logs_are_bounded(tmp_path: Path, sandbox_python: str) -> None:
    work = tmp_path / "w"
    work.mkdir()
    os.chmod(work, 0o777)
    result = await run_code(SandboxSpec(python=sandbox_python, limits=FAST), work,
                            "import sys\nsys.stdout.write('x' * 4_000_000)\nsys.stderr.write('y' * 4_000_000)\n")
    assert result.exit_code == 0
    assert len(result.stdout) == FAST.log_bytes and result.stdout_truncated
    assert len(result.stderr) == FAST.log_bytes and result.stderr_truncated


async def test_files_are_read_without_following_links(pool: ContainerPool, tmp_path: Path) -> None:
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"the service's secret")
    container = pool.create()
    run = await pool.run(container, f"import os\nos.symlink({str(secret)!r}, 'leak.png')\n"
                                    "os.mkdir('sub')\nopen('sub/a.txt', 'w').write('a')\n")
    assert run.result.exit_code == 0, run.result.stderr
    assert [f.name for f in run.files] == ["sub/a.txt"]
    with pytest.raises(ContainerError):
        container.read("leak.png", 1 << 20)
    with pytest.raises(ContainerError):
        container.read("../secret.png", 1 << 20)
    assert container.read("sub/a.txt", 10) == b"a"
    outputs = call_outputs(run, container, wall_s=FAST.wall_s)
    assert all(o["type"] == "logs" for o in outputs)


def test_upload_names_and_sizes_are_checked(tmp_path: Path) -> None:
    p = ContainerPool(tmp_path, SandboxSpec(), max_upload_bytes=10)
    container = p.create()
    for bad in ("", "..", "a/b", "x" * 300):
        with pytest.raises(ContainerError):
            p.upload(container, bad, b"1")
    with pytest.raises(ContainerError, match="over the limit"):
        p.upload(container, "big.bin", b"x" * 11)
    assert p.upload(container, "ok.txt", b"1").bytes == 1
    p.close()


def test_the_pool_is_bounded_and_containers_expire(tmp_path: Path) -> None:
    now = [1000.0]
    p = ContainerPool(tmp_path, SandboxSpec(), max_containers=2, idle_s=60.0, clock=lambda: now[0])
    first = p.create()
    p.upload(first, "f.txt", b"data")
    second = p.create()
    now[0] += 30
    p.get(second.id)  # used: its idle time starts again
    now[0] += 40
    assert p.expire() == [first.id]
    assert not first.path.exists()
    with pytest.raises(UnknownContainer):
        p.get(first.id)
    assert second.path.exists()
    p.create()  # room again
    assert len(p) == 2
    p.close()
    assert not any(tmp_path.iterdir())


async def test_a_full_pool_makes_room_by_removing_the_least_recently_used_idle_container(tmp_path: Path) -> None:
    now = [1000.0]
    p = ContainerPool(tmp_path, SandboxSpec(), max_containers=3, clock=lambda: now[0])
    oldest, busy, recent = p.create("key-a"), p.create("key-b"), p.create("key-a")
    now[0] += 10
    p.get(recent.id, "key-a")  # used since: the most recent
    async with busy.lock:  # running code: never removed, however long ago it started
        now[0] += 10
        fourth = p.create("key-c")  # across keys: key-a's idle container goes
        assert not oldest.path.exists()
        with pytest.raises(UnknownContainer):
            p.get(oldest.id, "key-a")
        assert {c.id for c in p.visible(None)} == {busy.id, recent.id, fourth.id}
        fifth = p.create("key-c")  # then the next least recently used idle one
        assert {c.id for c in p.visible(None)} == {busy.id, fourth.id, fifth.id}
        async with fourth.lock, fifth.lock:
            with pytest.raises(PoolFull, match="running code"):
                p.create("key-a")  # only when every one is running
        assert len(p) == 3
    p.close()


def test_a_key_holding_half_the_pool_makes_room_from_its_own_containers(tmp_path: Path) -> None:
    now = [1000.0]
    p = ContainerPool(tmp_path, SandboxSpec(), max_containers=4, clock=lambda: now[0])
    theirs = p.create("key-a")
    flood = []
    for _ in range(3):
        now[0] += 1
        flood.append(p.create("key-b"))
    now[0] += 1
    p.create("key-b")  # holds 3 of 4: its own oldest goes, not key-a's older one
    assert {c.id for c in p.visible("key-a")} == {theirs.id}
    assert flood[0].id not in {c.id for c in p.visible(None)}
    now[0] += 1
    p.create("key-c")  # holds none: the least recently used of all goes
    assert p.visible("key-a") == [] and len(p) == 4
    p.close()


def test_a_container_made_through_the_api_keeps_its_own_expiry_and_takes_files_once(tmp_path: Path) -> None:
    now = [1000.0]
    p = ContainerPool(tmp_path, SandboxSpec(), idle_s=600.0, max_upload_bytes=10, clock=lambda: now[0],
                      wall=lambda: 5000.0 + now[0])
    brief = p.create("key-a", name="brief", idle_s=60.0)
    default = p.create("key-a")
    assert (brief.created_at, p.last_active_at(brief)) == (6000, 6000)
    assert [c.id for c in p.visible("key-a")] == [brief.id, default.id] and p.visible("key-b") == []
    spool, out = p.new_spool()
    with out:
        out.write(b"12345")
    p.take(brief, "a.txt", spool, 5)
    assert (brief.path / "a.txt").read_bytes() == b"12345" and brief.copied_in == {"a.txt"}
    # A name taken (a file, or a link the code made) is never written through; bytes past the bound are refused.
    os.symlink(tmp_path / "elsewhere", brief.path / "link")
    for name, size in (("a.txt", 1), ("link", 1), ("b.txt", 6)):
        with pytest.raises(ContainerError):
            p.take(brief, name, spool, size)
    assert not (tmp_path / "elsewhere").exists()
    brief.unlink("link")  # the link goes, not what it names
    with pytest.raises(ContainerError):
        brief.unlink("../" + default.id)
    now[0] += 61
    assert p.last_active_at(brief) == 6000
    assert p.expire() == [brief.id]  # its own 60 s, not the pool's 600
    assert default.path.exists()
    p.close()


async def test_a_folder_the_code_locked_is_still_removed(pool: ContainerPool) -> None:
    container = pool.create()
    run = await pool.run(container, "import os\nos.makedirs('d/e')\nopen('d/e/f', 'w').write('1')\n"
                                    "os.chmod('d/e', 0)\nos.chmod('d', 0)\n")
    assert run.result.exit_code == 0, run.result.stderr
    pool.remove(container.id)
    assert not container.path.exists()


def test_settings_are_off_by_default_and_checked(tmp_path: Path) -> None:
    cfg = load_config({"state_dir": str(tmp_path)}, environ={})
    assert cfg.code_interpreter is False
    assert asyncio.run(open_pool(cfg)) == (None, "code_interpreter is not enabled (setting code_interpreter)")
    with pytest.raises(ConfigError, match="code_interpreter_processes"):
        load_config({"state_dir": str(tmp_path)}, environ={"GPUVISOR_CODE_INTERPRETER_PROCESSES": "0"})
    cfg = load_config({"state_dir": str(tmp_path)}, environ={"GPUVISOR_CODE_INTERPRETER_WALL_S": "5"})
    assert cfg.code_interpreter_wall_s == 5.0
    hidden = hidden_paths(cfg)
    assert str(tmp_path.resolve()) in hidden and str((tmp_path / "models").resolve()) in hidden


def test_enabled_it_works_or_names_why(tmp_path: Path, sandbox_python: str) -> None:
    cfg = load_config({"state_dir": str(tmp_path)}, environ={
        "GPUVISOR_CODE_INTERPRETER": "true", "GPUVISOR_CODE_INTERPRETER_PYTHON": sandbox_python})
    pool, reason = asyncio.run(open_pool(cfg))
    assert reason is None and pool is not None and len(pool) == 0
    cfg = load_config({"state_dir": str(tmp_path)}, environ={
        "GPUVISOR_CODE_INTERPRETER": "true", "GPUVISOR_CODE_INTERPRETER_PYTHON": str(tmp_path / "no-python")})
    pool, reason = asyncio.run(open_pool(cfg))
    assert pool is None and reason is not None and "cannot be enabled" in reason
