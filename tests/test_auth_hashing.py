"""What a bearer token costs: keys are found by their public id before any
hashing, and a hashed admin token carries its id, so an unknown or malformed
token costs no scrypt (counted by ``Auth.hash_checks``)."""

from __future__ import annotations

import secrets

from supervisor.api.auth import (
    ADMIN,
    Auth,
    FailureLimiter,
    Principal,
    hash_secret,
    hashed_id,
    new_api_key,
    parse_config_keys,
    verify_secret,
)

ADMIN_TOKEN = "gva_0123abcd_" + "A" * 43


def _gate(admin_hash: str) -> tuple[Auth, str]:
    key_id, key = new_api_key()
    gate = Auth(None, parse_config_keys([f"lab:{key_id}:{hash_secret(key)}"]), admin_hash,
                failures=FailureLimiter(limit=10_000))
    return gate, key


def _unknown() -> list[str]:
    return [
        "not-a-key-" + secrets.token_hex(8),  # no known shape
        "gva_junk",  # admin prefix, not the admin shape
        "gv_" + "x" * 40,  # key prefix, no id
        new_api_key()[1],  # a key id nobody holds
        f"gva_{secrets.token_hex(4)}_{secrets.token_urlsafe(32)}",  # admin shape, another id
    ]


def test_the_admin_hash_carries_the_token_id() -> None:
    stored = hash_secret(ADMIN_TOKEN)
    assert stored.startswith("scrypt$") and hashed_id(stored) == "0123abcd"
    assert verify_secret(ADMIN_TOKEN, stored) and not verify_secret(ADMIN_TOKEN[:-1] + "B", stored)
    assert hashed_id(hash_secret(new_api_key()[1])) is None  # API key hashes are unchanged


async def test_unknown_tokens_cost_no_scrypt_before_the_admin_is_ever_seen() -> None:
    gate, key = _gate(hash_secret(ADMIN_TOKEN))
    for _ in range(20):
        for token in _unknown():
            assert await gate.identify_bearer(token, "10.0.0.2") is None
    assert gate.hash_checks == 0
    assert await gate.identify_bearer(ADMIN_TOKEN, "10.0.0.1") == ADMIN
    assert await gate.identify_bearer(key, "10.0.0.1") == Principal("lab", "user")
    assert gate.hash_checks == 2
    # Remembered: no hashing again; a wrong secret for the real id costs one.
    assert await gate.identify_bearer(ADMIN_TOKEN, "10.0.0.1") == ADMIN
    assert await gate.identify_bearer(ADMIN_TOKEN[:-4] + "BBBB", "10.0.0.2") is None
    assert gate.hash_checks == 3


async def test_an_old_admin_hash_without_id_costs_one_scrypt_per_shaped_guess_until_seen() -> None:
    old = hash_secret(ADMIN_TOKEN).rsplit("$", 1)[0]  # the form before ids were carried
    gate, _ = _gate(old)
    for token in _unknown()[:4]:  # nothing of the admin shape: free
        assert await gate.identify_bearer(token, "10.0.0.2") is None
    assert gate.hash_checks == 0
    assert await gate.identify_bearer(_unknown()[4], "10.0.0.2") is None
    assert gate.hash_checks == 1
    assert await gate.identify_bearer(ADMIN_TOKEN, "10.0.0.1") == ADMIN
    for token in _unknown():  # its id is known now
        assert await gate.identify_bearer(token, "10.0.0.2") is None
    assert gate.hash_checks == 2
