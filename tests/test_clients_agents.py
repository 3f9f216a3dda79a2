"""The OpenAI Agents SDK (``openai-agents``) against a real server.

An agent with one function tool, on the Responses API and on chat
completions, run whole and streamed. The first turn must call the tool
(``tool_choice="required"``, which our grammar forces); with a random model a
second forced turn would only loop, so the run stops on the first tool
(``stop_on_first_tool``): what a user checks is that the tool ran with parsed
arguments, its output became the run's result, and nothing raised. Every
reply the SDK received validates strictly (see ``test_clients_sdk``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.server import Server, running, short_tempdir
from tests.test_clients_sdk import Capture

agents = pytest.importorskip("agents", reason="the openai-agents package (test extra) is not installed")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv(tiny_model_path: Path) -> Iterator[Server]:
    models = short_tempdir("gva")
    (models / "tiny.gguf").symlink_to(tiny_model_path)
    with running(Server(models, env={"GPUVISOR_PARALLEL": "1"})) as server:
        yield server


def _agent(model: Any, calls: list[str]) -> Any:
    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=300)
    return agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model,
                        model_settings=settings, tool_use_behavior="stop_on_first_tool")


MODELS = ["responses", "chat"]


@pytest.mark.parametrize("api", MODELS)
async def test_an_agent_calls_its_tool_and_finishes(srv: Server, api: str) -> None:
    capture = Capture()
    client = capture.async_client(srv.base_url)
    model = (agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel)(
        model=srv.model, openai_client=client)
    config = agents.RunConfig(tracing_disabled=True)
    calls: list[str] = []
    agent = _agent(model, calls)

    result = await agents.Runner.run(agent, "Weather in Oslo?", run_config=config)
    assert len(calls) == 1 and result.final_output == f"sunny in {calls[0]}"

    streamed = agents.Runner.run_streamed(agent, "Weather in Paris?", run_config=config)
    kinds = [event.type async for event in streamed.stream_events()]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert len(calls) == 2 and streamed.final_output == f"sunny in {calls[1]}"
    assert calls[1] in ("Paris", "Oslo")
    await client.close()
    assert capture.validate() > 0
