"""The worker's end of its connection: the secret, the dial, the handshake.

The parent gives a worker the secret of its spawn as the first line of its
stdin (never on the command line, which every user of the machine can read),
and the address to dial on its command line. The worker connects, reads the
parent's ``Challenge``, proves itself in ``Hello`` and reads nothing else
before the parent's ``Welcome`` proved the parent (worker/protocol.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import dataclass

from worker import protocol as p

log = logging.getLogger("gpuvisor.worker")

# The handshake is three small frames; a parent that does not finish it in
# this long is not answering (a crowded machine still takes milliseconds).
HANDSHAKE_TIMEOUT = 30.0
_MAX_SECRET_LINE = 256


class HandshakeRefused(Exception):
    """The other end did not prove itself: this is not our parent."""


@dataclass(frozen=True)
class Dial:
    """Where the parent listens: a Unix socket path, or TCP (host, port)."""

    unix: str = ""
    tcp: tuple[str, int] | None = None

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.tcp is not None:
            return await asyncio.open_connection(*self.tcp)
        return await asyncio.open_unix_connection(self.unix)


def read_secret(fd: int = 0) -> bytes:
    """The first line of ``fd`` (our stdin), as the spawn's secret.

    Read with os.read up to the newline only; whatever follows belongs to
    the stdin watch (worker/server.py), which only waits for the end.
    """
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk or len(line) >= _MAX_SECRET_LINE:
            raise HandshakeRefused("no secret on stdin (the parent writes it as the first line)")
        line += chunk
    try:
        return p.parse_secret_line(line)
    except ValueError as exc:
        raise HandshakeRefused(f"the first line of stdin is not a secret: {exc}") from exc


async def handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes) -> None:
    """Prove ourselves to the parent and check its proof (HandshakeRefused if it fails)."""
    async with asyncio.timeout(HANDSHAKE_TIMEOUT):
        codec = p.handshake_codec()
        challenge = await _read(reader, codec)
        if not isinstance(challenge, p.Challenge):
            raise HandshakeRefused(f"expected the parent's challenge, got {type(challenge).__name__}")
        if challenge.protocol_version != p.PROTOCOL_VERSION:
            # Said in the log; the parent learns it from our Hello.
            log.error("the parent speaks protocol %d, this worker %d", challenge.protocol_version,
                      p.PROTOCOL_VERSION)
        nonce = secrets.token_bytes(p.NONCE_BYTES)
        writer.write(p.worker_codec().encode(p.Hello(
            p.PROTOCOL_VERSION, os.getpid(), nonce, p.proof(secret, "worker", challenge.nonce, nonce))))
        await writer.drain()
        welcome = await _read(reader, codec)
        if not isinstance(welcome, p.Welcome):
            raise HandshakeRefused(f"expected the parent's welcome, got {type(welcome).__name__}")
        if not p.proof_holds(secret, "parent", challenge.nonce, nonce, welcome.proof):
            raise HandshakeRefused("the parent's proof does not hold: it does not know our secret")


async def _read(reader: asyncio.StreamReader, codec: p.Codec) -> object:
    try:
        body = await p.read_frame(reader, p.MAX_HELLO_FRAME)
        if body is None:
            raise HandshakeRefused("the parent closed the connection during the handshake")
        return codec.decode(body)
    except p.ProtocolError as exc:
        raise HandshakeRefused(f"bad handshake frame: {exc}") from exc
