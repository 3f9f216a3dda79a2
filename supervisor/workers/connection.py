"""The parent's end of a worker connection: where it listens, who it lets in.

A worker dials back to a listener the parent opens for that one spawn: a
Unix socket in the run dir (the default) or TCP (``worker_listen =
"tcp:HOST"``, a free port per spawn), for workers a cluster launcher starts
on other machines. Every connection must prove the spawn's secret first
(worker/protocol.py: the handshake): the parent sends a ``Challenge``, reads
one small frame, and lets the connection in only if it is a ``Hello`` whose
proof holds. Any other connection (wrong or no proof, another frame first,
an oversize frame, silence) is closed and logged in one line, and the spawn
goes on waiting for its real worker. What crosses the connection afterwards
is plain msgpack frames: TCP belongs on a private network (TLS is not built).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from worker import protocol as p

log = logging.getLogger("gpuvisor.worker")

# How long a connection may take to prove itself; the real worker answers
# the challenge in milliseconds (it proves itself before it loads its model).
AUTH_TIMEOUT = 10.0
# Connections refused in one spawn that get a log line each; the rest are
# counted in one line when the spawn ends (a flood does not flood the log).
LOGGED_REFUSALS = 10
# Connections proving themselves at once; more are closed unread.
MAX_UNPROVEN = 16


@dataclass(frozen=True)
class Endpoint:
    """Where the parent listens for its workers."""

    transport: Literal["unix", "tcp"] = "unix"
    host: str = ""  # tcp only: the address to bind, which the worker dials
    auth_timeout: float = AUTH_TIMEOUT

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """``""`` or ``"unix"``: a Unix socket in the run dir; ``"tcp:HOST"``: TCP on HOST."""
        if text in ("", "unix"):
            return cls()
        kind, _, host = text.partition(":")
        host = host.strip("[]")
        if kind != "tcp" or not host:
            raise ValueError(f'worker_listen must be "unix" or "tcp:HOST", not {text!r}')
        if host in ("0.0.0.0", "::"):
            raise ValueError("worker_listen must name an address the workers can dial, not a wildcard")
        return cls("tcp", host)


class Connection:
    """One proven worker connection: framed msgspec messages both ways."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: p.Hello,
                 peer: str) -> None:
        self.reader = reader
        self.writer = writer
        self.hello = hello
        self.peer = peer
        self.codec = p.parent_codec()

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self.codec.encode(msg)

    def write(self, frame: bytes) -> None:
        """Write a frame unless the connection is closing (a dead worker's crash says why)."""
        if not self.writer.is_closing():
            self.writer.write(frame)

    def send(self, msg: msgspec.Struct) -> None:
        self.write(self.codec.encode(msg))

    async def read(self) -> p.FromWorker | None:
        """The next message, None on a clean end of stream.

        ProtocolError or ConnectionError when the stream broke; InvalidMessage
        for a frame that decodes to no message (the stream stays in sync).
        """
        body = await p.read_frame(self.reader)
        if body is None:
            return None
        msg: p.FromWorker = self.codec.decode(body)
        return msg

    def close(self) -> None:
        self.writer.close()


class Refused(Exception):
    """A connection that did not prove itself; the message says how."""


class Listener:
    """The listener of one spawn, letting in the first connection that proves the secret."""

    def __init__(self, endpoint: Endpoint, secret: bytes, label: str) -> None:
        self.endpoint = endpoint
        self.secret = secret
        self.label = label
        self.proven: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
        self.refused = 0
        self.last_refusal = ""
        self._server: asyncio.Server | None = None
        self._path: Path | None = None
        self._unproven: set[asyncio.Task[None]] = set()
        self.address: list[str] = []  # the worker's arguments that name this listener

    async def open(self, unix_path: Path | None) -> None:
        """Start listening: on ``unix_path``, or (None) on a free TCP port of the endpoint's host."""
        if unix_path is None:
            self._server = await asyncio.start_server(self._accept, self.endpoint.host, 0)
            port = self._server.sockets[0].getsockname()[1]
            host = self.endpoint.host
            self.address = ["--tcp", f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
        else:
            unix_path.unlink(missing_ok=True)
            self._path = unix_path
            self._server = await asyncio.start_unix_server(self._accept, path=str(unix_path))
            self.address = ["--socket", str(unix_path)]

    def close(self) -> None:
        """Stop listening and drop every connection still proving itself."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None
        for task in self._unproven:
            task.cancel()
        if self.refused > LOGGED_REFUSALS:
            log.warning("worker %s: %d more connections refused", self.label, self.refused - LOGGED_REFUSALS)
        if not self.proven.done():
            self.proven.cancel()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.proven.done() or len(self._unproven) >= MAX_UNPROVEN:
            self._refuse(writer, "the spawn's worker is in already" if self.proven.done()
                         else f"{MAX_UNPROVEN} connections are proving themselves already")
            return
        task = asyncio.create_task(self._prove(reader, writer), name=f"prove:{self.label}")
        self._unproven.add(task)
        task.add_done_callback(self._unproven.discard)

    async def _prove(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonce = secrets.token_bytes(p.NONCE_BYTES)
        try:
            async with asyncio.timeout(self.endpoint.auth_timeout):
                hello = await self._hello(reader, writer, nonce)
        except Refused as exc:
            self._refuse(writer, str(exc))
            return
        except TimeoutError:
            self._refuse(writer, f"no hello within {self.endpoint.auth_timeout:g}s")
            return
        except (ConnectionError, p.ProtocolError) as exc:
            self._refuse(writer, f"{type(exc).__name__}: {exc}")
            return
        except asyncio.CancelledError:
            writer.close()  # the listener closed: the spawn no longer waits for anyone
            raise
        if self.proven.done():
            self._refuse(writer, "the spawn's worker is in already")
            return
        writer.write(p.hello_codec().encode(p.Welcome(p.proof(self.secret, "parent", nonce, hello.nonce))))
        self.proven.set_result(Connection(reader, writer, hello, _peer(writer)))

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, nonce: bytes) -> p.Hello:
        """Challenge the connection and read its Hello; Refused unless its proof holds."""
        codec = p.hello_codec()
        writer.write(codec.encode(p.Challenge(p.PROTOCOL_VERSION, nonce)))
        body = await p.read_frame(reader, p.MAX_HELLO_FRAME)
        if body is None:
            raise Refused("closed before its hello")
        try:
            hello: p.Hello = codec.decode(body)
        except p.InvalidMessage as exc:
            raise Refused(f"its first frame is no hello ({exc})") from exc
        if not p.proof_holds(self.secret, "worker", nonce, hello.nonce, hello.proof):
            raise Refused(f"its hello (pid {hello.pid}) proves no secret of this spawn")
        return hello

    def _refuse(self, writer: asyncio.StreamWriter, why: str) -> None:
        self.refused += 1
        self.last_refusal = why
        if self.refused <= LOGGED_REFUSALS:
            log.warning("worker %s: refused a connection from %s: %s", self.label, _peer(writer), why)
        writer.close()


def _peer(writer: asyncio.StreamWriter) -> str:
    """Who connected: host:port over TCP; a Unix socket's peers have no name."""
    name = writer.get_extra_info("peername")
    if isinstance(name, tuple) and len(name) >= 2:
        return f"{name[0]}:{name[1]}"
    return "a local process"
