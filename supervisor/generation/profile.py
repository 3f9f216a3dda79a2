"""What a model's chat template says about reasoning and tool calls.

The parent never renders templates; it only reads the template text the
worker reports (``ModelFacts.chat_template``) to decide how to parse the
output, which template variables carry the reasoning effort, and which
tool-call format a grammar must produce.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.generation.grammar import DEEPSEEK_CALLS_BEGIN, ToolStyle


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
    tool_style: ToolStyle = "hermes"

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


def _tool_style(template: str) -> ToolStyle:
    if _harmony(template):
        return "harmony"
    if DEEPSEEK_CALLS_BEGIN in template:
        return "deepseek"
    if "[TOOL_CALLS]" in template:
        # Mistral's newer tokenizers write ``[TOOL_CALLS]name[ARGS]{...}``.
        return "mistral_args" if "[ARGS]" in template else "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "parameters" in template):
        return "llama3"
    return "hermes"


def profile_for(template: str | None) -> TemplateProfile:
    if not template:
        return TemplateProfile()
    toggle = "enable_thinking" if "enable_thinking" in template else None
    effort = "reasoning_effort" if "reasoning_effort" in template else None
    # A harmony model reasons on its analysis channel.
    thinks = "<think>" in template or "</think>" in template or toggle is not None or _harmony(template)
    return TemplateProfile(
        thinks=thinks,
        starts_in_reasoning=_opens_think(template),
        effort_var=effort,
        toggle_var=toggle,
        tool_style=_tool_style(template),
    )
