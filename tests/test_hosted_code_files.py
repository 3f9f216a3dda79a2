"""code_interpreter's files end to end: a real gpuvisor server with two API
keys, files uploaded through /v1/files, and a tiny model forced to call the
tool. The files a request names are copied into its container before the
code runs, and ``/v1/containers/{id}/files`` lists them (and what was
written there since) and serves their bytes, to the key that made the
container only. Bad file_ids are 400s naming the field, before anything
runs (background requests too)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.containers import FileListResponse, FileRetrieveResponse

from supervisor.models.demo import write_tiny_gguf
from tests.sandbox_support import sandbox_python_or_skip
from tests.server import REPO, Server, running, short_tempdir

pytestmark = pytest.mark.timeout(300)
ADMIN = "gva_0123abcd_" + "C" * 43
HEAD = {"model": "tiny", "max_output_tokens": 1500, "parallel_tool_calls": False}
TRIES = 12
CSV = b"city,people\nOslo,709000\nBergen,291000\n"


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
    env = {"GPUVISOR_N_CTX": "8192", "GPUVISOR_CODE_INTERPRETER": "true", "GPUVISOR_ADMIN_TOKEN": ADMIN,
           "GPUVISOR_CODE_INTERPRETER_PYTHON": python, "GPUVISOR_HOSTED_MAX_ITERATIONS": "1",
           "GPUVISOR_CODE_INTERPRETER_MAX_CONTAINERS": "1000"}
    with running(Server(models, state_dir=state, env=env, model="tiny")) as srv:
        yield srv, alice, bob


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _create(srv: Server, key: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/v1/responses", json={**HEAD, **body}, headers=_h(key), timeout=180)


def _tool(*file_ids: str) -> dict[str, Any]:
    return {"type": "code_interpreter", "container": {"type": "auto", "file_ids": list(file_ids)}}


def _ran(srv: Server, key: str, tool: dict[str, Any]) -> dict[str, Any]:
    """The first call that ran of a response forced to call the tool (the
    random model's code string is not always closed within the tokens)."""
    for _ in range(TRIES):
        reply = _create(srv, key, input="compute", tools=[tool], tool_choice="required")
        assert reply.status_code == 200, reply.text
        for item in reply.json()["output"]:
            if item["type"] == "code_interpreter_call" and item["status"] == "completed":
                return item  # type: ignore[no-any-return]
    raise AssertionError(f"no forced call ran in {TRIES} tries")


def _files(srv: Server, key: str, cid: str, **query: Any) -> httpx.Response:
    return httpx.get(f"{srv.base_url}/v1/containers/{cid}/files", params=query, headers=_h(key), timeout=30)


def _error(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]  # type: ignore[no-any-return]


def test_files_named_are_in_the_container_and_served_to_their_key_only(setup: tuple[Server, str, str]) -> None:
    srv, alice, bob = setup
    sdk = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=alice, max_retries=0, timeout=60)
    given = sdk.files.create(file=("cities.csv", CSV), purpose="user_data")
    call = _ran(srv, alice, _tool(given.id))
    cid = call["container_id"]
    folder = srv.state_dir / "containers" / cid
    assert (folder / "cities.csv").read_bytes() == CSV  # there before the code ran
    # What the code could have written, and what it could have planted.
    (folder / "out").mkdir(exist_ok=True)
    (folder / "out" / "total.txt").write_text("1000000")
    os.symlink(srv.state_dir / "gpuvisor.db", folder / "db-link")
    os.mkfifo(folder / "pipe")
    listed = _files(srv, alice, cid, order="asc", limit=100)
    assert listed.status_code == 200, listed.text
    page = listed.json()
    files = [FileListResponse.model_validate(f, strict=True) for f in page["data"]]
    by_path = {f.path: f for f in files}
    assert {"/tmp/work/cities.csv", "/tmp/work/out/total.txt"} <= set(by_path)
    assert not [p for p in by_path if p.endswith(("db-link", "pipe"))]
    given_file = by_path["/tmp/work/cities.csv"]
    assert (given_file.source, given_file.bytes, given_file.container_id) == ("user", len(CSV), cid)
    assert by_path["/tmp/work/out/total.txt"].source == "assistant"
    assert page["has_more"] is False and page["first_id"] == files[0].id
    # The SDK's own calls: list, retrieve and content.
    assert given_file.id in {f.id for f in sdk.containers.files.list(cid)}
    got = sdk.containers.files.retrieve(given_file.id, container_id=cid)
    assert FileRetrieveResponse.model_validate(got.model_dump(), strict=True).path == "/tmp/work/cities.csv"
    assert sdk.containers.files.content.retrieve(given_file.id, container_id=cid).read() == CSV
    written = by_path["/tmp/work/out/total.txt"].id
    assert sdk.containers.files.content.retrieve(written, container_id=cid).read() == b"1000000"
    # Pages follow `after`.
    first = _files(srv, alice, cid, order="asc", limit=1).json()
    second = _files(srv, alice, cid, order="asc", limit=1, after=first["last_id"]).json()
    assert first["has_more"] is True and second["data"][0]["id"] == files[1].id
    # Bob sees none of it: the container, its files, alice's file for his own container.
    base = f"{srv.base_url}/v1/containers/{cid}/files"
    for url in (base, f"{base}/{given_file.id}", f"{base}/{given_file.id}/content"):
        assert _error(httpx.get(url, headers=_h(bob), timeout=30), 404)["param"] == "container_id"
    refused = _error(_create(srv, bob, input="x", tools=[_tool(given.id)]), 400)
    assert refused["param"] == "tools[0].container.file_ids[0]" and given.id in refused["message"]
    # The admin sees every key's container.
    assert httpx.get(f"{base}/{given_file.id}/content", headers=_h(ADMIN), timeout=30).content == CSV
    # Ids of no file, and ids of no shape.
    assert _error(httpx.get(f"{base}/cfile_{'0' * 32}", headers=_h(alice), timeout=30), 404)["param"] == "file_id"
    for bad, param in ((f"{base}/cfile_nope", "file_id"), (f"{base}/{given_file.id}x/content", "file_id"),
                       (f"{srv.base_url}/v1/containers/cntr_x/files", "container_id"),
                       (f"{base}?limit=0", "limit"), (f"{base}?order=up", "order"), (f"{base}?after=zz", "after")):
        assert _error(httpx.get(bad, headers=_h(alice), timeout=30), 400)["param"] == param, bad
    missing = f"{srv.base_url}/v1/containers/cntr_{'0' * 32}/files"
    assert _error(httpx.get(missing, headers=_h(alice), timeout=30), 404)["param"] == "container_id"


def test_bad_file_ids_are_refused_before_anything_runs(setup: tuple[Server, str, str]) -> None:
    srv, alice, _ = setup
    sdk = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=alice, max_retries=0, timeout=60)
    one = sdk.files.create(file=("same.txt", b"1"), purpose="user_data")
    two = sdk.files.create(file=("same.txt", b"2"), purpose="user_data")
    cases = [
        (_tool("file-" + "0" * 24), "tools[0].container.file_ids[0]"),  # no such file
        (_tool(one.id, "file_nope"), "tools[0].container.file_ids[1]"),  # not an id
        (_tool(one.id, two.id), "tools[0].container.file_ids[1]"),  # two of one name
        (_tool(one.id, one.id, "file-" + "0" * 24), "tools[0].container.file_ids[2]"),  # its own index
        (_tool(*[one.id] * 33), "tools[0].container.file_ids"),  # past the bound
        ({"type": "code_interpreter", "container": {"type": "auto", "file_ids": [one.id], "network_policy": {
            "type": "allowlist", "allowed_domains": ["pypi.org"]}}}, "tools[0].container.network_policy"),
    ]
    for tool, param in cases:
        for background in (False, True):
            reply = _create(srv, alice, input="x", tools=[tool], background=background)
            assert _error(reply, 400)["param"] == param, (param, reply.text)
    # The same file named twice is one file.
    assert _create(srv, alice, input="x", tools=[_tool(one.id, one.id)], max_output_tokens=4).status_code == 200
