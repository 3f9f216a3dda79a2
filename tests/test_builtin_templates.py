"""Which chat template a model gets, the built-in ones, override files and
a request's template variables, checked without a server
(tests/test_templates_serving.py runs them on real workers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from formats.builtin_templates import BUILTIN_TEMPLATES
from formats.chat_templates import (
    CHATML_FALLBACK,
    MAX_TEMPLATE_FILE_BYTES,
    TemplateFileError,
    builtin_name,
    choose_template,
    read_template_file,
)
from supervisor.config import ConfigError, load_config
from supervisor.errors import BadRequest
from supervisor.generation.profile import profile_for
from supervisor.generation.template_vars import checked_kwargs, merged_vars
from worker.chat_template import ChatRenderer
from worker.protocol import ChatMessage

CONVERSATION = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there"),
                ChatMessage("assistant", "Hello."), ChatMessage("user", "Again?")]


def vocab(*tokens: str) -> set[str]:
    return set(tokens)


@pytest.mark.parametrize(("arch", "tokens", "name"), [
    ("gemma", (), "gemma"), ("gemma2", (), "gemma"), ("gemma3", (), "gemma"),
    ("llama", ("<|start_header_id|>", "<|eot_id|>"), "llama3"),
    ("llama", (), "llama2"),
    ("llama", ("[INST]", "[/INST]"), "mistral-v3"),
    ("llama", ("[INST]", "[SYSTEM_PROMPT]"), "mistral-v7-tekken"),
    ("llama4", (), "llama4"),
    ("phi3", (), "phi3"), ("phi3", ("<|im_sep|>",), "phi4"),
    ("command-r", (), "command-r"), ("cohere2", (), "command-r"),
    ("deepseek2", (), "deepseek2"), ("deepseek2", ("<｜Assistant｜>",), "deepseek3"),
    ("granite", (), "granite"), ("exaone", (), "exaone3"), ("glm4", (), "chatglm4"),
    ("qwen2", ("<|im_start|>",), ""), ("olmo2", (), ""),
])
def test_the_architecture_and_vocab_pick_the_builtin(arch: str, tokens: tuple[str, ...], name: str) -> None:
    assert builtin_name(arch, vocab(*tokens).__contains__) == name
    chosen = choose_template(None, arch, vocab(*tokens).__contains__)
    if name:
        assert (chosen.source, chosen.name, chosen.text) == ("architecture", name, BUILTIN_TEMPLATES[name].source)
    else:
        assert (chosen.source, chosen.name, chosen.text) == ("fallback", "chatml", CHATML_FALLBACK)


def test_undecided_without_the_vocab() -> None:
    # The library cannot read the vocab: a llama GGUF's format is the worker's to tell.
    assert builtin_name("llama", None) is None
    assert builtin_name("gemma3", None) == "gemma"
    assert builtin_name("qwen3", None) == ""


def test_override_then_file_then_architecture() -> None:
    has = vocab("<|start_header_id|>").__contains__
    assert choose_template("FILE", "llama", has, "OVERRIDE").source == "override"
    assert choose_template("FILE", "llama", has).text == "FILE"
    assert choose_template(None, "llama", has).name == "llama3"


# Each family's turn markers around one system, user, assistant, user exchange.
EXPECTED = {
    "gemma": "<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
             "<start_of_turn>user\nAgain?<end_of_turn>\n<start_of_turn>model\n",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nAgain?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    # The first BOS is the tokenizer's, not the text's.
    "llama2": "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST] Hello. </s><s>[INST] Again? [/INST]",
    "mistral-v3": "[INST] Be brief.\n\nHi there[/INST] Hello.</s>[INST] Again?[/INST]",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\nHello.<|end|>\n"
            "<|user|>\nAgain?<|end|>\n<|assistant|>\n",
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello.<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Again?<|END_OF_TURN_TOKEN|>"
                 "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtins_write_the_family_turns(name: str) -> None:
    builtin = BUILTIN_TEMPLATES[name]
    assert ChatRenderer(builtin.source, "<s>", "</s>", builtin.stops).render(CONVERSATION) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_every_builtin_keeps_the_conversation(name: str) -> None:
    builtin = BUILTIN_TEMPLATES[name]
    renderer = ChatRenderer(builtin.source, "<s>", "</s>", builtin.stops)
    text = renderer.render(CONVERSATION)
    # Every message's text, in order, and a stop that ends the model's turn.
    positions = [text.index(t) for t in ("Be brief.", "Hi there", "Hello.", "Again?")]
    assert positions == sorted(positions)
    assert renderer.extra_stops and not text.endswith(("Again?", "Again?\n"))
    # No tool list and no reasoning markup: tools go in the generic format.
    profile = profile_for(builtin.source)
    assert (profile.tool_format, profile.system_role, profile.thinks) == ("generic", True, False)


def test_the_fallback_keeps_its_stops() -> None:
    assert ChatRenderer(None, "", "").extra_stops == ["<|im_end|>", "<|im_start|>"]
    assert ChatRenderer("{{ 'x' }}", "", "").extra_stops == []


def test_template_files_are_bounded_and_checked(tmp_path: Path) -> None:
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% break %}{% endfor %}")
    assert "messages" in read_template_file(good)
    cases = {
        "missing": (tmp_path / "nope.jinja", "is not a file"),
        "folder": (tmp_path, "is not a file"),
    }
    big = tmp_path / "big.jinja"
    big.write_text("x" * (MAX_TEMPLATE_FILE_BYTES + 1))
    cases["big"] = (big, "over 256 KiB")
    binary = tmp_path / "bin.jinja"
    binary.write_bytes(b"{{ 1 }}\xff\xfe")
    cases["binary"] = (binary, "not UTF-8")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    cases["broken"] = (broken, r"not a valid Jinja template: .*line 1")
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    cases["empty"] = (empty, "is empty")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases["fifo"] = (fifo, "is not a file")  # never opened: a FIFO would block the read
    for path, message in cases.values():
        with pytest.raises(TemplateFileError, match=message):
            read_template_file(path)


def test_config_checks_the_file_at_startup(tmp_path: Path) -> None:
    def config(toml: str) -> dict[str, object]:
        path = tmp_path / "c.toml"
        path.write_text(toml)
        cfg = load_config({"config": str(path), "state_dir": str(tmp_path)}, environ={})
        return {k: v.chat_template_file for k, v in cfg.model_defaults.items()}

    (tmp_path / "broken.jinja").write_text("{{ messages ")
    with pytest.raises(ConfigError, match=r"model_defaults\.m\.chat_template_file: .*not a valid Jinja"):
        config('[model_defaults.m]\nchat_template_file = "broken.jinja"\n')
    with pytest.raises(ConfigError, match=r"model_defaults\.m\.chat_template_file: .*is not a file"):
        config('[model_defaults.m]\nchat_template_file = "absent.jinja"\n')
    # A relative path is the config file's neighbour.
    (tmp_path / "good.jinja").write_text("{{ messages[0].content }}")
    assert config('[model_defaults.m]\nchat_template_file = "good.jinja"\nenable_thinking = false\n') == {
        "m": str(tmp_path / "good.jinja")}


def test_kwargs_pass_and_the_shortcut_sets_enable_thinking() -> None:
    assert checked_kwargs({"flavor": "salty", "n": 3, "tags": ["a", {"b": None}]}, None) == {
        "flavor": "salty", "n": 3, "tags": ["a", {"b": None}]}
    assert checked_kwargs(None, False) == {"enable_thinking": False}
    assert checked_kwargs({"enable_thinking": True}, True) == {"enable_thinking": True}
    # The request's own variables win over those from reasoning_effort.
    assert merged_vars({"enable_thinking": False, "reasoning_effort": "low"}, {"enable_thinking": True}, None) == {
        "enable_thinking": True, "reasoning_effort": "low"}


@pytest.mark.parametrize(("kwargs", "thinking", "param", "message"), [
    ({"messages": []}, None, "chat_template_kwargs.messages", "set by the server"),
    ({"add_generation_prompt": False}, None, "chat_template_kwargs.add_generation_prompt", "set by the server"),
    ({"not a name": 1}, None, "chat_template_kwargs", "identifiers"),
    ({"x" * 65: 1}, None, "chat_template_kwargs", "identifiers"),
    ({"deep": [[[[["five"]]]]]}, None, "chat_template_kwargs.deep", "deeper than 4"),
    ({"big": "x" * 20_000}, None, "chat_template_kwargs", "over 16 KiB"),
    ({f"k{i}": i for i in range(65)}, None, "chat_template_kwargs", "at most 64"),
    ({"enable_thinking": True}, False, "enable_thinking", "enable_thinking is false but"),
])
def test_bad_kwargs_are_a_400_naming_the_field(kwargs: dict[str, object], thinking: bool | None,
                                               param: str, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as caught:
        checked_kwargs(kwargs, thinking)
    assert caught.value.param == param
