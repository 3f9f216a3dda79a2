"""API keys and admin tokens: their shape, their salted scrypt hashes, and the
key store in the parent's database.

A key is ``gv_<id>_<secret>`` and an admin token ``gva_<id>_<secret>``; the
public id selects the one hash a token could match, so nothing unknown is
hashed. Only hashes are stored: in the database (``gpuvisor keys``) or in
config (``api_keys``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from supervisor.db import Database
from supervisor.errors import BadRequest, Conflict, NotFound

AUTH_SCHEMA = [
    (
        "CREATE TABLE api_keys ("
        " id TEXT PRIMARY KEY,"
        " name TEXT NOT NULL,"
        " hash TEXT NOT NULL,"
        " created_at REAL NOT NULL,"
        " revoked_at REAL)"
    ),
    "CREATE UNIQUE INDEX api_keys_active_name ON api_keys(name) WHERE revoked_at IS NULL",
]

KEY_PREFIX = "gv_"
ADMIN_PREFIX = "gva_"  # `gpuvisor keys admin-token`
# scrypt cost: ~16 MiB and tens of ms once per key per process (then cached).
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 1 << 14, 8, 1


def hash_secret(secret: str, salt: bytes | None = None) -> str:
    """``scrypt$N$r$p$salt$digest``; for an admin token, ``$<its id>`` follows
    (public, like a key's id: it lets a wrong token be refused unhashed)."""
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(secret.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32)
    hashed = f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${salt.hex()}${digest.hex()}"
    admin_id = key_id_of(secret, ADMIN_PREFIX)
    return hashed if admin_id is None else f"{hashed}${admin_id}"


def hashed_id(stored: str) -> str | None:
    """The public id a hash carries (admin tokens hashed since ids were added)."""
    parts = stored.split("$")
    return parts[6] if len(parts) == 7 else None


def verify_secret(secret: str, stored: str) -> bool:
    parts = stored.split("$")
    if len(parts) not in (6, 7) or parts[0] != "scrypt" or not all(p.isdigit() for p in parts[1:4]):
        return False
    n, r, p = (int(x) for x in parts[1:4])
    try:
        salt, want = bytes.fromhex(parts[4]), bytes.fromhex(parts[5])
        got = hashlib.scrypt(secret.encode(), salt=salt, n=n, r=r, p=p, dklen=len(want))
    except ValueError:
        return False
    return hmac.compare_digest(got, want)


def new_api_key() -> tuple[str, str]:
    """(public id, full key); the key is shown once and never stored."""
    key_id = secrets.token_hex(4)
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def key_id_of(key: str, prefix: str = KEY_PREFIX) -> str | None:
    if not key.startswith(prefix):
        return None
    key_id, sep, rest = key[len(prefix):].partition("_")
    return key_id if sep and rest and len(key_id) == 8 else None


def token_digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


@dataclass(frozen=True)
class KeyRecord:
    id: str
    name: str
    hash: str
    source: Literal["config", "database"]
    created_at: float | None = None


def parse_config_keys(entries: Sequence[str]) -> dict[str, KeyRecord]:
    """``api_keys = ["NAME:ID:HASH", ...]`` as printed by ``gpuvisor keys add --print-config``."""
    out: dict[str, KeyRecord] = {}
    for entry in entries:
        name, _, rest = entry.partition(":")
        key_id, _, hashed = rest.partition(":")
        if not name or len(key_id) != 8 or not hashed.startswith("scrypt$"):
            raise ValueError("api_keys entries must look like NAME:ID:scrypt$... "
                             "(see `gpuvisor keys add NAME --print-config`)")
        out[key_id] = KeyRecord(key_id, name, hashed, "config")
    return out


class KeyStore:
    """API keys in the parent's database."""

    def __init__(self, db: Database, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.clock = clock

    async def add(self, name: str) -> tuple[KeyRecord, str]:
        if not name or len(name) > 64 or not name.replace("-", "").replace("_", "").isalnum():
            raise BadRequest("a key name is 1-64 letters, digits, '-' or '_'", param="name")
        key_id, key = new_api_key()
        hashed = await asyncio.to_thread(hash_secret, key)
        now = self.clock()
        async with self.db.write() as conn:
            found = await conn.execute_fetchall(
                "SELECT 1 FROM api_keys WHERE name = ? AND revoked_at IS NULL", (name,))
            if found:
                raise Conflict(f"an active key named {name!r} exists; revoke it first", param="name")
            await conn.execute("INSERT INTO api_keys (id, name, hash, created_at) VALUES (?, ?, ?, ?)",
                               (key_id, name, hashed, now))
        return KeyRecord(key_id, name, hashed, "database", now), key

    async def revoke(self, name_or_id: str) -> KeyRecord:
        async with self.db.write() as conn:
            rows = list(await conn.execute_fetchall(
                "UPDATE api_keys SET revoked_at = ? WHERE (name = ? OR id = ?) AND revoked_at IS NULL "
                "RETURNING id, name, hash, created_at", (self.clock(), name_or_id, name_or_id)))
        if not rows:
            raise NotFound(f"no active key named {name_or_id!r}", param="name")
        r = rows[0]
        return KeyRecord(r["id"], r["name"], r["hash"], "database", r["created_at"])

    async def active(self) -> list[KeyRecord]:
        rows = await self.db.conn.execute_fetchall(
            "SELECT id, name, hash, created_at FROM api_keys WHERE revoked_at IS NULL ORDER BY created_at")
        return [KeyRecord(r["id"], r["name"], r["hash"], "database", r["created_at"]) for r in rows]

    async def lookup(self, key_id: str) -> KeyRecord | None:
        rows = list(await self.db.conn.execute_fetchall(
            "SELECT id, name, hash, created_at FROM api_keys WHERE id = ? AND revoked_at IS NULL",
            (key_id,)))
        return None if not rows else KeyRecord(
            rows[0]["id"], rows[0]["name"], rows[0]["hash"], "database", rows[0]["created_at"])

    async def any_active(self) -> bool:
        rows = list(await self.db.conn.execute_fetchall(
            "SELECT EXISTS(SELECT 1 FROM api_keys WHERE revoked_at IS NULL)"))
        return bool(rows[0][0])

    async def any_ever(self) -> bool:
        """A key was ever stored (revoking keeps the row): auth was configured."""
        rows = list(await self.db.conn.execute_fetchall("SELECT EXISTS(SELECT 1 FROM api_keys)"))
        return bool(rows[0][0])


def describe(record: KeyRecord) -> dict[str, Any]:
    return {"id": record.id, "name": record.name, "source": record.source, "created_at": record.created_at}
