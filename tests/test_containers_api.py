"""``/v1/containers`` through the OpenAI SDK on a real gpuvisor server with
two API keys and the real sandbox: containers are made (with files copied
from /v1/files), listed in pages, retrieved and deleted; files are uploaded
as multipart or copied by file_id, listed, read and deleted; a container
made so is the one a code_interpreter tool names, with its files there.
Each object validates strictly as the SDK's type; another key gets 404s;
bad fields are 400s naming the field, a name taken a 409, bytes past the
container's bound a 413."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import (
    ContainerCreateResponse,
    ContainerListResponse,
    ContainerRetrieveResponse,
)
from openai.types.containers import FileCreateResponse, FileListResponse

from supervisor.models.demo import write_tiny_gguf
from tests.sandbox_support import sandbox_python_or_skip
from tests.server import REPO, Server, running, short_tempdir

pytestmark = pytest.mark.timeout(300)
ADMIN = "gva_0123abcd_" + "E" * 43
CSV = b"city,people\nOslo,709000\nBergen,291000\n"
MIB = 1 << 20
TRIES = 12


def _add_key(state: Path, name: str) -> str:
    out = subprocess.run([sys.executable, "-m", "supervisor", "keys", "add", name, "--state-dir", str(state)],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    return out.stdout.strip()


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[Server, str, str]]:
    python = sandbox_python_or_skip()
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=8192)
    state = short_tempdir("gv")
    alice, bob = _add_key(state, "alice"), _add_key(state, "bob")
    # A container takes in at most code_interpreter_file_mib (1 MiB here); it idles at most 10 minutes.
    env = {"GPUVISOR_N_CTX": "8192", "GPUVISOR_CODE_INTERPRETER": "true", "GPUVISOR_ADMIN_TOKEN": ADMIN,
           "GPUVISOR_CODE_INTERPRETER_PYTHON": python, "GPUVISOR_HOSTED_MAX_ITERATIONS": "1",
           "GPUVISOR_CODE_INTERPRETER_FILE_MIB": "1", "GPUVISOR_CODE_INTERPRETER_IDLE_S": "600",
           "GPUVISOR_CODE_INTERPRETER_MAX_CONTAINERS": "1000"}
    with running(Server(models, state_dir=state, env=env, model="tiny")) as srv:
        yield srv, alice, bob


def _sdk(srv: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _error(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]  # type: ignore[no-any-return]


def test_a_container_is_made_listed_used_by_the_tool_and_deleted(setup: tuple[Server, str, str]) -> None:
    srv, alice_key, bob_key = setup
    alice, bob = _sdk(srv, alice_key), _sdk(srv, bob_key)
    given = alice.files.create(file=("cities.csv", CSV), purpose="user_data")
    raw = alice.with_raw_response.containers.create(
        name="analysis", file_ids=[given.id], expires_after={"anchor": "last_active_at", "minutes": 5},
        memory_limit="1g")
    made = ContainerCreateResponse.model_validate(raw.http_response.json(), strict=True)
    assert (made.name, made.object, made.status, made.memory_limit) == ("analysis", "container", "running", "1g")
    assert made.expires_after is not None and made.expires_after.minutes == 5
    assert made.last_active_at is not None and made.last_active_at >= made.created_at
    assert (srv.state_dir / "containers" / made.id / "cities.csv").read_bytes() == CSV
    got = alice.with_raw_response.containers.retrieve(made.id)
    assert ContainerRetrieveResponse.model_validate(got.http_response.json(), strict=True).name == "analysis"
    # Its files: the copy, then an upload (multipart) and a copy by file_id.
    [copied] = alice.containers.files.list(made.id).data
    assert (copied.path, copied.source, copied.bytes) == ("/tmp/work/cities.csv", "user", len(CSV))
    up = alice.containers.files.with_raw_response.create(made.id, file=("notes.txt", b"three words here"))
    uploaded = FileCreateResponse.model_validate(up.http_response.json(), strict=True)
    assert (uploaded.path, uploaded.bytes, uploaded.source, uploaded.container_id) == (
        "/tmp/work/notes.txt", 16, "user", made.id)
    other = alice.files.create(file=("other.json", b'{"a": 1}'), purpose="user_data")
    by_id = alice.containers.files.create(made.id, file_id=other.id)
    assert (by_id.path, by_id.bytes) == ("/tmp/work/other.json", 8)
    listed = httpx.get(f"{srv.base_url}/v1/containers/{made.id}/files", params={"order": "asc"},
                       headers=_h(alice_key), timeout=30).json()["data"]
    assert {FileListResponse.model_validate(f, strict=True).path for f in listed} == {
        "/tmp/work/cities.csv", "/tmp/work/notes.txt", "/tmp/work/other.json"}
    assert alice.containers.files.content.retrieve(uploaded.id, container_id=made.id).read() == b"three words here"
    # The code_interpreter tool that names it runs there, with its files.
    tool = {"type": "code_interpreter", "container": made.id}
    body = {"model": "tiny", "input": "compute", "tools": [tool], "tool_choice": "required",
            "max_output_tokens": 1500}
    calls: list[dict[str, Any]] = []
    for _ in range(TRIES):
        reply = httpx.post(f"{srv.base_url}/v1/responses", json=body, headers=_h(alice_key), timeout=180)
        assert reply.status_code == 200, reply.text
        calls = [it for it in reply.json()["output"] if it["type"] == "code_interpreter_call" and it["container_id"]]
        if calls:
            break
    assert calls and {c["container_id"] for c in calls} == {made.id}
    assert (srv.state_dir / "containers" / made.id / "notes.txt").exists()
    # Another key sees none of it, and may not name it in a tool.
    for call in (lambda: bob.containers.retrieve(made.id), lambda: bob.containers.delete(made.id),
                 lambda: bob.containers.files.list(made.id),
                 lambda: bob.containers.files.create(made.id, file=("x.txt", b"x")),
                 lambda: bob.containers.files.delete(uploaded.id, container_id=made.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert made.id not in {c.id for c in bob.containers.list()}
    refused = httpx.post(f"{srv.base_url}/v1/responses", json=body, headers=_h(bob_key), timeout=60)
    assert _error(refused, 400)["param"] == "tools[0].container"
    # A file is deleted; then the container, its folder with it.
    alice.containers.files.delete(uploaded.id, container_id=made.id)
    assert not (srv.state_dir / "containers" / made.id / "notes.txt").exists()
    with pytest.raises(openai.NotFoundError):
        alice.containers.files.retrieve(uploaded.id, container_id=made.id)
    gone = httpx.delete(f"{srv.base_url}/v1/containers/{made.id}", headers=_h(alice_key), timeout=30)
    assert gone.json() == {"id": made.id, "object": "container.deleted", "deleted": True}
    assert not (srv.state_dir / "containers" / made.id).exists()
    with pytest.raises(openai.NotFoundError):
        alice.containers.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        alice.containers.delete(made.id)


def test_containers_are_listed_in_pages_by_key_and_name(setup: tuple[Server, str, str]) -> None:
    srv, alice_key, bob_key = setup
    alice, bob, admin = _sdk(srv, alice_key), _sdk(srv, bob_key), _sdk(srv, ADMIN)
    mine = [alice.containers.create(name=f"page-{i}").id for i in range(3)]
    theirs = bob.containers.create(name="page-0").id
    raw = httpx.get(f"{srv.base_url}/v1/containers", params={"limit": 2, "order": "asc", "name": "page-0"},
                    headers=_h(alice_key), timeout=30).json()
    assert [ContainerListResponse.model_validate(c, strict=True).id for c in raw["data"]] == [mine[0]]
    first = alice.containers.list(limit=2, order="desc")
    assert [c.id for c in first.data] == [mine[2], mine[1]] and first.has_more
    # The SDK follows the pages itself.
    assert [c.id for c in alice.containers.list(limit=2, order="asc") if c.name.startswith("page-")] == mine
    assert theirs not in {c.id for c in alice.containers.list(limit=100)}
    assert {*mine, theirs} <= {c.id for c in admin.containers.list(limit=100)}
    base = f"{srv.base_url}/v1/containers"
    for query, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                         ({"after": theirs}, "after"), ({"name": "n" * 300}, "name")):
        assert _error(httpx.get(base, params=query, headers=_h(alice_key), timeout=30), 400)["param"] == param


def test_hostile_fields_are_refused_naming_them(setup: tuple[Server, str, str]) -> None:
    srv, alice_key, bob_key = setup
    alice, bob = _sdk(srv, alice_key), _sdk(srv, bob_key)
    before = {c.id for c in alice.containers.list(limit=100)}
    secret = bob.files.create(file=("secret.txt", b"bob's"), purpose="user_data")
    one = alice.files.create(file=("same.txt", b"1"), purpose="user_data")
    two = alice.files.create(file=("same.txt", b"2"), purpose="user_data")
    big = alice.files.create(file=("big.bin", b"x" * (MIB + 1)), purpose="user_data")
    base = f"{srv.base_url}/v1/containers"
    cases: list[tuple[Any, int, str | None]] = [
        ({}, 400, "name"), ({"name": 5}, 400, "name"), ({"name": "n" * 257}, 400, "name"),
        ({"name": "x", "file_ids": ["file_nope"]}, 400, "file_ids[0]"),
        ({"name": "x", "file_ids": [secret.id]}, 400, "file_ids[0]"),  # another key's file: none of hers
        ({"name": "x", "file_ids": [one.id, two.id]}, 400, "file_ids[1]"),
        ({"name": "x", "file_ids": [one.id] * 33}, 400, "file_ids"),
        ({"name": "x", "file_ids": [big.id]}, 413, "file_ids"),
        ({"name": "x", "expires_after": {"anchor": "created_at", "minutes": 5}}, 400, "expires_after.anchor"),
        ({"name": "x", "expires_after": {"anchor": "last_active_at", "minutes": 0}}, 400, "expires_after.minutes"),
        ({"name": "x", "expires_after": {"anchor": "last_active_at", "minutes": 11}}, 400, "expires_after.minutes"),
        ({"name": "x", "memory_limit": "2g"}, 400, "memory_limit"),
        ({"name": "x", "network_policy": {"type": "allowlist", "allowed_domains": ["pypi.org"]}}, 400,
         "network_policy.type"),
        ({"name": "x", "skills": [{"type": "skill_reference", "skill_id": "s"}]}, 400, "skills"),
        ([1], 400, None),
    ]
    for body, status, param in cases:
        error = _error(httpx.post(base, json=body, headers=_h(alice_key), timeout=30), status)
        assert error["param"] == param, (body, error)
    assert {c.id for c in alice.containers.list(limit=100)} == before  # none made by a refusal
    # Files put in: bad ids, a name taken, past the container's bytes, no file part.
    cid = alice.containers.create(name="files").id
    files = f"{base}/{cid}/files"
    alice.containers.files.create(cid, file=("a.txt", b"a"))
    assert _error(httpx.post(files, files={"file": ("a.txt", b"again")}, headers=_h(alice_key), timeout=30),
                  409)["param"] == "file"
    assert alice.containers.files.create(cid, file_id=one.id).path == "/tmp/work/same.txt"
    assert _error(httpx.post(files, json={"file_id": two.id}, headers=_h(alice_key), timeout=30), 409)["param"] \
        == "file_id"
    for body, status, param in (({"file_id": secret.id}, 400, "file_id"), ({"file_id": "nope"}, 400, "file_id"),
                                ({"file_id": big.id}, 413, "file_id"), ({"file": "x"}, 400, None)):
        assert _error(httpx.post(files, json=body, headers=_h(alice_key), timeout=30), status)["param"] == param
    plain = httpx.post(files, content=f'{{"file_id": "{one.id}"}}'.encode(),
                       headers={**_h(alice_key), "Content-Type": "text/plain"}, timeout=30)
    assert _error(plain, 415)["code"] == "unsupported_media_type"
    over = httpx.post(files, files={"file": ("huge.bin", b"x" * MIB)}, headers=_h(alice_key), timeout=30)
    assert _error(over, 413)["param"] == "file"
    assert not (srv.state_dir / "containers" / cid / "huge.bin").exists()
    assert not list((srv.state_dir / "containers").glob("upload_*"))  # the refused upload's spool is gone
    for parts, param in (({"purpose": (None, "x")}, "file"), ({"file": ("..", b"x")}, "file"),
                         ({"file": ("é" * 128 + ".txt", b"x")}, "file")):
        assert _error(httpx.post(files, files=parts, headers=_h(alice_key), timeout=30), 400)["param"] == param
    assert _error(httpx.delete(f"{files}/cfile_nope", headers=_h(alice_key), timeout=30), 400)["param"] == "file_id"
    assert _error(httpx.delete(f"{files}/cfile_{'0' * 32}", headers=_h(alice_key), timeout=30),
                  404)["param"] == "file_id"
    for path in ("cntr_x", f"cntr_{'0' * 32}"):
        status = 400 if path == "cntr_x" else 404
        assert _error(httpx.get(f"{base}/{path}", headers=_h(alice_key), timeout=30), status)["param"] \
            == "container_id"


def test_a_full_pool_makes_room_by_removing_the_least_recently_used_container() -> None:
    python = sandbox_python_or_skip()
    env = {"GPUVISOR_CODE_INTERPRETER": "true", "GPUVISOR_ADMIN_TOKEN": ADMIN,
           "GPUVISOR_CODE_INTERPRETER_PYTHON": python, "GPUVISOR_CODE_INTERPRETER_MAX_CONTAINERS": "3"}
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf")
    state = short_tempdir("gv")
    alice_key, bob_key = _add_key(state, "alice"), _add_key(state, "bob")
    with running(Server(models, state_dir=state, env=env, model="tiny")) as small:
        alice, bob = _sdk(small, alice_key), _sdk(small, bob_key)
        first = alice.containers.create(name="first")
        second = bob.containers.create(name="second")
        extra = bob.containers.create(name="extra")
        alice.containers.retrieve(first.id)  # used since: bob's second is now the least recently used
        third = alice.containers.create(name="third")
        with pytest.raises(openai.NotFoundError):
            bob.containers.retrieve(second.id)
        assert not (state / "containers" / second.id).exists()
        assert [c.id for c in _sdk(small, ADMIN).containers.list(order="asc")] == [first.id, extra.id, third.id]
        assert [c.id for c in alice.containers.files.list(first.id)] == []  # still there, still hers
