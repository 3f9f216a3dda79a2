"""Tool-call arguments reach chat templates the way each kind expects."""

from __future__ import annotations

import pytest

from worker.chat_template import ChatRenderer
from worker.protocol import ChatMessage

# Rendering shapes of tool-call arguments seen in published chat templates.
TOJSON = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}"
AS_IS = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments }}{% endfor %}{% endfor %}"
EITHER = (
    "{% for m in messages %}{% for c in m.tool_calls or [] %}"
    "{% if c.function.arguments is string %}{{ c.function.arguments }}{% else %}{{ c.function.arguments | tojson }}{% endif %}"
    "{% endfor %}{% endfor %}"
)
ITEMS = (
    "{% for m in messages %}{% for c in m.tool_calls or [] %}"
    "{% for k, v in c.function.arguments.items() %}<{{ k }}={{ v }}>{% endfor %}"
    "{% endfor %}{% endfor %}"
)


def _render(template: str, arguments: str) -> str:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}
    messages = [ChatMessage("user", "Weather in Paris?"), ChatMessage("assistant", None, tool_calls=[call])]
    return ChatRenderer(template, "", "").render(messages)


@pytest.mark.parametrize("template", [TOJSON, AS_IS, EITHER])
def test_json_arguments_are_encoded_once(template: str) -> None:
    assert _render(template, '{"city": "Paris", "days": 2}') == '{"city": "Paris", "days": 2}'


def test_arguments_are_a_mapping_for_templates_that_walk_them() -> None:
    assert _render(ITEMS, '{"city": "Paris", "days": 2}') == "<city=Paris><days=2>"


def test_arguments_that_are_not_a_json_object_stay_text() -> None:
    assert _render(AS_IS, "not json") == "not json"
    assert _render(AS_IS, "[1, 2]") == "[1, 2]"
    assert _render(TOJSON, "not json") == '"not json"'
