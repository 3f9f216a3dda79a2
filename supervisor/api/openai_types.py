"""Request bodies of the OpenAI-compatible chat, completion and embedding routes.

Unknown fields are ignored (clients send extras), but a known field with a
wrong type or an unsupported value is a 400 that names it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from supervisor.config import parse_duration
from supervisor.errors import BadRequest
from supervisor.generation.images import Images
from supervisor.generation.sampling import asked_fields
from supervisor.generation.tools import (
    AllowedTools,
    FunctionTool,
    NamedFunction,
    Offer,
    resolve,
)
from supervisor.responses.logprobs import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS
from supervisor.responses.models import Effort
from worker.protocol import ChatMessage, ImagePart, SamplingParams, TextPart
from worker.protocol import ContentPart as WorkerPart

# Choices per request (``n``): each is its own generation, one after another.
MAX_CHOICES = 8


class ImageUrl(msgspec.Struct):
    url: str
    # Accepted and ignored: the projector sees every image at its own size.
    detail: str | None = None


class InputAudio(msgspec.Struct):
    data: str  # base64
    format: str  # wav, mp3 (the OpenAI API's), or flac


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None
    # Some clients send the URL itself instead of {"url": ...}.
    image_url: ImageUrl | str | None = None
    input_audio: InputAudio | None = None


class ChatCalledFunction(msgspec.Struct):
    name: str
    # JSON text: the API sends arguments as a string, never as an object.
    arguments: str


class ChatToolCall(msgspec.Struct, kw_only=True):
    """A call of an earlier assistant turn, echoed back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: ChatCalledFunction


class InMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None


class ChatFunction(msgspec.Struct, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, tag="function", tag_field="type"):
    """Only function tools: any other ``type`` is a 400 naming ``tools[i].type``."""

    function: ChatFunction


class ChatFunctionName(msgspec.Struct):
    name: str


class ChatNamedTool(msgspec.Struct, tag="function", tag_field="type"):
    function: ChatFunctionName


class ChatAllowedTools(msgspec.Struct, kw_only=True):
    mode: Literal["auto", "required"]
    # Entries in the chat form, {"type": "function", "function": {"name": ...}}.
    tools: list[dict[str, Any]]


class ChatAllowedToolChoice(msgspec.Struct, tag="allowed_tools", tag_field="type"):
    allowed_tools: ChatAllowedTools


def _flat_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A chat allowed-tools entry in the Responses API's flat form."""
    fn = entry.get("function")
    if entry.get("type") == "function" and isinstance(fn, dict):
        return {"type": "function", "name": fn.get("name")}
    return entry


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct):
    name: str = "response"
    schema: dict[str, Any] = {}
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Sampling(msgspec.Struct, kw_only=True):
    """Sampling fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # llama.cpp-style extensions
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    ignore_eos: bool = False
    # How long the model stays loaded after this request (Ollama-style).
    keep_alive: str | int | float | None = None
    # The adapter's scale for a <base>:<adapter> model (bounds: workers/adapter_route.py).
    lora_scale: float | None = None

    def keep_alive_s(self) -> float | None:
        if self.keep_alive is None:
            return None
        try:
            return parse_duration(self.keep_alive)
        except ValueError as exc:
            raise BadRequest(str(exc), param="keep_alive") from exc

    def sampling(self, max_tokens: int | None = None) -> SamplingParams:
        if not 1 <= self.n <= MAX_CHOICES:
            raise BadRequest(f"n must be within [1, {MAX_CHOICES}]", param="n")
        # top_k, min_p and repeat_penalty within what [model_defaults] accepts
        # (supervisor/config.py): a negative top_k or a min_p of 5 reached the engine.
        for name, value, lo, hi in (("temperature", self.temperature, 0.0, 2.0),
                                    ("top_p", self.top_p, 0.0, 1.0),
                                    ("top_k", self.top_k, 0, 1 << 20),
                                    ("min_p", self.min_p, 0.0, 1.0),
                                    ("repeat_penalty", self.repeat_penalty, 0.0, 2.0),
                                    ("presence_penalty", self.presence_penalty, -2.0, 2.0),
                                    ("frequency_penalty", self.frequency_penalty, -2.0, 2.0)):
            if value is not None and not lo <= value <= hi:
                raise BadRequest(f"{name} must be within [{lo}, {hi}]", param=name)
        limit = max_tokens if max_tokens is not None else self.max_tokens
        if limit is not None and limit < 1:
            raise BadRequest("max_tokens must be at least 1", param="max_tokens")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 16:
            raise BadRequest("at most 16 stop sequences", param="stop")
        out = SamplingParams(
            max_tokens=limit,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=stops,
            ignore_eos=self.ignore_eos,
        )
        # The fields left out are filled when the pool admits the request,
        # from the model's defaults (supervisor/generation/sampling.py).
        for name, value in self._sampling_values().items():
            if value is not None:
                setattr(out, name, value)
        return out

    def _sampling_values(self) -> dict[str, float | int | None]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "min_p": self.min_p, "repeat_penalty": self.repeat_penalty}

    def sampling_asked(self) -> frozenset[str]:
        """The sampling fields this request sets itself."""
        return asked_fields(**self._sampling_values())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(Sampling, kw_only=True):
    messages: list[InMessage]
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatNamedTool | ChatAllowedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Passed to the template as the Responses API's reasoning.effort is.
    reasoning_effort: Effort | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # Variables for the chat template, and the shortcut for the one named
    # enable_thinking (llama-server's and vLLM's extensions; bounds:
    # supervisor/generation/template_vars.py).
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None

    def chat_messages(self, images: Images | None = None) -> list[ChatMessage]:
        """The messages for the worker; image parts are decoded into ``images``
        (in order), and refused when ``images`` is None."""
        if not self.messages:
            raise BadRequest("messages must not be empty", param="messages")
        out = [_to_chat(i, m, images) for i, m in enumerate(self.messages)]
        _name_tool_results(out)
        return out

    def function_tools(self) -> list[FunctionTool]:
        """The tools in the Responses API's flat form, which the planner takes."""
        tools: list[FunctionTool] = []
        for i, tool in enumerate(self.tools or []):
            fn = tool.function
            if any(t.name == fn.name for t in tools):
                raise BadRequest(f"duplicate tool name {fn.name!r}", param=f"tools[{i}].function.name")
            tools.append(FunctionTool(name=fn.name, description=fn.description,
                                      parameters=fn.parameters, strict=fn.strict))
        return tools

    def tool_offer(self) -> Offer:
        """The functions offered under ``tool_choice`` (unset means "auto")."""
        tools = self.function_tools()
        choice = self.tool_choice
        if isinstance(choice, ChatNamedTool):
            if choice.function.name not in {t.name for t in tools}:
                raise BadRequest(f"tool_choice names {choice.function.name!r}, which is not in tools",
                                 param="tool_choice.function.name")
            return Offer(tools, NamedFunction(choice.function.name))
        if isinstance(choice, ChatAllowedToolChoice):
            allowed = AllowedTools(mode=choice.allowed_tools.mode,
                                   tools=[_flat_entry(e) for e in choice.allowed_tools.tools])
            return resolve(tools, allowed, param="tool_choice.allowed_tools")
        return resolve(tools, choice or "auto")

    @property
    def parallel_calls(self) -> bool:
        return self.parallel_tool_calls is not False

    @property
    def schema_strict(self) -> bool:
        """Whether the client asked for its JSON schema to hold exactly."""
        fmt = self.response_format
        return bool(fmt is not None and fmt.json_schema is not None and fmt.json_schema.strict)

    def chat_sampling(self) -> SamplingParams:
        params = self.sampling(self.max_completion_tokens)
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            params.json_object = True
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise BadRequest("response_format.json_schema is required for type json_schema",
                                 param="response_format.json_schema")
            params.json_schema = msgspec.json.encode(fmt.json_schema.schema).decode()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.logprobs:
            params.logprobs = self.top_logprobs or 0
        return params


def _add_media(part: ContentPart, role: str, param: str, images: Images) -> None:
    """Decode an image_url or input_audio part into ``images``; 400s name ``param``."""
    if role != "user":
        what = "images are" if part.type == "image_url" else "audio is"
        raise BadRequest(f"{what} accepted in user messages only", param=param)
    if part.type == "image_url":
        if part.image_url is None:
            raise BadRequest("an image_url part needs image_url.url", param=param)
        images.add(part.image_url if isinstance(part.image_url, str) else part.image_url.url, param)
        return
    if part.input_audio is None:
        raise BadRequest("an input_audio part needs input_audio.data and .format", param=param)
    images.add_audio(part.input_audio.data, part.input_audio.format, param)


def _to_chat(i: int, m: InMessage, images: Images | None) -> ChatMessage:
    content: str | None
    parts: list[WorkerPart] | None = None
    if isinstance(m.content, list):
        texts = []
        parts = []
        for j, part in enumerate(m.content):
            param = f"messages[{i}].content[{j}]"
            if part.type in ("image_url", "input_audio") and images is not None:
                _add_media(part, m.role, param, images)
                parts.append(ImagePart())  # the worker's placement of any media item
                continue
            if part.type not in ("text", "input_text") or part.text is None:
                raise BadRequest(f"content part type '{part.type}' is not supported by this model",
                                 param=f"{param}.type")
            texts.append(part.text)
            parts.append(TextPart(part.text))
        content = "".join(texts)
        if not any(isinstance(p, ImagePart) for p in parts):
            parts = None  # text only: the plain content, as before
    else:
        content = m.content
    if m.role == "tool" and not m.tool_call_id:
        raise BadRequest("a tool message needs the tool_call_id of the call it answers",
                         param=f"messages[{i}].tool_call_id")
    role = "system" if m.role == "developer" else m.role
    calls = [msgspec.to_builtins(c) for c in m.tool_calls] if m.tool_calls else None
    return ChatMessage(role=role, content=content, tool_calls=calls,
                       tool_call_id=m.tool_call_id, name=m.name, parts=parts)


def _name_tool_results(messages: list[ChatMessage]) -> None:
    """Give each tool result the name of the call it answers: some templates
    render it, and chat clients send only the call id."""
    names: dict[str, str] = {}
    for msg in messages:
        for call in msg.tool_calls or []:
            names[call["id"]] = call["function"]["name"]
        if msg.role == "tool" and msg.name is None and msg.tool_call_id in names:
            msg.name = names[msg.tool_call_id]


class CompletionRequest(Sampling, kw_only=True):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    # The legacy API's form: how many alternatives per token (0: the chosen one only).
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise BadRequest("exactly one prompt per request is supported", param="prompt")
        return self.prompt[0]


MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str]:
        items = [self.input] if isinstance(self.input, str) else self.input
        if not items:
            raise BadRequest("input must not be empty", param="input")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise BadRequest(f"input has {len(items)} items; at most {MAX_EMBEDDING_INPUTS} per request "
                             "(as OpenAI's API)", param="input")
        if self.dimensions is not None:
            raise BadRequest("dimensions is not supported", param="dimensions")
        return items
