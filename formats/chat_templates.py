"""Which chat template a model is prompted with, and where it came from.

In order: an override file from the model's settings, the template in the
model's own file, a built-in template for its architecture
(formats/builtin_templates.py), and last the ChatML fallback. The worker
renders with the choice; the parent reads its text (the worker reports it)
to tell how the model's output is parsed, and shows the source in
``/api/models``.

Some architectures cover several turn formats (a ``llama`` GGUF may be
Llama 2, Llama 3 or Mistral): the vocab tells them apart, by whether it
holds the format's marker as one token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from formats.builtin_templates import BUILTIN_TEMPLATES

CHATML_FALLBACK = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Where a generation with the fallback template ends.
FALLBACK_STOPS = ("<|im_end|>", "<|im_start|>")

# An override file larger than this is refused: real templates are at most
# tens of KiB (the largest published ones, tool-heavy, are about 20 KiB).
MAX_TEMPLATE_FILE_BYTES = 256 * 1024

TemplateSource = Literal["override", "file", "architecture", "fallback"]


@dataclass(frozen=True)
class _ByVocab:
    """A family whose format the vocab decides: the first (marker, template)
    whose marker is one token of the vocab, else ``default``."""

    checks: tuple[tuple[str, str], ...]
    default: str


_LLAMA = _ByVocab((("<|start_header_id|>", "llama3"), ("[SYSTEM_PROMPT]", "mistral-v7-tekken"),
                   ("[INST]", "mistral-v3")), "llama2")
_PHI = _ByVocab((("<|im_sep|>", "phi4"),), "phi3")
_DEEPSEEK = _ByVocab((("<｜Assistant｜>", "deepseek3"),), "deepseek2")

# GGUF architectures (llama.cpp's names) and Hugging Face model types.
_BY_ARCHITECTURE: dict[str, str | _ByVocab] = {
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3n", "gemma3_text", "gemma3n_text"), "gemma"),
    **dict.fromkeys(("llama", "mistral", "mistral3"), _LLAMA),
    **dict.fromkeys(("llama4", "llama4_text"), "llama4"),
    **dict.fromkeys(("phi3", "phimoe"), _PHI),
    **dict.fromkeys(("command-r", "cohere", "cohere2"), "command-r"),
    **dict.fromkeys(("deepseek2", "deepseek_v2", "deepseek_v3"), _DEEPSEEK),
    **dict.fromkeys(("granite", "granitemoe", "granitehybrid", "granitemoehybrid"), "granite"),
    **dict.fromkeys(("exaone", "exaone4"), "exaone3"),
    **dict.fromkeys(("chatglm", "glm4"), "chatglm4"),
}


@dataclass(frozen=True)
class ChosenTemplate:
    source: TemplateSource
    text: str
    # The built-in's name (source "architecture"), or "chatml" for the fallback.
    name: str = ""
    stops: tuple[str, ...] = ()


def builtin_name(architecture: str, has_token: Callable[[str], bool] | None) -> str | None:
    """The built-in template for ``architecture``, "" when it has none (the
    fallback), None when the vocab decides and ``has_token`` is not given."""
    rule = _BY_ARCHITECTURE.get(architecture.lower())
    if rule is None:
        return ""
    if isinstance(rule, str):
        return rule
    if has_token is None:
        return None
    return next((name for marker, name in rule.checks if has_token(marker)), rule.default)


def choose_template(
    file_template: str | None,
    architecture: str,
    has_token: Callable[[str], bool],
    override: str | None = None,
) -> ChosenTemplate:
    """The template a model is prompted with (see the module's docstring)."""
    if override is not None:
        return ChosenTemplate("override", override)
    if file_template is not None:
        return ChosenTemplate("file", file_template)
    name = builtin_name(architecture, has_token)
    if name:
        builtin = BUILTIN_TEMPLATES[name]
        return ChosenTemplate("architecture", builtin.source, name, builtin.stops)
    return ChosenTemplate("fallback", CHATML_FALLBACK, "chatml", FALLBACK_STOPS)


class TemplateFileError(ValueError):
    """An override file that cannot be used; the message says why."""


def read_template_file(path: Path) -> str:
    """The template in ``path``: a UTF-8 file of at most
    :data:`MAX_TEMPLATE_FILE_BYTES` whose Jinja parses. Read with a bound, so
    a huge or endless file (a FIFO, /dev/zero) costs nothing."""
    import jinja2  # here: the parent imports this module for its constants too
    import jinja2.sandbox

    if not path.is_file():
        raise TemplateFileError(f"{path} is not a file")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TEMPLATE_FILE_BYTES + 1)
    except OSError as exc:
        raise TemplateFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(raw) > MAX_TEMPLATE_FILE_BYTES:
        raise TemplateFileError(f"{path} is over {MAX_TEMPLATE_FILE_BYTES // 1024} KiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TemplateFileError(f"{path} is not UTF-8 text (byte {exc.start})") from exc
    if not text.strip():
        raise TemplateFileError(f"{path} is empty")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateFileError(f"{path} is not a valid Jinja template: {exc.message} (line {exc.lineno})") from exc
    return text
