"""The code_interpreter tool's runs as the tool loop makes them, with real
sandbox processes (supervisor/sandbox/) and code written here instead of by
a model: what the item records, where it runs, and how limits end a run."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from openai.types.responses import ResponseCodeInterpreterToolCall

from supervisor.errors import BadRequest
from supervisor.generation.pieces import ToolCall
from supervisor.generation.tools import CodeInterpreterAuto, CodeInterpreterTool
from supervisor.responses.convert import to_messages
from supervisor.responses.hosted.code_interpreter import Containers, open_code
from supervisor.responses.hosted.loop import ToolLoop
from supervisor.responses.hosted.session import HostedSession
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.items import CodeInterpreterCallItem, encode_item
from supervisor.sandbox.containers import ContainerPool
from supervisor.sandbox.runner import INIT_SCRIPT, SandboxSpec
from tests.sandbox_support import FAST, sandbox_python_or_skip

pytestmark = pytest.mark.timeout(90)
AUTO = [CodeInterpreterTool(container=CodeInterpreterAuto())]


@pytest.fixture(scope="session")
def sandbox_python() -> str:
    return sandbox_python_or_skip()


@pytest.fixture
def pool(tmp_path: Path, sandbox_python: str) -> Iterator[ContainerPool]:
    p = ContainerPool(tmp_path / "containers", SandboxSpec(python=sandbox_python, limits=replace(FAST, wall_s=3.0)))
    yield p
    p.close()


def _loop(pool: ContainerPool, owner: str | None = None, tools: list[CodeInterpreterTool] | None = None,
          **settings: float) -> ToolLoop:
    code = open_code(tools or AUTO, [], Containers(pool), owner)
    assert code is not None
    return ToolLoop(HostedSession(HostedSettings(**settings), code=code))  # type: ignore[arg-type]


def _call(loop: ToolLoop, code: str) -> CodeInterpreterCallItem:
    item = loop.session.call_item(ToolCall("code_interpreter", json.dumps({"code": code})))
    assert isinstance(item, CodeInterpreterCallItem)
    return item


def _checked(item: CodeInterpreterCallItem) -> ResponseCodeInterpreterToolCall:
    return ResponseCodeInterpreterToolCall.model_validate_json(encode_item(item), strict=True)


def _logs(item: CodeInterpreterCallItem) -> str:
    checked = _checked(item)
    assert checked.outputs is not None and checked.outputs[0].type == "logs"
    return checked.outputs[0].logs


def _sandboxes(container_id: str) -> list[int]:
    """Sandbox processes still running for this container (its path is in their argv)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(INIT_SCRIPT) in cmdline and container_id in cmdline:
            found.append(proc.pid)
    return found


async def test_calls_share_their_container_and_files(pool: ContainerPool) -> None:
    loop = _loop(pool)
    first = _call(loop, "open('n.txt', 'w').write('41')\nprint('wrote')")
    second = _call(loop, "print(int(open('n.txt').read()) + 1)")
    for item in (first, second):
        await loop._result(item)
    assert first.container_id == second.container_id and first.container_id.startswith("cntr_")
    assert (first.status, second.status) == ("completed", "completed")
    assert _logs(first).startswith("wrote\n") and "n.txt (2 bytes)" in _logs(first)
    assert _logs(second) == "42\n"
    # What the model reads back on the next generation: its code, then the logs.
    messages = to_messages([], [first, second], None)
    assert [m.role for m in messages] == ["assistant", "tool", "assistant", "tool"]
    call = (messages[2].tool_calls or [])[0]["function"]
    assert call["name"] == "code_interpreter" and json.loads(call["arguments"]) == {"code": second.code}
    assert messages[3].content == "42\n"


async def test_auto_reuses_the_container_of_an_earlier_call(pool: ContainerPool) -> None:
    first = _loop(pool, owner="key-a")
    made = _call(first, "open('kept', 'w').write('x')")
    await first._result(made)
    # A later response of the conversation (its items hold the call) runs there too.
    later = open_code(AUTO, [made], Containers(pool), "key-a")
    assert later is not None
    again = later.item(ToolCall("code_interpreter", json.dumps({"code": "print(open('kept').read())"})))
    await later.run(again, 30.0)
    assert again.container_id == made.container_id and _logs(again) == "x\n"
    # Another key's conversation holding that id gets a container of its own.
    other = open_code(AUTO, [made], Containers(pool), "key-b")
    assert other is not None
    theirs = other.item(ToolCall("code_interpreter", json.dumps({"code": "print(1)"})))
    assert theirs.container_id not in ("", made.container_id)


async def test_a_named_container_must_exist_and_be_the_callers(pool: ContainerPool) -> None:
    mine = pool.create("key-a")
    named = [CodeInterpreterTool(container=mine.id)]
    session = open_code(named, [], Containers(pool), "key-a")
    assert session is not None and session.item(ToolCall("code_interpreter", '{"code": "1"}')).container_id == mine.id
    for owner, cid in (("key-b", mine.id), ("key-a", "cntr_" + "0" * 32)):
        with pytest.raises(BadRequest) as refused:
            open_code([CodeInterpreterTool(container=cid)], [], Containers(pool), owner)
        assert refused.value.param == "tools[0].container"


async def test_the_wall_clock_ends_a_busy_loop(pool: ContainerPool) -> None:
    loop = _loop(pool)
    item = _call(loop, "print('start', flush=True)\nwhile True:\n    pass\n")
    started = time.monotonic()
    await loop._result(item)
    assert time.monotonic() - started < 20  # the 3 s wall clock, coarsely
    assert item.status == "incomplete"
    assert _logs(item).startswith("start\n") and "wall clock of 3 s" in _logs(item)
    assert _sandboxes(item.container_id) == []


async def test_the_call_limit_stops_a_run_and_kills_it(pool: ContainerPool) -> None:
    # The loop has less time left than the sandbox's own wall clock.
    loop = _loop(pool, call_timeout_s=0.5)
    item = _call(loop, "import time\ntime.sleep(60)\n")
    started = time.monotonic()
    await loop._result(item)
    assert time.monotonic() - started < 10
    assert item.status == "failed" and "longer than 0.5 s" in _logs(item)
    assert _sandboxes(item.container_id) == []
    # The container still runs code afterwards.
    after = _call(loop, "print('alive')")
    await loop._result(after)
    assert _logs(after) == "alive\n"


async def test_a_memory_bomb_is_the_codes_own_error(pool: ContainerPool) -> None:
    loop = _loop(pool)
    item = _call(loop, "x = bytearray(4 << 30)\nprint('never')\n")
    await loop._result(item)
    assert item.status == "completed"  # it ran to its end: with its own error
    assert "MemoryError" in _logs(item) and "never" not in _logs(item) and "[exit status 1]" in _logs(item)


async def test_memory_limit_lowers_the_limit_never_raises_it(pool: ContainerPool) -> None:
    # Address space only: bytes(n) is calloc, which maps pages it does not touch.
    probe = "x = bytes(1500 << 20)\nprint('fits')\n"
    roomy = ContainerPool(pool.root, replace(pool.spec, limits=replace(pool.spec.limits, memory_mib=2048)))
    try:
        plain, capped = (_loop(roomy, tools=[CodeInterpreterTool(container=CodeInterpreterAuto(memory_limit=m))])
                         for m in (None, "1g"))
        ran = [_call(plain, probe), _call(capped, probe)]
        await plain._result(ran[0])
        await capped._result(ran[1])
    finally:
        roomy.close()
    assert _logs(ran[0]) == "fits\n" and "MemoryError" in _logs(ran[1])
    # The pool's own 512 MiB stays the bound when a call asks for more.
    bounded = _loop(pool, tools=[CodeInterpreterTool(container=CodeInterpreterAuto(memory_limit="1g"))])
    item = _call(bounded, "x = bytes(700 << 20)\nprint('fits')\n")
    await bounded._result(item)
    assert "MemoryError" in _logs(item)


async def test_a_cancel_kills_the_run(pool: ContainerPool) -> None:
    loop = _loop(pool)
    item = _call(loop, "print('up', flush=True)\nimport time\ntime.sleep(60)\n")
    task = asyncio.create_task(loop._result(item))
    assert loop.session.code is not None and loop.session.code.container is not None
    container = loop.session.code.container
    # Cancelled once its sandbox runs: a cancel before the start has nothing to kill.
    while not (container.lock.locked() and _sandboxes(item.container_id)):
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _sandboxes(item.container_id) == []


async def test_arguments_without_code_fail_the_call(pool: ContainerPool) -> None:
    loop = _loop(pool)
    item = loop.session.call_item(ToolCall("code_interpreter", '{"source": "print(1)"}'))
    assert isinstance(item, CodeInterpreterCallItem)
    await loop._result(item)
    assert item.status == "failed" and "hold no code" in _logs(item)


async def test_a_full_pool_fails_the_call_not_the_response(pool: ContainerPool) -> None:
    full = ContainerPool(pool.root, pool.spec, max_containers=1)
    running = full.create()
    try:
        async with running.lock:  # running code: a full pool of those has no room
            loop = _loop(full)
            item = _call(loop, "print(1)")
            await loop._result(item)
        assert item.status == "failed" and "too many containers" in _logs(item)
        assert item.container_id == ""
    finally:
        full.close()


async def test_a_repeated_call_gets_the_earlier_result(pool: ContainerPool) -> None:
    loop = _loop(pool)
    first = _call(loop, "open('log', 'a').write('x')\nprint(len(open('log').read()))")
    again = _call(loop, "open('log', 'a').write('x')\nprint(len(open('log').read()))")
    await loop._result(first)
    await loop._result(again)
    # Ran once: the file holds one x.
    assert _logs(first) == _logs(again) and _logs(first).startswith("1\n")
    checked = _call(loop, "print(len(open('log').read()))")
    await loop._result(checked)
    assert _logs(checked) == "1\n"
