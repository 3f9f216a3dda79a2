"""The launcher/connection seam: a worker proves its spawn's secret in Hello.

Forged connections (another secret, no proof, a proof replayed from another
connection, another frame first, an oversize frame, silence) are refused on
the Unix and the TCP transport, one log line each, while the real worker
still gets in and serves; a worker refuses a parent that cannot prove the
secret; a whole server serves a chat through workers dialling back over TCP.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import struct
import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest

from supervisor.config import ConfigError, load_config
from supervisor.workers.connection import Endpoint, Listener
from supervisor.workers.handle import WorkerHandle, WorkerState
from supervisor.workers.launcher import LocalLauncher, LocalProcess
from supervisor.workers.queue import WorkerGone
from supervisor.workers.spec import Timing, WorkerSpec
from tests.server import REPO, Server, short_tempdir
from worker import protocol as p

TIMING = Timing(handshake_timeout=60, ping_interval=2, ping_timeout=30, kill_grace=5, backoff_min=0.5,
                backoff_max=1, crash_limit=2, crash_window=60)
AUTH_TIMEOUT = 0.5


async def _dial(address: list[str]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    kind, where = address
    if kind == "--tcp":
        host, _, port = where.rpartition(":")
        return await asyncio.open_connection(host.strip("[]"), int(port))
    return await asyncio.open_unix_connection(where)


async def _challenge(reader: asyncio.StreamReader) -> p.Challenge:
    body = await asyncio.wait_for(p.read_frame(reader, p.MAX_HELLO_FRAME), 10)
    assert body is not None
    msg = p.handshake_codec().decode(body)
    assert isinstance(msg, p.Challenge)
    return msg


def _hello(secret: bytes, parent_nonce: bytes, proof: bytes | None = None) -> bytes:
    nonce = secrets.token_bytes(p.NONCE_BYTES)
    if proof is None:
        proof = p.proof(secret, "worker", parent_nonce, nonce)
    return p.worker_codec().encode(p.Hello(p.PROTOCOL_VERSION, 1, nonce, proof))


async def _refused(reader: asyncio.StreamReader) -> bytes:
    """What the parent sent after the challenge until it closed: nothing, for a refusal."""
    return await asyncio.wait_for(reader.read(), AUTH_TIMEOUT + 10)


Forgery = Callable[[list[str], bytes], Awaitable[bytes]]


async def _wrong_secret(address: list[str], _secret: bytes) -> bytes:
    reader, writer = await _dial(address)
    challenge = await _challenge(reader)
    writer.write(_hello(secrets.token_bytes(p.SECRET_BYTES), challenge.nonce))
    return await _refused(reader)


async def _no_proof(address: list[str], secret: bytes) -> bytes:
    reader, writer = await _dial(address)
    challenge = await _challenge(reader)
    writer.write(_hello(secret, challenge.nonce, proof=b""))
    return await _refused(reader)


async def _replayed(address: list[str], secret: bytes) -> bytes:
    """The right secret over another connection's nonce: a recorded proof."""
    reader, writer = await _dial(address)
    await _challenge(reader)
    writer.write(_hello(secret, secrets.token_bytes(p.NONCE_BYTES)))
    return await _refused(reader)


async def _frame_first(address: list[str], _secret: bytes) -> bytes:
    reader, writer = await _dial(address)
    await _challenge(reader)
    writer.write(p.worker_codec().encode(p.Heartbeat(p.WorkerStats(False, 0, 0, 0))))
    return await _refused(reader)


async def _oversize(address: list[str], _secret: bytes) -> bytes:
    reader, writer = await _dial(address)
    await _challenge(reader)
    writer.write(struct.pack(">I", p.MAX_HELLO_FRAME + 1))  # and no body: read no further
    return await _refused(reader)


async def _silent(address: list[str], _secret: bytes) -> bytes:
    reader, _ = await _dial(address)
    await _challenge(reader)
    return await _refused(reader)


FORGERIES: list[Forgery] = [_wrong_secret, _no_proof, _replayed, _frame_first, _oversize, _silent]


class ForgingLauncher(LocalLauncher):
    """Starts the real worker only after every forgery was turned away."""

    def __init__(self, run_dir: Path, log_dir: Path) -> None:
        super().__init__(run_dir, log_dir)
        self.answers: list[bytes] = []
        self.secret = b""
        self.started: LocalProcess | None = None

    async def start(self, spec: WorkerSpec, timing: Timing, address: list[str], secret: bytes,
                    stem: str) -> LocalProcess:
        self.secret = secret
        self.answers = list(await asyncio.gather(*(forge(address, secret) for forge in FORGERIES)))
        self.started = await super().start(spec, timing, address, secret, stem)
        return self.started


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_forged_hellos_are_refused_and_the_real_worker_serves(
        transport: str, tiny_model_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "gpuvisor.worker")
    run, logs = short_tempdir(), short_tempdir()
    launcher = ForgingLauncher(run, logs)
    endpoint = replace(Endpoint.parse("tcp:127.0.0.1" if transport == "tcp" else "unix"), auth_timeout=AUTH_TIMEOUT)
    spec = WorkerSpec("tiny", tiny_model_path, False, 256, 0, 1)
    handle = WorkerHandle(spec, TIMING, run, logs, 8, launcher=launcher, endpoint=endpoint)
    handle.start()
    try:
        await asyncio.wait_for(handle.ready.wait(), 90)
        # Each forgery got the challenge and then only the end of the stream.
        assert launcher.answers == [b""] * len(FORGERIES)
        refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
        assert len(refusals) == len(FORGERIES), refusals
        assert any("proves no secret" in r for r in refusals)
        assert any("no hello" in r for r in refusals) and any("exceeds" in r for r in refusals)
        assert any("first frame is no hello" in r for r in refusals)
        pend = handle.submit(p.Generate(0, p.SamplingParams(max_tokens=4, temperature=0.0), prompt="once"))
        while True:
            event = await asyncio.wait_for(pend.events.get(), 60)
            assert not isinstance(event, WorkerGone | p.Error), event
            if isinstance(event, p.Done):
                break
        assert event.completion_tokens == 4
        # The secret went by stdin: neither the command line nor a log shows it.
        assert launcher.started is not None
        secret = launcher.secret.hex()
        assert secret not in " ".join(psutil.Process(launcher.started.pid).cmdline())
        assert secret not in caplog.text and secret not in handle.log_path.read_text(errors="replace")
    finally:
        await handle.stop()
    assert handle.state is WorkerState.STOPPED
    assert list(run.iterdir()) == []  # the listener's socket and the engine's are gone


async def _worker_against(parent: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
                          secret_line: bytes, model: Path) -> int:
    """The exit code of a real worker that dials ``parent`` (a test's listener)."""
    sock = short_tempdir() / "p.sock"
    server = await asyncio.start_unix_server(parent, path=str(sock))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", "--socket", str(sock), "--model", str(model), "--n-ctx", "256",
        "--threads", "1", stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=REPO)
    assert proc.stdin is not None
    proc.stdin.write(secret_line)
    try:
        return await asyncio.wait_for(proc.wait(), 60)
    finally:
        server.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the peer sent before it closed.

    A peer that closes with our last frame still unread makes the kernel
    reset the connection, and a frame of ours still being written meets a
    broken pipe, rather than a clean end; what the peer sent before is read
    first either way, so either ends the reading as an EOF does.
    """
    received = bytearray()
    try:
        while chunk := await reader.read(65536):
            received += chunk
    except (ConnectionResetError, BrokenPipeError):
        return bytes(received)
    return bytes(received)


async def test_a_worker_refuses_a_parent_that_cannot_prove_the_secret(tiny_model_path: Path) -> None:
    secret = secrets.token_bytes(p.SECRET_BYTES)
    # The worker's exit can come before this handler has read to the end.
    after_welcome: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(p.hello_codec().encode(p.Challenge(p.PROTOCOL_VERSION, secrets.token_bytes(p.NONCE_BYTES))))
        hello = await p.read_frame(reader, p.MAX_HELLO_FRAME)
        assert hello is not None
        writer.write(p.hello_codec().encode(p.Welcome(b"\0" * 32)))
        writer.write(p.parent_codec().encode(p.Ping(1)))
        after_welcome.set_result(await _until_closed(reader))

    assert await _worker_against(impostor, p.secret_line(secret), tiny_model_path) == 1
    # It answered nothing after the false welcome (no Pong, no Ready): it loaded no model.
    assert await asyncio.wait_for(after_welcome, 30) == b""


async def test_a_worker_without_a_secret_exits_before_it_dials(tiny_model_path: Path) -> None:
    dialled: list[bool] = []

    async def parent(_r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dialled.append(True)
        writer.close()

    assert await _worker_against(parent, b"not hex\n", tiny_model_path) == 1
    assert dialled == []


async def test_a_listener_lets_in_one_worker_only() -> None:
    """The first proven connection gets the parent's proof; later ones are closed unread."""
    secret = secrets.token_bytes(p.SECRET_BYTES)
    listener = Listener(Endpoint("tcp", "127.0.0.1"), secret, "tiny")
    await listener.open(None)
    try:
        reader, writer = await _dial(listener.address)
        challenge = await _challenge(reader)
        writer.write(_hello(secret, challenge.nonce))
        conn = await asyncio.wait_for(listener.proven, 10)
        body = await p.read_frame(reader, p.MAX_HELLO_FRAME)
        assert body is not None
        welcome = p.handshake_codec().decode(body)
        assert isinstance(welcome, p.Welcome)
        assert p.proof_holds(secret, "parent", challenge.nonce, conn.hello.nonce, welcome.proof)
        late, _ = await _dial(listener.address)
        assert await _refused(late) == b""  # not even a challenge
        assert listener.refused == 1
    finally:
        listener.close()


def test_worker_listen_is_checked_at_start(tmp_path: Path) -> None:
    for bad in ("tcp:", "udp:127.0.0.1", "tcp:0.0.0.0"):
        with pytest.raises(ConfigError, match="worker_listen"):
            load_config(environ={"GPUVISOR_WORKER_LISTEN": bad, "GPUVISOR_STATE_DIR": str(tmp_path)})
    assert Endpoint.parse("tcp:[::1]") == Endpoint("tcp", "::1")


def test_a_chat_through_a_worker_that_dials_back_over_tcp(tiny_model_path: Path,
                                                          start_server: Callable[..., Server]) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    srv = start_server(models, env={"GPUVISOR_WORKER_LISTEN": "tcp:127.0.0.1"})
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    pid = next(w["pid"] for w in srv.workers() if w["model"] == "tiny")
    argv = psutil.Process(pid).cmdline()
    assert argv[argv.index("--tcp") + 1].startswith("127.0.0.1:") and "--socket" not in argv
