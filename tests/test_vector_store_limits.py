"""Vector stores' expires_after and the per-key quota, on the real service
with the tiny model as the embedding model: a store past its expiry is
listed as expired, refuses searches, files and the file_search tool, and
the service's own sweep deletes it (the files stay); a key's stores hold at
most vector_stores_max_bytes_per_key bytes of files, past which an add is a
413 naming the setting. Objects validate strictly as the SDK's types."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import VectorStore, VectorStoreSearchResponse
from openai.types.vector_stores import VectorStoreFile, VectorStoreFileDeleted

from tests.server import REPO, Server, poll_until, running, short_tempdir

pytestmark = pytest.mark.timeout(240)
ADMIN = "gva_0123abcd_" + "D" * 43
QUOTA = 100
ENV = {"GPUVISOR_FILE_SEARCH_EMBEDDING_MODEL": "tiny", "GPUVISOR_ADMIN_TOKEN": ADMIN,
       "GPUVISOR_VECTOR_STORES_MAX_BYTES_PER_KEY": str(QUOTA)}
DAY = 86400


def _add_key(state: Path, name: str) -> str:
    out = subprocess.run([sys.executable, "-m", "supervisor", "keys", "add", name, "--state-dir", str(state)],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    return out.stdout.strip()


class Setup:
    def __init__(self, models: Path, state: Path) -> None:
        self.models, self.state = models, state
        self.alice, self.bob = _add_key(state, "alice"), _add_key(state, "bob")


@pytest.fixture(scope="module")
def setup(tiny_model_path: Path) -> Setup:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    return Setup(models, short_tempdir("gv"))


@pytest.fixture(scope="module")
def srv(setup: Setup) -> Iterator[Server]:
    # The default sweep (every 300 s): none runs until a test asks for it.
    with running(Server(setup.models, state_dir=setup.state, env=ENV)) as server:
        yield server


def sdk(srv: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def _error(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]  # type: ignore[no-any-return]


def _post(srv: Server, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/v1/{path}", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)


def _age(state: Path, store_id: str, days: float) -> None:
    """Move the store's last use ``days`` back, in the service's own database."""
    with sqlite3.connect(state / "gpuvisor.db", timeout=30) as db:
        db.execute("UPDATE vector_stores SET last_active_at = last_active_at - ? WHERE id = ?",
                   (int(days * DAY), store_id))


def _indexed(client: openai.OpenAI, store_id: str, total: int) -> VectorStore:
    return poll_until(lambda: client.vector_stores.retrieve(store_id),
                      lambda s: s.file_counts.in_progress == 0 and s.file_counts.total == total, timeout=90)


def test_an_expired_store_is_listed_so_refuses_use_and_is_swept(setup: Setup, srv: Server) -> None:
    alice = sdk(srv, setup.alice)
    notes = alice.files.create(file=("notes.md", b"The heron waits."), purpose="assistants")
    store = alice.vector_stores.create(name="brief", file_ids=[notes.id],
                                       expires_after={"anchor": "last_active_at", "days": 2})
    kept = alice.vector_stores.create(name="kept")
    raw = httpx.get(f"{srv.base_url}/v1/vector_stores/{store.id}", headers={"Authorization": f"Bearer {setup.alice}"},
                    timeout=30).json()
    checked = VectorStore.model_validate(raw, strict=True)
    assert checked.expires_after is not None and checked.expires_after.days == 2
    assert checked.last_active_at is not None and checked.expires_at == checked.last_active_at + 2 * DAY
    assert checked.status != "expired"
    _indexed(alice, store.id, 1)
    # A search is a use: it moves last_active_at, and expires_at with it.
    _age(setup.state, store.id, 1)
    alice.vector_stores.search(store.id, query="heron")
    searched = alice.vector_stores.retrieve(store.id)
    assert searched.last_active_at is not None and searched.expires_at is not None
    assert searched.expires_at == searched.last_active_at + 2 * DAY >= checked.expires_at
    _age(setup.state, store.id, 2.5)
    expired = alice.vector_stores.retrieve(store.id)
    assert expired.status == "expired" and expired.expires_at is not None and expired.expires_at < checked.expires_at
    assert {s.id: s.status for s in alice.vector_stores.list()}[store.id] == "expired"
    refused = _error(_post(srv, setup.alice, f"vector_stores/{store.id}/search", {"query": "heron"}), 400)
    assert (refused["code"], refused["param"]) == ("vector_store_expired", "vector_store_id")
    assert "expired" in refused["message"]
    other = alice.files.create(file=("more.md", b"More."), purpose="assistants")
    assert _error(_post(srv, setup.alice, f"vector_stores/{store.id}/files", {"file_id": other.id}),
                  400)["code"] == "vector_store_expired"
    tool = {"type": "file_search", "vector_store_ids": [store.id]}
    asked = _error(_post(srv, setup.alice, "responses", {"model": "tiny", "input": "x", "tools": [tool],
                                                         "tool_choice": {"type": "file_search"}}), 400)
    assert asked["param"] == "tools[0].vector_store_ids" and asked["code"] == "vector_store_expired"
    # The sweep deletes it, and only it; the files stay. (The same service, sweeping often.)
    usual = srv.extra_env
    srv.extra_env = {**usual, "GPUVISOR_VECTOR_STORES_SWEEP_INTERVAL_S": "0.2"}
    srv.restart()
    try:
        alice = sdk(srv, setup.alice)
        poll_until(lambda: {s.id for s in alice.vector_stores.list()}, lambda ids: store.id not in ids, timeout=30)
        with pytest.raises(openai.NotFoundError):
            alice.vector_stores.retrieve(store.id)
        assert alice.vector_stores.retrieve(kept.id).status == "completed"
        assert alice.files.retrieve(notes.id).id == notes.id
    finally:
        # The module's later tests age stores on purpose and read them expired, not swept.
        srv.extra_env = usual
        srv.restart()
    with sqlite3.connect(f"file:{setup.state / 'gpuvisor.db'}?mode=ro", uri=True) as db:
        assert db.execute("SELECT count(*) FROM chunks WHERE store_id = ?", (store.id,)).fetchone()[0] == 0


@pytest.mark.parametrize("expires,param", [
    ({"anchor": "created_at", "days": 1}, "expires_after.anchor"),
    ({"anchor": "last_active_at", "days": 0}, "expires_after.days"),
    ({"anchor": "last_active_at", "days": 366}, "expires_after.days"),
    ({"anchor": "last_active_at", "days": 1, "hours": 2}, "expires_after"),
    ({"anchor": "last_active_at"}, "expires_after"),
])
def test_bad_expires_after_is_refused_naming_the_field(setup: Setup, srv: Server, expires: dict[str, Any],
                                                       param: str) -> None:
    error = _error(_post(srv, setup.alice, "vector_stores", {"name": "x", "expires_after": expires}), 400)
    assert error["param"] == param, error


def test_a_keys_stores_hold_at_most_the_quota(setup: Setup, srv: Server) -> None:
    alice, bob, admin = sdk(srv, setup.alice), sdk(srv, setup.bob), sdk(srv, ADMIN)
    sixty = b"x" * 59 + b"\n"
    a = alice.files.create(file=("a.txt", sixty), purpose="assistants")
    b = alice.files.create(file=("b.txt", sixty), purpose="assistants")
    first = alice.vector_stores.create(name="first", file_ids=[a.id])
    before = {s.id for s in alice.vector_stores.list()}
    over = _error(_post(srv, setup.alice, f"vector_stores/{first.id}/files", {"file_id": b.id}), 413)
    assert (over["param"], over["code"]) == ("vector_stores_max_bytes_per_key", "quota_exceeded")
    assert str(QUOTA) in over["message"] and "120" in over["message"]
    # A store made with files past it is not made at all.
    _error(_post(srv, setup.alice, "vector_stores", {"name": "second", "file_ids": [b.id]}), 413)
    assert {s.id for s in alice.vector_stores.list()} == before
    # Adding a file the store holds again counts it once.
    assert alice.vector_stores.files.create(vector_store_id=first.id, file_id=a.id).status == "in_progress"
    _indexed(alice, first.id, 1)
    # Each key has its own quota; the admin has none, also for a store with both files.
    mine = bob.files.create(file=("c.txt", sixty), purpose="assistants")
    bob.vector_stores.create(name="bob", file_ids=[mine.id])
    both = admin.vector_stores.create(name="admin", file_ids=[a.id, b.id])
    assert both.file_counts.total == 2
    # Deleting a store frees what it held.
    alice.vector_stores.delete(first.id)
    assert alice.vector_stores.create(name="again", file_ids=[b.id]).file_counts.total == 1


def test_a_store_is_modified_and_its_files_read_by_its_key_only(setup: Setup, srv: Server) -> None:
    alice, bob = sdk(srv, setup.alice), sdk(srv, setup.bob)
    note = alice.files.create(file=("otter.md", b"The otter naps."), purpose="assistants")
    store = alice.vector_stores.create(name="before", file_ids=[note.id], metadata={"team": "a", "old": "1"})
    _indexed(alice, store.id, 1)
    _age(setup.state, store.id, 1)
    # Each field as the SDK sends it; the answer is the whole store, strictly the SDK's type.
    changed = alice.with_raw_response.vector_stores.update(
        store.id, name="after", metadata={"team": "b"}, expires_after={"anchor": "last_active_at", "days": 3})
    got = VectorStore.model_validate(changed.http_response.json(), strict=True)
    assert (got.name, got.metadata, got.file_counts.completed) == ("after", {"team": "b"}, 1)
    assert got.expires_after is not None and got.expires_after.days == 3
    # A change is a use: expires_at counts from now, not from the day-old last use.
    assert got.last_active_at is not None and got.last_active_at >= store.created_at  # aged: a day before
    assert got.expires_at == got.last_active_at + 3 * DAY
    assert alice.vector_stores.retrieve(store.id).model_dump() == got.model_dump()
    # A field left out stays; null clears it.
    kept = alice.vector_stores.update(store.id, name="renamed")
    assert (kept.metadata, kept.expires_after.days if kept.expires_after else None) == ({"team": "b"}, 3)
    cleared = alice.vector_stores.update(store.id, expires_after=None, metadata=None)
    assert (cleared.expires_after, cleared.expires_at, cleared.metadata, cleared.name) == (None, None, {}, "renamed")
    # Hostile fields: a 400 naming each, and the store as it was.
    url = f"vector_stores/{store.id}"
    for body, param in (({"name": "n" * 257}, "name"), ({"name": 5}, "name"),
                        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                        ({"metadata": {"k": "v" * 513}}, "metadata[...]"),
                        ({"expires_after": {"anchor": "last_active_at", "days": 0}}, "expires_after.days"),
                        ({"expires_after": {"anchor": "created_at", "days": 1}}, "expires_after.anchor"),
                        ({"expires_after": {"days": 1}}, "expires_after")):
        error = _error(_post(srv, setup.alice, url, body), 400)
        assert error["param"] == param, (body, error)
    # A key over 64 characters and a field modify does not take are refused too (the decoder names no param).
    assert "metadata" in _error(_post(srv, setup.alice, url, {"metadata": {"k" * 65: "v"}}), 400)["message"]
    assert "file_ids" in _error(_post(srv, setup.alice, url, {"file_ids": []}), 400)["message"]
    assert alice.vector_stores.retrieve(store.id).model_dump() == cleared.model_dump()
    assert _error(_post(srv, setup.alice, "vector_stores/vs_nope", {"name": "x"}), 400)["param"] == "vector_store_id"
    assert _error(_post(srv, setup.alice, f"vector_stores/vs_{'0' * 24}", {"name": "x"}), 404)["param"] \
        == "vector_store_id"
    # The store's file: retrieve, search, delete, each strictly the SDK's type.
    raw = alice.with_raw_response.vector_stores.files.retrieve(note.id, vector_store_id=store.id)
    one = VectorStoreFile.model_validate(raw.http_response.json(), strict=True)
    assert (one.id, one.vector_store_id, one.status) == (note.id, store.id, "completed")
    found = alice.with_raw_response.vector_stores.search(store.id, query="otter")
    hits = found.http_response.json()["data"]
    assert [VectorStoreSearchResponse.model_validate(h, strict=True).file_id for h in hits] == [note.id]
    # Another key sees none of it: every route is a 404, as for a store that does not exist.
    for call in (lambda: bob.vector_stores.update(store.id, name="mine"),
                 lambda: bob.vector_stores.files.retrieve(note.id, vector_store_id=store.id),
                 lambda: bob.vector_stores.files.delete(note.id, vector_store_id=store.id),
                 lambda: bob.vector_stores.search(store.id, query="otter")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.vector_stores.retrieve(store.id).name == "renamed"
    gone = alice.with_raw_response.vector_stores.files.delete(note.id, vector_store_id=store.id)
    deleted = VectorStoreFileDeleted.model_validate(gone.http_response.json(), strict=True)
    assert (deleted.id, deleted.deleted) == (note.id, True)
    with pytest.raises(openai.NotFoundError):
        alice.vector_stores.files.retrieve(note.id, vector_store_id=store.id)
    assert alice.vector_stores.search(store.id, query="otter").data == []
    # An expired store is refused a change as any other use (the sweep removes it).
    _age(setup.state, store.id, 0)
    alice.vector_stores.update(store.id, expires_after={"anchor": "last_active_at", "days": 1})
    _age(setup.state, store.id, 2)
    assert _error(_post(srv, setup.alice, url, {"name": "revived"}), 400)["code"] == "vector_store_expired"
    alice.vector_stores.delete(store.id)
