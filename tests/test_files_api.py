"""/v1/files through the official SDK: upload, list, retrieve, content and
delete on the real service; the size limit (413, and nothing left on disk);
hostile ids and fields (400 naming the field); and vector stores refused
with a 409 naming the setting where no embedding model is set."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import FileDeleted, FileObject

from tests.server import Server, running, short_tempdir

pytestmark = pytest.mark.timeout(180)

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gvm")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    with running(Server(models, env={"GPUVISOR_FILES_MAX_BYTES": str(LIMIT)})) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _error(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]  # type: ignore[no-any-return]


def test_a_file_goes_up_lists_reads_back_and_is_deleted(server: Server, client: openai.OpenAI) -> None:
    data = "# Notes\n\nThe lighthouse keeper counts ships.\n".encode()
    made = client.files.create(file=("notes.md", data), purpose="assistants")
    raw = httpx.get(f"{server.base_url}/v1/files/{made.id}").json()
    obj = FileObject.model_validate(raw, strict=True)
    assert (obj.filename, obj.bytes, obj.purpose, obj.object) == ("notes.md", len(data), "assistants", "file")
    assert client.files.retrieve(made.id) == made
    other = client.files.create(file=("data.csv", b"a,b\n1,2\n"), purpose="user_data")
    listed = client.files.list()
    assert {f.id for f in listed.data} >= {made.id, other.id}
    assert [f.id for f in client.files.list(purpose="user_data").data] == [other.id]
    newest_first = [f.id for f in client.files.list(limit=1).data]
    assert newest_first == [other.id]
    assert client.files.content(made.id).read() == data
    gone = client.files.delete(made.id)
    assert FileDeleted.model_validate(gone.model_dump(), strict=True) == FileDeleted(
        id=made.id, deleted=True, object="file")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(made.id)
    assert not (server.state_dir / "files" / made.id).exists()


def test_an_upload_over_the_limit_is_413_and_leaves_nothing(server: Server, client: openai.OpenAI) -> None:
    before = {f.id for f in client.files.list().data}
    with pytest.raises(openai.APIStatusError) as info:
        client.files.create(file=("big.txt", b"x" * (LIMIT + 1)), purpose="assistants")
    assert info.value.status_code == 413
    assert info.value.body["param"] == "file"  # type: ignore[index]
    assert {f.id for f in client.files.list().data} == before
    assert not list((server.state_dir / "files").glob(".upload-*"))
    at_limit = client.files.create(file=("edge.txt", b"y" * LIMIT), purpose="assistants")
    assert at_limit.bytes == LIMIT


def test_hostile_ids_and_fields_get_400_naming_the_field(server: Server) -> None:
    url = server.base_url + "/v1/files"
    assert _error(httpx.get(url + "/../../etc/passwd"), 404)["code"] == "not_found"
    assert _error(httpx.get(url + "/file-nothex"), 400)["param"] == "file_id"
    assert _error(httpx.get(url + "/file-" + "0" * 24), 404)["param"] == "file_id"
    assert _error(httpx.post(url, files={"file": ("a.txt", b"hi")}, data={"purpose": "fine-tune"}),
                  400)["param"] == "purpose"
    assert _error(httpx.post(url, files={"file": ("a.txt", b"hi")}), 400)["param"] == "purpose"
    assert _error(httpx.post(url, data={"purpose": "assistants"}), 400)["param"] == "file"
    assert _error(httpx.post(url, files={"file": ("a.txt", b"")}, data={"purpose": "assistants"}),
                  400)["param"] == "file"
    assert _error(httpx.post(url, json={"purpose": "assistants"}), 400)["param"] == "file"
    assert _error(httpx.get(url, params={"limit": "0"}), 400)["param"] == "limit"
    assert _error(httpx.get(url, params={"after": "x'; DROP TABLE files"}), 400)["param"] == "after"
    # A path in the name is only a name: the file is stored under its id.
    sent = httpx.post(url, files={"file": ("../../escape.txt", b"hi")}, data={"purpose": "assistants"}).json()
    assert sent["filename"] == "escape.txt"
    assert not (server.state_dir.parent / "escape.txt").exists()


def test_vector_stores_need_the_embedding_model_setting(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.ConflictError) as info:
        client.vector_stores.create(name="kb")
    assert info.value.body["param"] == "file_search_embedding_model"  # type: ignore[index]
    assert "file_search_embedding_model" in info.value.message
