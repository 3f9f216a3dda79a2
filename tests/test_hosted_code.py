"""The code_interpreter tool end to end: a real gpuvisor server with a tiny
model whose first generation is forced to call the tool. The server runs the
code the model wrote in its sandbox (supervisor/sandbox/), hands the logs
back and the model generates again. Items and events validate strictly as
the SDK's types.

The tiny model's weights are random: the code it writes is gibberish inside
a JSON string, so what a user checks is that exactly that code ran (its
logs are what Python says of it) and that the loop went on. A string the
model does not close within the token limit is a call cut short, never run:
about half the forced calls at 1,500 tokens (16 of 30 ran, measured), so a
request is tried up to TRIES times to get one that ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from openai.types.responses.response_code_interpreter_tool_call import (
    ResponseCodeInterpreterToolCall,
)
from pydantic import TypeAdapter

from supervisor.models.demo import write_tiny_gguf
from tests.sandbox_support import sandbox_python_or_skip
from tests.server import Server, running, short_tempdir

pytestmark = pytest.mark.timeout(240)
EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
ITEM: TypeAdapter[Any] = TypeAdapter(ResponseItem)
AUTO = {"type": "code_interpreter", "container": {"type": "auto"}}
# Room for the model to close its code string; the context for the code, its
# logs (which quote it) and the answer.
HEAD = {"model": "tiny", "max_output_tokens": 1500, "parallel_tool_calls": False}
N_CTX = "8192"
TRIES = 12


@pytest.fixture(scope="module")
def sandbox_python() -> str:
    return sandbox_python_or_skip()


def _server(python: str, **env: str) -> Server:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=int(N_CTX))
    # Every response here makes a container (16 by default, each kept for 20 idle minutes).
    base = {"GPUVISOR_N_CTX": N_CTX, "GPUVISOR_CODE_INTERPRETER": "true",
            "GPUVISOR_CODE_INTERPRETER_PYTHON": python, "GPUVISOR_HOSTED_MAX_ITERATIONS": "2",
            "GPUVISOR_CODE_INTERPRETER_MAX_CONTAINERS": "1000"}
    return Server(models, env={**base, **env}, model="tiny")


@pytest.fixture(scope="module")
def srv(sandbox_python: str) -> Iterator[Server]:
    with running(_server(sandbox_python)) as server:
        yield server


def _create(srv: Server, **body: Any) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/v1/responses", json={**HEAD, **body}, timeout=180)


def _ran(output: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first call whose code ran."""
    return next((o for o in output if o["type"] == "code_interpreter_call" and o["status"] == "completed"), None)


def _forced(srv: Server, **body: Any) -> dict[str, Any]:
    """A response whose forced call ran (see the module's docstring)."""
    for _ in range(TRIES):
        reply = _create(srv, **{"input": "compute", "tools": [AUTO], "tool_choice": "required", **body})
        assert reply.status_code == 200, reply.text
        made: dict[str, Any] = reply.json()
        if _ran(made["output"]) is not None:
            return made
    raise AssertionError(f"no forced call ran in {TRIES} tries")


def _python_says(python: str, code: str) -> str:
    """What Python itself prints for ``code`` read from stdin, as the sandbox runs it."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([python, "-I", "-"], check=False, input=code.encode(), capture_output=True, env=env,
                          cwd="/tmp", timeout=30)
    return (done.stdout + done.stderr).decode(errors="replace")


def _check_ran(call: dict[str, Any], python: str) -> str:
    """The call validates as the SDK's type and its logs are what its code does."""
    checked = ResponseCodeInterpreterToolCall.model_validate(call, strict=True)
    assert checked.container_id.startswith("cntr_") and checked.code
    assert checked.outputs is not None and checked.outputs[0].type == "logs"
    logs = checked.outputs[0].logs
    assert logs.startswith(_python_says(python, checked.code)), (checked.code, logs)
    return logs


def test_a_forced_call_runs_the_models_code_and_the_loop_goes_on(srv: Server, sandbox_python: str) -> None:
    body = _forced(srv)
    Response.model_validate(body, strict=True)
    call = _ran(body["output"])
    assert call is not None
    _check_ran(call, sandbox_python)
    assert body["status"] in ("completed", "incomplete")
    # The model generated again, with the code and its logs in the prompt (a
    # random model may answer with nothing at all): usage adds up both
    # generations, and the second prompt is the first one and more.
    cut = _create(srv, input="compute", tools=[AUTO], tool_choice="required", max_output_tokens=1, store=False)
    first_prompt = cut.json()["usage"]["input_tokens"]
    assert body["usage"]["input_tokens"] > 2 * first_prompt


def test_the_calls_are_stored_and_the_container_is_reused(srv: Server, sandbox_python: str) -> None:
    first = _forced(srv)
    call = _ran(first["output"])
    assert call is not None
    stored = httpx.get(f"{srv.base_url}/v1/responses/{first['id']}", timeout=30).json()
    Response.model_validate(stored, strict=True)
    assert _ran(stored["output"]) == call
    # A follow-up on previous_response_id: auto runs in the conversation's container.
    # (truncation: two rounds of gibberish code and logs may not leave room for a third.)
    follow = _forced(srv, previous_response_id=first["id"], input="again", truncation="auto")
    again = _ran(follow["output"])
    assert again is not None and again["container_id"] == call["container_id"]
    _check_ran(again, sandbox_python)
    # Sent back as input, the call is an input item as the SDK types it.
    stateless = _create(srv, input=[{"role": "user", "content": "compute"}, call], tools=[AUTO])
    assert stateless.status_code == 200, stateless.text
    items = httpx.get(f"{srv.base_url}/v1/responses/{stateless.json()['id']}/input_items?order=asc",
                      timeout=30).json()["data"]
    for item in items:
        ITEM.validate_python(item, strict=True)
    assert [i["type"] for i in items] == ["message", "code_interpreter_call"] and items[1]["outputs"] == call["outputs"]


def test_a_named_container_runs_the_calls(srv: Server, sandbox_python: str) -> None:
    made = _ran(_forced(srv)["output"])
    assert made is not None
    tool = {"type": "code_interpreter", "container": made["container_id"]}
    body = _forced(srv, tools=[tool], tool_choice={"type": "code_interpreter"})
    assert body["tool_choice"] == {"type": "code_interpreter"}
    call = _ran(body["output"])
    assert call is not None and call["container_id"] == made["container_id"]
    unknown = _create(srv, input="x", tools=[{"type": "code_interpreter", "container": "cntr_" + "0" * 32}])
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tools[0].container"


def _stream(srv: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{srv.base_url}/v1/responses", json={**HEAD, **body}, timeout=180) as reply:
        assert reply.status_code == 200
        return [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]


def _check_events(events: list[dict[str, Any]], python: str) -> bool:
    """Every event validates and each call's come in order; whether one ran."""
    for event in events:
        EVENT.validate_python(event, strict=True)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    ends = {e["item"]["id"]: e["item"] for e in events
            if e["type"] == "response.output_item.done" and e["item"]["type"] == "code_interpreter_call"}
    for item_id, item in ends.items():
        own = [e for e in events if e.get("item_id") == item_id or e.get("item", {}).get("id") == item_id]
        ran = (["response.code_interpreter_call.interpreting", "response.code_interpreter_call.completed"]
               if item["status"] == "completed" else [])
        assert [e["type"] for e in own] == [
            "response.output_item.added", "response.code_interpreter_call.in_progress",
            "response.code_interpreter_call_code.delta", "response.code_interpreter_call_code.done", *ran,
            "response.output_item.done"]
        assert own[0]["item"]["status"] == "in_progress" and own[3]["code"] == item["code"]
        if item["status"] == "completed":
            _check_ran(item, python)
    return any(item["status"] == "completed" for item in ends.values())


def test_streamed_events_come_in_order(srv: Server, sandbox_python: str) -> None:
    body = {"input": "compute", "tools": [AUTO], "tool_choice": "required", "stream": True}
    assert any(_check_events(_stream(srv, body), sandbox_python) for _ in range(TRIES))


def test_a_background_response_runs_the_code(srv: Server, sandbox_python: str) -> None:
    body = {"input": "compute", "tools": [AUTO], "tool_choice": "required", "background": True, "stream": True}
    for _ in range(TRIES):
        events = _stream(srv, body)
        response_id = events[0]["response"]["id"]
        if _check_events([e for e in events if e["type"] != "response.queued"], sandbox_python):
            break
    else:
        raise AssertionError(f"no forced call ran in {TRIES} tries")
    stored = httpx.get(f"{srv.base_url}/v1/responses/{response_id}", timeout=30).json()
    Response.model_validate(stored, strict=True)
    assert stored["background"] is True and _ran(stored["output"]) is not None
    # The stored events replay the same calls.
    with httpx.stream("GET", f"{srv.base_url}/v1/responses/{response_id}?stream=true", timeout=60) as reply:
        replay = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in replay] == [e["type"] for e in events]


def test_the_logs_reach_the_model(srv: Server) -> None:
    """A call's logs are in the next prompt: longer logs, a longer prompt."""
    def prompt_tokens(logs: str) -> int:
        call = {"type": "code_interpreter_call", "id": "ci_1", "code": "print(x)", "container_id": "cntr_x",
                "status": "completed", "outputs": [{"type": "logs", "logs": logs}]}
        reply = _create(srv, input=[{"role": "user", "content": "go"}, call], max_output_tokens=1, store=False)
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["input_tokens"])
    assert prompt_tokens("the" + " the" * 300) - prompt_tokens("the") >= 300


@pytest.mark.parametrize("tool,param,word", [
    ({"type": "code_interpreter", "container": {"type": "auto", "file_ids": ["file_1"]}},
     "tools[0].container.file_ids[0]", "not a valid id"),
    ({"type": "code_interpreter", "container": {"type": "auto", "network_policy": {
        "type": "allowlist", "allowed_domains": ["pypi.org"]}}}, "tools[0].container.network_policy", "network"),
    ({"type": "code_interpreter", "container": {"type": "auto", "memory_limit": "2g"}},
     "tools[0].container.memory_limit", "2g"),
    ({"type": "code_interpreter"}, "tools[0]", "container"),
])
def test_bad_tools_are_refused_naming_the_field(srv: Server, tool: dict[str, Any], param: str, word: str) -> None:
    reply = _create(srv, input="x", tools=[tool])
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and word in error["message"], error


def test_a_function_of_the_same_name_or_a_second_tool_is_refused(srv: Server) -> None:
    clash = _create(srv, input="x", tools=[AUTO, {"type": "function", "name": "code_interpreter"}])
    twice = _create(srv, input="x", tools=[AUTO, AUTO])
    assert (clash.status_code, twice.status_code) == (400, 400)
    assert (clash.json()["error"]["param"], twice.json()["error"]["param"]) == ("tools", "tools[1]")


def test_a_call_past_the_loops_limit_fails_and_the_model_still_answers(sandbox_python: str) -> None:
    # A call limit shorter than starting the sandbox: every run is stopped.
    with running(_server(sandbox_python, GPUVISOR_HOSTED_CALL_TIMEOUT_S="0.001")) as server:
        for _ in range(TRIES):
            started = time.monotonic()
            body = _create(server, input="compute", tools=[AUTO], tool_choice="required").json()
            assert time.monotonic() - started < 120
            Response.model_validate(body, strict=True)
            calls = [o for o in body["output"] if o["type"] == "code_interpreter_call"]
            # A call the token limit cut is not run (incomplete); one that was is stopped at once.
            assert all(c["status"] in ("failed", "incomplete") for c in calls), calls
            if any(c["status"] == "failed" for c in calls):
                break
        else:
            raise AssertionError(f"no forced call was written whole in {TRIES} tries")
        failed = next(c for c in calls if c["status"] == "failed")
        assert "longer than 0.001 s" in failed["outputs"][0]["logs"]
        # The loop went on: the model generated again after the failed call (a
        # random model may answer nothing: usage shows the second prompt).
        cut = _create(server, input="compute", tools=[AUTO], tool_choice="required", max_output_tokens=1,
                      store=False)
        assert body["usage"]["input_tokens"] > 2 * cut.json()["usage"]["input_tokens"]
        assert body["status"] in ("completed", "incomplete")
        assert not _sandbox_processes(server)


def _sandbox_processes(server: Server) -> list[int]:
    """Processes running in this server's container folders."""
    import psutil

    root = str(server.state_dir / "containers")
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(root in part for part in proc.info["cmdline"] or []):
            found.append(proc.pid)
    return found


def test_off_by_default_and_named_when_the_sandbox_cannot_be_made(tmp_path: Any) -> None:
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=1024)
    forced = {"type": "code_interpreter"}
    with running(Server(models, model="tiny")) as server:
        off = _create(server, input="x", tools=[AUTO], tool_choice=forced)
        # Not insisted on, a tool that is off is not offered, and the request is served.
        served = _create(server, input="x", tools=[AUTO], max_output_tokens=4)
        # No containers either: their files are a 404.
        files = httpx.get(f"{server.base_url}/v1/containers/cntr_{'0' * 32}/files", timeout=30)
    assert files.status_code == 404 and "code_interpreter is off" in files.json()["error"]["message"]
    assert served.status_code == 200, served.text
    assert [o["type"] for o in served.json()["output"]] == ["message"]
    missing = os.path.join(str(tmp_path), "no-python")
    env = {"GPUVISOR_CODE_INTERPRETER": "true", "GPUVISOR_CODE_INTERPRETER_PYTHON": missing}
    with running(Server(models, model="tiny", env=env)) as server:
        broken = _create(server, input="x", tools=[{"type": "function", "name": "f"}, AUTO], tool_choice=forced)
    for reply, index, why in ((off, 0, "setting code_interpreter"), (broken, 1, "cannot be enabled")):
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == f"tools[{index}].type" and why in error["message"], error


async def test_the_agents_sdk_runs_a_turn_with_its_code_interpreter_tool(srv: Server, sandbox_python: str) -> None:
    agents = pytest.importorskip("agents", reason="the openai-agents package (test extra) is not installed")
    from tests.test_clients_sdk import Capture

    capture = Capture()
    client = capture.async_client(srv.base_url)
    model = agents.OpenAIResponsesModel(model=srv.model, openai_client=client)
    tool = agents.CodeInterpreterTool(tool_config={"type": "code_interpreter", "container": {"type": "auto"}})
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=1500)
    agent = agents.Agent(name="coder", instructions="Use Python.", tools=[tool], model=model,
                         model_settings=settings)
    config = agents.RunConfig(tracing_disabled=True)
    ran: list[Any] = []
    for _ in range(TRIES):
        # The server ran the calls inside the turn: the agent gets them, and the answer, in one response.
        try:
            result = await agents.Runner.run(agent, "compute", run_config=config, max_turns=1)
        except agents.MaxTurnsExceeded:
            continue  # the forced call was cut short: no answer in that turn
        calls = [item.raw_item for item in result.new_items if isinstance(item, agents.ToolCallItem)]
        assert calls and all(isinstance(c, ResponseCodeInterpreterToolCall) for c in calls)
        ran = [c for c in calls if c.status == "completed"]
        if ran:
            break
    await client.close()
    assert ran, f"no forced call ran in {TRIES} tries"
    _check_ran(ran[0].model_dump(mode="json"), sandbox_python)
    assert isinstance(result.final_output, str)
    assert capture.validate() > 0


def test_allowed_tools_naming_the_code_interpreter_forces_its_call(srv: Server, sandbox_python: str) -> None:
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "code_interpreter"}]}
    other = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
    body = _forced(srv, tools=[other, AUTO], tool_choice=choice)
    Response.model_validate(body, strict=True)
    # Only the code interpreter was allowed: the forced first call is its, never lookup.
    assert body["output"][0]["type"] == "code_interpreter_call"
    assert "lookup" not in [o.get("name") for o in body["output"]]
    call = _ran(body["output"])
    assert call is not None
    _check_ran(call, sandbox_python)
