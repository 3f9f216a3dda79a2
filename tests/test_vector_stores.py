"""Vector stores through the official SDK on the real service, with the tiny
model as the embedding model: files are chunked and embedded in the
background (in_progress, then completed), a search ranks the chunk that
holds the query's words first, deleting removes the chunks from SQLite,
non-text files are refused, and stores belong to the key that made them."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import VectorStore, VectorStoreDeleted, VectorStoreSearchResponse
from openai.types.vector_stores import VectorStoreFile, VectorStoreFileDeleted

from tests.server import REPO, Server, poll_until, running, short_tempdir

pytestmark = pytest.mark.timeout(240)

ADMIN = "gva_0123abcd_" + "B" * 43
EMBED_ENV = {"GPUVISOR_FILE_SEARCH_EMBEDDING_MODEL": "tiny"}

# A long file: filler paragraphs, and one sentence of rare words in the middle.
FILLER = "\n\n".join(f"Paragraph {i} talks about ordinary weather, roads and bread in town." for i in range(40))
NEEDLE = "The quartz zebra polishes violet lanterns at midnight."
LONG_TEXT = FILLER + "\n\n" + NEEDLE + "\n\n" + FILLER


def _chunks(server: Server, file_id: str) -> int:
    """The file's chunks in the service's database; its vector blocks must agree."""
    with sqlite3.connect(f"file:{server.state_dir / 'gpuvisor.db'}?mode=ro", uri=True) as db:
        chunks = int(db.execute("SELECT count(*) FROM chunks WHERE file_id = ?", (file_id,)).fetchone()[0])
        vectors = sum(len(ids) // 8 for (ids,) in db.execute(
            "SELECT chunk_ids FROM vector_blocks WHERE file_id = ?", (file_id,)))
    assert vectors == chunks, (vectors, chunks)
    return chunks


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    with running(Server(models, env=EMBED_ENV)) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _indexed(client: openai.OpenAI, store_id: str, total: int) -> VectorStore:
    return poll_until(lambda: client.vector_stores.retrieve(store_id),
                      lambda s: s.file_counts.in_progress == 0 and s.file_counts.total == total, timeout=90)


def test_files_are_indexed_and_search_ranks_the_chunk_with_the_words_first(
        server: Server, client: openai.OpenAI) -> None:
    long = client.files.create(file=("handbook.md", LONG_TEXT.encode()), purpose="assistants")
    short = client.files.create(file=("recipes.txt", b"Knead the dough, let it rise, bake it."), purpose="user_data")
    store = client.vector_stores.create(name="kb", file_ids=[long.id, short.id], metadata={"team": "a"})
    assert store.status in ("in_progress", "completed") and store.file_counts.total == 2
    done = _indexed(client, store.id, 2)
    raw = httpx.get(f"{server.base_url}/v1/vector_stores/{store.id}").json()
    VectorStore.model_validate(raw, strict=True)
    assert (done.status, done.file_counts.completed, done.metadata) == ("completed", 2, {"team": "a"})
    assert done.usage_bytes > len(LONG_TEXT)
    files = httpx.get(f"{server.base_url}/v1/vector_stores/{store.id}/files").json()["data"]
    for f in files:
        VectorStoreFile.model_validate(f, strict=True)
        assert f["status"] == "completed" and f["last_error"] is None
        assert f["chunking_strategy"] == {"type": "static", "static": {
            "max_chunk_size_tokens": 400, "chunk_overlap_tokens": 200}}
    assert _chunks(server, long.id) > 3  # the long file is cut into several overlapping chunks

    page = client.vector_stores.search(store.id, query="quartz zebra lanterns", max_num_results=3)
    raw_page = httpx.post(f"{server.base_url}/v1/vector_stores/{store.id}/search",
                          json={"query": "quartz zebra lanterns", "max_num_results": 3}).json()
    assert raw_page["object"] == "vector_store.search_results.page"
    for hit in raw_page["data"]:
        VectorStoreSearchResponse.model_validate(hit, strict=True)
    first = page.data[0]
    assert (first.file_id, first.filename) == (long.id, "handbook.md")
    assert NEEDLE in first.content[0].text
    assert len(page.data) <= 3 and first.score == max(h.score for h in page.data) and 0 < first.score <= 1
    # The other file's own words find it.
    assert client.vector_stores.search(store.id, query="knead dough").data[0].file_id == short.id


def test_deletes_remove_the_chunks(server: Server, client: openai.OpenAI) -> None:
    a = client.files.create(file=("a.txt", b"Alpha file about comets and orbits."), purpose="assistants")
    b = client.files.create(file=("b.txt", b"Beta file about tulips and soil."), purpose="assistants")
    store = client.vector_stores.create(name="two", file_ids=[a.id, b.id])
    _indexed(client, store.id, 2)
    assert _chunks(server, a.id) == 1 and _chunks(server, b.id) == 1
    gone = client.vector_stores.files.delete(a.id, vector_store_id=store.id)
    VectorStoreFileDeleted.model_validate(gone.model_dump(), strict=True)
    assert _chunks(server, a.id) == 0
    assert all(h.file_id != a.id for h in client.vector_stores.search(store.id, query="comets orbits").data)
    assert client.files.retrieve(a.id).id == a.id  # the file itself stays
    # Deleting the file takes it out of every store; deleting the store, the rest.
    added = client.vector_stores.files.create(vector_store_id=store.id, file_id=a.id,
                                              attributes={"kind": "note", "rank": 2})
    assert added.status == "in_progress" and added.attributes == {"kind": "note", "rank": 2}
    _indexed(client, store.id, 2)
    client.files.delete(a.id)
    assert _chunks(server, a.id) == 0
    assert client.vector_stores.retrieve(store.id).file_counts.total == 1
    deleted = client.vector_stores.delete(store.id)
    VectorStoreDeleted.model_validate(deleted.model_dump(), strict=True)
    assert _chunks(server, b.id) == 0
    with pytest.raises(openai.NotFoundError):
        client.vector_stores.retrieve(store.id)


def test_non_text_files_and_hostile_fields_are_refused(server: Server, client: openai.OpenAI) -> None:
    binary = client.files.create(file=("photo.png", b"\x89PNG\r\n\x1a\n\x00\x00"), purpose="assistants")
    bad_utf8 = client.files.create(file=("notes.txt", b"caf\xe9 au lait"), purpose="assistants")
    store = client.vector_stores.create(name="refusals")
    for file_id in (binary.id, bad_utf8.id):
        with pytest.raises(openai.BadRequestError) as info:
            client.vector_stores.files.create(vector_store_id=store.id, file_id=file_id)
        assert info.value.code == "unsupported_file" and info.value.param == "file_id"
    with pytest.raises(openai.BadRequestError) as info:
        client.vector_stores.create(file_ids=[binary.id])
    assert info.value.code == "unsupported_file"
    base = f"{server.base_url}/v1/vector_stores"

    def param(resp: httpx.Response, status: int = 400) -> object:
        assert resp.status_code == status, resp.text
        return resp.json()["error"]["param"]

    assert param(httpx.get(f"{base}/vs_nothex")) == "vector_store_id"
    assert param(httpx.post(base, json={"file_ids": ["../etc"]})) == "file_ids[0]"
    assert param(httpx.post(base, json={"name": 5})) == "name"
    assert param(httpx.post(base, json={"metadata": {f"k{i}": "v" for i in range(17)}})) == "metadata"
    assert param(httpx.post(base, json={"chunking_strategy": {"type": "static", "static": {
        "max_chunk_size_tokens": 800, "chunk_overlap_tokens": 400}}})) == \
        "chunking_strategy.static.max_chunk_size_tokens"
    assert param(httpx.post(f"{base}/{store.id}/search", json={"query": "x", "max_num_results": 0})) == \
        "max_num_results"
    assert param(httpx.post(f"{base}/{store.id}/search", json={"query": "   "})) == "query"
    assert param(httpx.post(f"{base}/{store.id}/search", json={"query": "x" * 5000})) == "query"
    assert param(httpx.post(f"{base}/{store.id}/files", json={"file_id": "file-" + "0" * 24}), 404) == "file_id"
    assert param(httpx.post(f"{base}/vs_{'0' * 24}/search", json={"query": "x"}), 404) == "vector_store_id"


def _add_key(state: Path, name: str) -> str:
    out = subprocess.run([sys.executable, "-m", "supervisor", "keys", "add", name, "--state-dir", str(state)],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    return out.stdout.strip()


def test_files_and_stores_belong_to_the_key_that_made_them(tiny_model_path: Path) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    state = short_tempdir("gv")
    alice_key, bob_key = _add_key(state, "alice"), _add_key(state, "bob")
    with running(Server(models, state_dir=state, env={**EMBED_ENV, "GPUVISOR_ADMIN_TOKEN": ADMIN})) as srv:
        def sdk(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0, timeout=60)

        alice, bob, admin = sdk(alice_key), sdk(bob_key), sdk(ADMIN)
        secret = alice.files.create(file=("secret.md", b"Alice keeps the garnet ledger."), purpose="assistants")
        store = alice.vector_stores.create(name="alice", file_ids=[secret.id])
        _indexed(alice, store.id, 1)
        for call in (lambda: bob.files.retrieve(secret.id), lambda: bob.files.content(secret.id),
                     lambda: bob.files.delete(secret.id), lambda: bob.vector_stores.retrieve(store.id),
                     lambda: bob.vector_stores.search(store.id, query="garnet"),
                     lambda: bob.vector_stores.files.list(store.id),
                     lambda: bob.vector_stores.delete(store.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        own = bob.vector_stores.create(name="bob")
        with pytest.raises(openai.NotFoundError):  # nor can bob put alice's file in his store
            bob.vector_stores.files.create(vector_store_id=own.id, file_id=secret.id)
        assert [f.id for f in bob.files.list().data] == []
        assert [s.id for s in bob.vector_stores.list().data] == [own.id]
        # Alice and the admin still see all of it; bob's attempts removed nothing.
        assert alice.vector_stores.search(store.id, query="garnet ledger").data[0].file_id == secret.id
        assert {s.id for s in admin.vector_stores.list().data} == {store.id, own.id}
        assert admin.files.retrieve(secret.id).id == secret.id
        # All of it is in the database: a restarted service finds and searches it.
        srv.restart()
        alice = sdk(alice_key)
        assert alice.vector_stores.search(store.id, query="garnet ledger").data[0].file_id == secret.id
        assert alice.files.content(secret.id).read() == b"Alice keeps the garnet ledger."


def test_attribute_filters_choose_the_files_searched(server: Server, client: openai.OpenAI) -> None:
    en = client.files.create(file=("en.txt", b"Harbor report: the amber ferry docks."), purpose="assistants")
    fr = client.files.create(file=("fr.txt", b"Harbor report: the amber ferry leaves."), purpose="assistants")
    store = client.vector_stores.create(name="filtered")
    client.vector_stores.files.create(vector_store_id=store.id, file_id=en.id, attributes={"lang": "en", "year": 2024})
    client.vector_stores.files.create(vector_store_id=store.id, file_id=fr.id, attributes={"lang": "fr", "year": 2020})
    # Indexing tokenizes on the embedding worker after it sat idle (longer
    # than the engine keeps an idle connection open): it still completes.
    assert _indexed(client, store.id, 2).file_counts.completed == 2
    listed = client.vector_stores.files.list(store.id).data
    assert {f.id: f.attributes for f in listed} == {en.id: {"lang": "en", "year": 2024},
                                                    fr.id: {"lang": "fr", "year": 2020}}

    def found(filters: object) -> set[str]:
        page = client.vector_stores.search(store.id, query="amber ferry harbor", filters=filters)  # type: ignore[arg-type]
        return {h.file_id for h in page.data}

    assert found(None) == {en.id, fr.id}
    assert found({"type": "eq", "key": "lang", "value": "fr"}) == {fr.id}
    assert found({"type": "gte", "key": "year", "value": 2021}) == {en.id}
    assert found({"type": "or", "filters": [{"type": "eq", "key": "lang", "value": "de"},
                                            {"type": "lt", "key": "year", "value": 2021}]}) == {fr.id}
    assert found({"type": "in", "key": "lang", "value": ["en", "fr"]}) == {en.id, fr.id}
    assert found({"type": "eq", "key": "missing", "value": "x"}) == set()
    bad = httpx.post(f"{server.base_url}/v1/vector_stores/{store.id}/search", json={
        "query": "ferry", "filters": {"type": "and", "filters": [{"type": "eq", "key": 5, "value": "x"}]}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "filters.filters[0].key", bad.text


def test_a_search_result_is_what_a_file_search_call_holds() -> None:
    # What the Responses tool loop puts in a file_search_call item's results.
    from openai.types.responses.response_file_search_tool_call import Result

    from supervisor.knowledge.service import SearchResult
    hit = SearchResult("vs_" + "1" * 24, "file-" + "2" * 24, "a.md", 0.5, "text", {"lang": "en", "n": 2})
    assert Result.model_validate(hit.to_call_result(), strict=True).model_dump() == {
        "file_id": hit.file_id, "filename": "a.md", "score": 0.5, "text": "text", "attributes": {"lang": "en", "n": 2}}
    VectorStoreSearchResponse.model_validate(hit.to_object(), strict=True)


def _status_in_db(state: Path, store_id: str, file_id: str) -> str:
    with sqlite3.connect(f"file:{state / 'gpuvisor.db'}?mode=ro", uri=True) as db:
        return str(db.execute("SELECT status FROM vector_store_files WHERE store_id = ? AND file_id = ?",
                              (store_id, file_id)).fetchone()[0])


def test_indexing_is_stopped_by_a_delete_and_resumed_after_a_crash(tiny_model_path: Path) -> None:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    # Long enough that indexing takes seconds: hundreds of chunks.
    book = "\n\n".join(f"Chapter {i}: the archivist files report {i} under shelf {i % 17}." for i in range(1500))
    with running(Server(models, env=EMBED_ENV)) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        f = client.files.create(file=("archive.txt", book.encode()), purpose="assistants")
        doomed = client.vector_stores.create(name="doomed", file_ids=[f.id])
        client.vector_stores.delete(doomed.id)  # cancels its indexing task and waits for it
        assert _chunks(srv, f.id) == 0
        store = client.vector_stores.create(name="kept", file_ids=[f.id])
        poll_until(lambda: _chunks(srv, f.id), lambda n: n > 0)  # indexing has begun
        srv.stop(signal.SIGKILL)
        assert _status_in_db(srv.state_dir, store.id, f.id) == "in_progress"
        srv.start()
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        done = _indexed(client, store.id, 1)
        assert done.file_counts.completed == 1
        # Among hundreds of chunks the tiny model's random embeddings put some
        # other chunk first too (a tie in the fused ranks): the words' chunk
        # is among the first three, not necessarily first.
        hits = client.vector_stores.search(store.id, query="report 1271", max_num_results=3).data
        assert any("report 1271 " in h.content[0].text for h in hits), hits
        # Each chunk once: the resumed run replaced what the killed one left.
        with sqlite3.connect(f"file:{srv.state_dir / 'gpuvisor.db'}?mode=ro", uri=True) as db:
            seqs = [r[0] for r in db.execute("SELECT seq FROM chunks WHERE file_id = ? ORDER BY seq", (f.id,))]
        assert seqs == list(range(len(seqs)))
