"""What a model's chat template says about reasoning and tool calls.

The parent never renders templates; it only reads the template text the
worker reports (``ModelFacts.chat_template``) to decide how to parse the
output, which template variables carry the reasoning effort, and which
tool-call format a grammar must produce.

How a template takes tools (``ToolSupport``):
- native: it lists the tools and its model has a call format of its own;
- unlisted: a call format (DeepSeek-R1's) but no tool list: the tools are
  listed in the system prompt for it, and its own format is kept;
- none: neither (Llama 2, Gemma, Phi, plain ChatML, the built-in templates
  of formats/builtin_templates.py for a GGUF with none):
  the tools go in llama.cpp's generic format (``generic_calls``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from formats.chat_templates import CHATML_FALLBACK
from supervisor.generation import tagged_calls as tc
from supervisor.generation.grammar import DEEPSEEK_CALLS_BEGIN
from supervisor.generation.tagged_grammar import CallStyle
from worker.protocol import ModelFacts

ToolSupport = Literal["native", "unlisted", "none"]

# A template that names ``tools`` renders the request's tool list.
_LISTS_TOOLS = re.compile(r"\btools\b")
# "System role not supported" and the like.
_REFUSES_SYSTEM = re.compile(r"system\s+(?:role|message|prompt)s?\s+(?:is\s+|are\s+)?not\s+supported",
                             re.IGNORECASE)


def _opens_think(template: str) -> bool:
    """Whether the generation prompt opens a think block for the model to close,
    e.g. "<|im_start|>assistant\n<think>\n" (DeepSeek-R1, QwQ). Qwen3 writes
    "<think></think>" there only to switch thinking off, which does not count."""
    start = template.rfind("add_generation_prompt")
    if start < 0:
        return False
    end = template.find("endif", start)
    block = template[start : end if end >= 0 else len(template)]
    return "<think>" in block and "</think>" not in block


# An effort variable takes a template's own levels (gpt-oss: "Reasoning: low",
# "medium" or "high"); the API's other levels become the nearest of them, so
# "max" (and "xhigh") is the template's highest.
EFFORT_LEVELS: dict[str, str] = {
    "none": "low", "minimal": "low", "low": "low", "medium": "medium",
    "high": "high", "xhigh": "high", "max": "high",
}


@dataclass(frozen=True)
class TemplateProfile:
    thinks: bool = False
    starts_in_reasoning: bool = False
    # Template variables that take the request's reasoning effort.
    effort_var: str | None = None
    toggle_var: str | None = None
    tool_style: CallStyle = "hermes"
    tool_support: ToolSupport = "native"
    # False for a template that refuses a system message (Gemma 2, Mistral v0.1):
    # text for the system prompt then goes at the start of the first user turn.
    system_role: bool = True

    @property
    def generic_tools(self) -> bool:
        """The tools go in llama.cpp's generic JSON format (the template has none)."""
        return self.tool_support == "none"

    @property
    def tool_format(self) -> str:
        """What ``/api/models`` says: "generic", or "native-<style>" (e.g. native-hermes)."""
        return "generic" if self.generic_tools else f"native-{self.tool_style}"

    @property
    def harmony(self) -> bool:
        """The output is harmony messages (gpt-oss), not tagged text."""
        return self.tool_style == "harmony"

    def template_vars(self, effort: str | None) -> dict[str, object]:
        """Variables passing ``reasoning.effort`` to the template (none if unset)."""
        if effort is None:
            return {}
        out: dict[str, object] = {}
        if self.effort_var:
            out[self.effort_var] = EFFORT_LEVELS.get(effort, effort)
        if self.toggle_var:
            out[self.toggle_var] = effort != "none"
        return out


def _harmony(template: str) -> bool:
    """gpt-oss: messages on channels, ``<|channel|>analysis<|message|>...``."""
    return "<|channel|>" in template and "<|message|>" in template


# Markup only one family's template writes, checked before the shared ones
# (Qwen3-Coder and GLM 4.5 write <tool_call> too, Functionary Llama 3's headers).
_OWN_MARKUP: tuple[tuple[str, CallStyle], ...] = (
    # "<function=" alone is also Functionary v3.1's ``<function=NAME>{json}``.
    ("<parameter=", "qwen3_coder"),
    ("<arg_key>", "glm45"),
    (tc.KIMI_SECTION_OPEN, "kimi_k2"),
    # Kimi K2's first template declares tools this way but never renders a call.
    ("<|im_system|>tool_declare<|im_middle|>", "kimi_k2"),
    (tc.FUNCTIONARY_OPEN + "all", "functionary_v32"),
    (tc.R7B_OPEN, "command_r7b"),
    (tc.GRANITE_OPEN, "granite"),
    (tc.NEMOTRON_OPEN, "nemotron"),
)


def _call_format(template: str) -> CallStyle | None:
    """The call format the template's markup shows, if any."""
    if _harmony(template):
        return "harmony"
    if DEEPSEEK_CALLS_BEGIN in template:
        return "deepseek"
    for markup, style in _OWN_MARKUP:
        if markup in template:
            return style
    if "[TOOL_CALLS]" in template:
        # Mistral's newer tokenizers write ``[TOOL_CALLS]name[ARGS]{...}``.
        return "mistral_args" if "[ARGS]" in template else "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "parameters" in template):
        return "llama3"
    return None


def _tool_support(template: str, style: CallStyle | None) -> ToolSupport:
    if _LISTS_TOOLS.search(template):
        return "native"  # a tool list with no known markup keeps the Hermes default, as before
    return "unlisted" if style is not None else "none"


def _takes_system(template: str) -> bool:
    """Whether a system message renders: not when the template says it refuses
    one, nor when it refuses roles it does not know and never names "system"."""
    if _REFUSES_SYSTEM.search(template):
        return False
    return "system" in template or "raise_exception" not in template


def profile_for(template: str | None) -> TemplateProfile:
    """The profile of ``template``; None is a template whose text is not known
    (Hermes, native), not a model without one: see :func:`served_profile`."""
    if not template:
        return TemplateProfile()
    toggle = "enable_thinking" if "enable_thinking" in template else None
    effort = "reasoning_effort" if "reasoning_effort" in template else None
    # A harmony model reasons on its analysis channel.
    thinks = ("<think>" in template or "</think>" in template or toggle is not None or _harmony(template)
              or tc.R7B_THINKING[0] in template)
    style = _call_format(template)
    return TemplateProfile(
        thinks=thinks,
        starts_in_reasoning=_opens_think(template),
        effort_var=effort,
        toggle_var=toggle,
        tool_style=style or "hermes",
        tool_support=_tool_support(template, style),
        system_role=_takes_system(template),
    )


def served_profile(facts: ModelFacts) -> TemplateProfile:
    """The profile of the template a worker renders with (its override, the
    file's own, a built-in for its architecture or the ChatML fallback: none
    of the last two lists tools). A worker that names no text has the
    fallback when the model has no template of its own."""
    if facts.chat_template is None and not facts.has_chat_template:
        return profile_for(CHATML_FALLBACK)
    return profile_for(facts.chat_template)


def file_tool_format(template: str | None) -> str:
    """The tool format a model whose file holds ``template`` (None: none) gets."""
    return profile_for(template or CHATML_FALLBACK).tool_format
