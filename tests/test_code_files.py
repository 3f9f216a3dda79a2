"""The code_interpreter's files with real sandbox runs, code written here
instead of by a model: files copied in are opened by name, files the code
writes are listed back (OpenAI's container file shape) and cited in the
answer (``container_file_citation``, validated strictly as the SDK types
it), and nothing the code plants (a link, a FIFO, a taken name) is read
or written through."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from openai.types.containers import FileListResponse
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from supervisor.generation.pieces import Text, ToolCall
from supervisor.generation.tools import CodeInterpreterAuto, CodeInterpreterTool
from supervisor.responses.events import EventBuilder
from supervisor.responses.hosted.code_interpreter import Containers, open_code
from supervisor.responses.hosted.loop import ToolLoop
from supervisor.responses.hosted.session import HostedSession
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.items import CodeInterpreterCallItem, CodeLogs
from supervisor.responses.models import CreateRequest
from supervisor.responses.objects import Usage, new_response
from supervisor.sandbox.containers import (
    MAX_SCANNED_ENTRIES,
    ContainerError,
    ContainerPool,
)
from supervisor.sandbox.files import copy_in, file_id, find, listing
from supervisor.sandbox.runner import SandboxSpec
from tests.sandbox_support import FAST, sandbox_python_or_skip

pytestmark = pytest.mark.timeout(90)
AUTO = [CodeInterpreterTool(container=CodeInterpreterAuto())]
EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="session")
def sandbox_python() -> str:
    return sandbox_python_or_skip()


@pytest.fixture
def pool(tmp_path: Path, sandbox_python: str) -> Iterator[ContainerPool]:
    p = ContainerPool(tmp_path / "containers", SandboxSpec(python=sandbox_python, limits=replace(FAST, wall_s=10.0)))
    yield p
    p.close()


@pytest.fixture
def uploads(tmp_path: Path) -> list[tuple[str, Path]]:
    """Two uploaded files, as /v1/files keeps them (bytes under an id)."""
    store = tmp_path / "files"
    store.mkdir()
    (store / "file-1").write_text("city,people\nOslo,709000\nBergen,291000\n")
    (store / "file-2").write_bytes(bytes(range(256)))
    return [("cities.csv", store / "file-1"), ("blob.bin", store / "file-2")]


def _loop(pool: ContainerPool, inputs: list[tuple[str, Path]] | None = None) -> ToolLoop:
    code = open_code(AUTO, [], Containers(pool), None)
    assert code is not None
    code.inputs = inputs or []
    return ToolLoop(HostedSession(HostedSettings(), code=code))


async def _run(loop: ToolLoop, code: str) -> CodeInterpreterCallItem:
    item = loop.session.call_item(ToolCall("code_interpreter", json.dumps({"code": code})))
    assert isinstance(item, CodeInterpreterCallItem)
    assert loop.session.take_pending() == [item]  # run here, as the loop runs what a generation called
    await loop._result(item)
    return item


def _logs(item: CodeInterpreterCallItem) -> str:
    assert item.outputs is not None and isinstance(item.outputs[0], CodeLogs)
    return item.outputs[0].logs


async def test_files_given_are_opened_by_name_and_files_written_are_listed(
        pool: ContainerPool, uploads: list[tuple[str, Path]]) -> None:
    loop = _loop(pool, uploads)
    assert loop.session.code is not None and "cities.csv, blob.bin" in (loop.session.code.function().description or "")
    item = await _run(loop, "import csv\nrows = list(csv.DictReader(open('cities.csv')))\n"
                            "print(sum(int(r['people']) for r in rows), len(open('blob.bin', 'rb').read()))\n"
                            "import os\nos.makedirs('out', exist_ok=True)\n"
                            "open('out/total.txt', 'w').write('1000000')\n")
    assert item.status == "completed" and _logs(item).startswith("1000000 256\n"), _logs(item)
    container = pool.get(item.container_id)
    files, truncated = listing(container)
    assert not truncated
    shown = {f.name: f for f in files}
    assert set(shown) == {"cities.csv", "blob.bin", "out/total.txt"}
    assert (shown["cities.csv"].source, shown["out/total.txt"].source) == ("user", "assistant")
    for info in files:
        checked = FileListResponse.model_validate(info.to_object(), strict=True)
        assert checked.container_id == container.id and checked.path == f"/tmp/work/{info.name}"
        assert checked.id == file_id(container.id, info.name) == find(container, checked.id).id
    assert shown["out/total.txt"].bytes == 7
    assert container.read("out/total.txt", 100) == b"1000000"
    # Copied once per container: the code's change to a given file is kept on the next call.
    await _run(loop, "open('cities.csv', 'w').write('changed')")
    again = await _run(loop, "print(open('cities.csv').read())")
    assert _logs(again).startswith("changed\n")


def _answer(loop: ToolLoop, text: str) -> dict[str, Any]:
    builder = EventBuilder(new_response(CreateRequest(model="m"), 0.0, "in_progress"))
    builder.hosted = loop.session
    events = [*builder.start(), *builder.pieces([Text(text)]), *builder.completed(Usage.of(1, 1, 0, 0),
                                                                                  truncated=False)]
    decoded = [json.loads(e.data) for e in events]
    for event in decoded:
        EVENT.validate_python(event, strict=True)
    Response.model_validate(decoded[-1]["response"], strict=True)
    response: dict[str, Any] = decoded[-1]["response"]
    return response


async def test_an_answer_naming_a_written_file_cites_it(pool: ContainerPool,
                                                        uploads: list[tuple[str, Path]]) -> None:
    loop = _loop(pool, uploads)
    item = await _run(loop, "open('plot.png', 'wb').write(b'png')\nopen('report.csv', 'w').write('a,b')\n")
    text = "See [the chart](sandbox:/tmp/work/plot.png), report.csv, and cities.csv (yours)."
    annotations = _answer(loop, text)["output"][0]["content"][0]["annotations"]
    spans = [text[a["start_index"]:a["end_index"]] for a in annotations]
    # Only files the code wrote: cities.csv was given, not written.
    assert spans == ["sandbox:/tmp/work/plot.png", "report.csv"]
    assert [a["type"] for a in annotations] == ["container_file_citation"] * 2
    assert {a["container_id"] for a in annotations} == {item.container_id}
    container = pool.get(item.container_id)
    assert [find(container, a["file_id"]).name for a in annotations] == ["plot.png", "report.csv"]
    assert annotations[0]["filename"] == "plot.png"
    assert _answer(loop, "Nothing written is named here.")["output"][0]["content"][0]["annotations"] == []


async def test_a_later_response_cites_what_earlier_calls_wrote(pool: ContainerPool,
                                                               uploads: list[tuple[str, Path]]) -> None:
    first = _loop(pool, uploads)
    item = await _run(first, "open('report.csv', 'w').write('a,b')\n")
    # The next turn of the conversation runs no code, and answers naming the file.
    later = open_code(AUTO, [item], Containers(pool), None)
    assert later is not None
    await later.recall_written()
    text = "The totals are in report.csv; cities.csv was yours."
    annotations = _answer(ToolLoop(HostedSession(HostedSettings(), code=later)), text)[
        "output"][0]["content"][0]["annotations"]
    assert [(text[a["start_index"]:a["end_index"]], a["container_id"]) for a in annotations] == [
        ("report.csv", item.container_id)]
    # Another key's conversation holding the same call cites nothing of that container.
    stranger = open_code(AUTO, [item], Containers(pool), "key-b")
    assert stranger is not None
    await stranger.recall_written()
    assert stranger.written == {}


async def test_links_fifos_and_taken_names_are_never_followed(pool: ContainerPool, tmp_path: Path,
                                                              uploads: list[tuple[str, Path]]) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the service's own file")
    loop = _loop(pool)
    # An earlier turn's code planted these: a link under a given file's name, a link out, a FIFO.
    item = await _run(loop, f"import os\nos.symlink({str(secret)!r}, 'cities.csv')\n"
                            f"os.symlink({str(secret)!r}, 'leak.txt')\nos.symlink('/', 'root')\n"
                            "os.mkfifo('pipe')\nos.mkdir('blob.bin')\nopen('kept.txt', 'w').write('k')\n")
    assert item.status == "completed", _logs(item)
    container = pool.get(item.container_id)
    assert copy_in(container, uploads, None) == []  # both names are taken: nothing written through
    assert secret.read_text() == "the service's own file"
    assert [f.name for f in listing(container)[0]] == ["kept.txt"]
    for name in ("leak.txt", "cities.csv", "pipe", "root/etc/passwd", "../x", "blob.bin"):
        with pytest.raises(ContainerError):
            container.open(name, 1 << 20)
    with pytest.raises(ContainerError):
        find(container, file_id(container.id, "leak.txt"))
    # A file over the bound is refused, not read.
    os.truncate(container.path / "kept.txt", 2 << 20)
    with pytest.raises(ContainerError):
        container.open("kept.txt", 1 << 20)


def test_a_listing_stops_at_its_bound(tmp_path: Path) -> None:
    pool = ContainerPool(tmp_path / "containers", SandboxSpec(limits=FAST))
    try:
        container = pool.create()
        for k in range(MAX_SCANNED_ENTRIES + 50):
            (container.path / f"f{k:05d}").write_bytes(b"")
        files, truncated = listing(container)
        assert truncated and len(files) == MAX_SCANNED_ENTRIES
        assert len({f.id for f in files}) == len(files)
    finally:
        pool.close()


def test_a_copy_that_fails_leaves_no_part_behind(tmp_path: Path) -> None:
    pool = ContainerPool(tmp_path / "containers", SandboxSpec(limits=FAST))
    try:
        container = pool.create()
        unreadable = tmp_path / "a-folder"  # opening it to read fails after the copy was created
        unreadable.mkdir()
        with pytest.raises(OSError):
            copy_in(container, [("x.txt", unreadable)], None)
        assert not (container.path / "x.txt").exists() and container.copied_in == set()
    finally:
        pool.close()
