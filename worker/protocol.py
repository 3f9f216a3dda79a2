"""The IPC protocol between the parent and a model worker.

Transport: the parent listens (a Unix socket in its state dir, or TCP; one
listener per worker spawn, its address on the worker's command line); the
worker connects back and both ends prove that they hold the spawn's secret
(32 random bytes, given to the worker as the first line of its stdin, never
on its command line). The parent's first frame is a ``Challenge`` (a fresh
nonce); the worker's first frame is ``Hello``, an HMAC over both nonces; the
parent answers ``Welcome`` with its own HMAC. Neither end reads any other
frame before the other's proof holds, and nothing before that may exceed
``MAX_HELLO_FRAME``. Then the worker loads its model, sends ``Ready`` (or
``LoadFailed``) and serves requests. The frames after the handshake are not
signed or encrypted: over TCP, run on a private network (or TLS, not built).

Framing: a 4-byte big-endian length, then one msgpack message. Frames above
``MAX_FRAME`` are refused on read. A clean EOF between frames is ``None`` from
:func:`read_frame`; EOF inside a frame is :class:`TruncatedFrame`.

Messages are tagged ``msgspec.Struct``s, one union per direction. New fields
get defaults; a field never changes type. Bump ``PROTOCOL_VERSION`` only for
changes an old peer cannot ignore.

The worker's command line is the other half of the contract: the options the
parent passes there that have a structure of their own (speculative
decoding) are defined here too, with the arguments that carry them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

# 3: the authenticated handshake (Challenge, Hello, Welcome), then Ready.
PROTOCOL_VERSION = 3
MAX_FRAME = 16 * 1024 * 1024
# Before a peer proved itself, a frame larger than this is refused: an
# unauthenticated connection costs the other end almost nothing.
MAX_HELLO_FRAME = 1024
SECRET_BYTES = 32
NONCE_BYTES = 32

# The worker's exit codes are part of the contract: 0 = it was asked to stop;
# EXIT_LOAD_FAILED = the model cannot be loaded (bad file, does not fit), so
# the parent reports the reason and does not restart it; anything else is a
# crash, restarted with backoff.
EXIT_OK = 0
EXIT_LOAD_FAILED = 3
_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """Base of every error raised by framing or decoding."""


class FrameTooLarge(ProtocolError):
    pass


class TruncatedFrame(ProtocolError):
    pass


class InvalidMessage(ProtocolError):
    pass


# ---------------------------------------------------------- the command line

# "eagle" and "eagle3": a draft model that is an EAGLE head, which the parent
# finds in the library; only the vllm engine runs them.
SpeculativeMode = Literal["off", "draft", "mtp", "ngram", "eagle", "eagle3"]
SPECULATIVE_MODES: tuple[SpeculativeMode, ...] = ("off", "draft", "mtp", "ngram", "eagle", "eagle3")


@dataclass(frozen=True)
class SpeculativeOptions:
    """Speculative decoding as a worker runs it. The parent resolves ``auto``
    (against its model library); a worker only applies one of these modes."""

    mode: SpeculativeMode = "off"
    # The draft model's GGUF (mode "draft"), or its dir (an hf draft or EAGLE head).
    draft_model: str = ""
    # Tokens drafted per step; 0 = the engine's default.
    draft_min: int = 0
    draft_max: int = 0

    def argv(self) -> list[str]:
        """The worker arguments that carry these options (worker/speculative.py reads them)."""
        if self.mode == "off":
            return []
        args = ["--speculative", self.mode]
        if self.draft_model:
            args += ["--draft-model", self.draft_model]
        if self.draft_min:
            args += ["--draft-min", str(self.draft_min)]
        if self.draft_max:
            args += ["--draft-max", str(self.draft_max)]
        return args


@dataclass(frozen=True)
class RopeOptions:
    """YaRN scaling past the model's native context, as the engine takes it
    (supervisor/models/rope.py says why these two numbers). ``freq_scale``
    0 leaves the model's own RoPE alone."""

    freq_scale: float = 0.0  # the engine's rope_freq_scale: yarn_orig_ctx / the context reached
    yarn_orig_ctx: int = 0

    def argv(self) -> list[str]:
        """The worker arguments that carry these options (worker/__main__.py reads them)."""
        if not self.freq_scale:
            return []
        return ["--rope-freq-scale", repr(self.freq_scale), "--yarn-orig-ctx", str(self.yarn_orig_ctx)]


# ---------------------------------------------------------------- shared parts

# Bounds on the images of one Generate (the parent checks them first; the
# worker answers a request over them with Error "too_many_images" or
# "image_too_large"). All of a request's images also travel in one frame, so
# together they must stay under MAX_FRAME.
MAX_IMAGES = 8
MAX_IMAGE_BYTES = 4 * 1024 * 1024
# Where an image goes in a raw ``Generate.prompt``: one marker per image, in
# order. Chat messages say it with ImagePart instead.
MEDIA_MARKER = "<__media__>"


class TextPart(msgspec.Struct, tag="text"):
    text: str


class ImagePart(msgspec.Struct, tag="image"):
    """The request's next media item (``Generate.images``, taken in order: an
    image or an audio clip) goes here."""


ContentPart = TextPart | ImagePart


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None = None
    # OpenAI-style tool calls of an assistant turn, passed to the chat template.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # Reasoning text of an earlier assistant turn (templates may render it).
    reasoning_content: str | None = None
    # Text and images in order; when set, it stands in for ``content``.
    parts: list[ContentPart] | None = None


class SamplingParams(msgspec.Struct, omit_defaults=True):
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    # Constrain the output: a GBNF grammar, or a JSON schema (as JSON text)
    # that the worker turns into a grammar. ``json_object`` = any JSON object.
    grammar: str | None = None
    json_schema: str | None = None
    json_object: bool = False
    # Where the engine enforces schemas with LLGuidance (ModelFacts.schema_grammar):
    # let it ignore the keywords it does not implement instead of refusing
    # the schema (the parent allows that only when the client did not ask
    # for strict, and logs a warning).
    json_lenient: bool = False
    ignore_eos: bool = False
    # Token log-probabilities: None = off, N = with the N most likely
    # alternatives at each position (0 = the chosen token's only).
    logprobs: int | None = None


# ------------------------------------------------------------ parent -> worker


class Generate(msgspec.Struct, tag=True, omit_defaults=True):
    """Stream a completion. Exactly one of ``messages`` / ``prompt`` is set."""

    id: int
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    # Extra variables for the chat template (e.g. enable_thinking).
    template_vars: dict[str, Any] = {}
    request_id: str = ""
    # Encoded images (PNG, JPEG or GIF bytes, or WAV, MP3 or FLAC clips), placed by the ImageParts
    # of ``messages`` or the MEDIA_MARKERs of ``prompt``, in order.
    images: list[bytes] = []
    # A LoRA adapter the worker holds (its path, as on its command line) to
    # run this request with, at this scale; "" = the base model alone.
    adapter: str = ""
    adapter_scale: float = 1.0


class Tokenize(msgspec.Struct, tag=True):
    id: int
    text: str
    add_special: bool = True


class Embed(msgspec.Struct, tag=True):
    id: int
    inputs: list[str]


class Cancel(msgspec.Struct, tag=True):
    id: int


class Ping(msgspec.Struct, tag=True):
    seq: int


class Shutdown(msgspec.Struct, tag=True):
    pass


class Challenge(msgspec.Struct, tag=True):
    """The parent's first frame on every connection it accepts."""

    protocol_version: int
    nonce: Nonce


class Welcome(msgspec.Struct, tag=True):
    """The parent's answer to a ``Hello`` whose proof held: its own proof
    (role "parent"), so the worker knows it dialled its parent."""

    proof: Proof


ToWorker = Generate | Tokenize | Embed | Cancel | Ping | Shutdown


# ------------------------------------------------------------ worker -> parent


class ModelFacts(msgspec.Struct):
    path: str
    n_ctx: int
    n_ctx_train: int
    n_vocab: int
    # Whether the model's own files hold a chat template.
    has_chat_template: bool
    embedding: bool
    # The template the worker renders with (formats/chat_templates.py), and
    # where it came from: "override", "file", "architecture" (template_name
    # says which built-in) or "fallback" (ChatML). None with no source: the
    # text is unknown (the file's own if has_chat_template, else the fallback).
    chat_template: str | None = None
    # Whether the worker takes images (its projector loaded), and if one was
    # given but not loaded, why; the model then serves text only.
    vision: bool = False
    vision_error: str = ""
    # Whether it takes audio clips (an audio projector loaded); the same
    # vision_error says why a projector given did not load.
    audio: bool = False
    # The LoRA adapters the worker holds (paths); those it was given but does
    # not hold, each with why (refused alone: the others are held); and all
    # of those reasons in one line, "" when it holds every one it was given.
    adapters: list[str] = []
    adapter_error: str = ""
    refused_adapters: dict[str, str] = {}
    # What enforces JSON-schema output formats: "llguidance" (the llama.cpp
    # engine's, where the model's vocab passed the load probe), "gbnf" (our
    # converter, which enforces fewer keywords: formats/schema_keywords.py),
    # or "" (an engine's own structured outputs, e.g. vLLM's).
    schema_grammar: str = ""
    template_source: str = ""
    template_name: str = ""


Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
Proof = Annotated[bytes, msgspec.Meta(max_length=64)]


class Hello(msgspec.Struct, tag=True):
    """The worker's first frame: its proof of the secret over the parent's
    ``Challenge.nonce`` and its own ``nonce`` (:func:`proof`, role "worker")."""

    protocol_version: int
    pid: int
    nonce: Nonce
    proof: Proof


class Ready(msgspec.Struct, tag=True):
    """The model is loaded: the worker serves requests from now on."""

    facts: ModelFacts


class LoadFailed(msgspec.Struct, tag=True):
    protocol_version: int
    reason: str


class Started(msgspec.Struct, tag=True):
    """The worker took Generate ``id``: its prompt fits, prefill begins.

    Before it, a rejection (too long, bad grammar) can still come as Error;
    the parent uses it to answer such a request with an HTTP error.
    """

    id: int
    prompt_tokens: int


class TopLogprob(msgspec.Struct, omit_defaults=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, omit_defaults=True):
    """One generated token's log-probability (softmax of the raw logits)."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class Delta(msgspec.Struct, tag=True):
    id: int
    text: str
    n_tokens: int
    # Set when the request asked for logprobs: one per token of this delta.
    logprobs: list[TokenLogprob] | None = None


class Done(msgspec.Struct, tag=True):
    id: int
    finish_reason: Literal["stop", "length", "cancelled"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Seconds from request receipt to first token, and generation time after it.
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # The request's time limit ended it (finish_reason is then "length"):
    # set by the parent, whose clock cancelled it (supervisor/workers/replies.py).
    timed_out: bool = False


class Error(msgspec.Struct, tag=True):
    """Ends request ``id`` (or, with id -1, answers an undecodable frame)."""

    id: int
    code: str
    message: str


class Tokens(msgspec.Struct, tag=True):
    id: int
    tokens: list[int]


class Embeddings(msgspec.Struct, tag=True):
    id: int
    vectors: list[list[float]]
    prompt_tokens: int


class WorkerStats(msgspec.Struct):
    busy: bool
    requests_done: int
    requests_cancelled: int
    tokens_generated: int
    active_id: int | None = None
    # Requests running at once (up to the worker's parallel slots).
    active: int = 0
    # Speculative decoding since the worker started: tokens drafted, and accepted.
    draft_tokens: int = 0
    draft_accepted: int = 0


class Pong(msgspec.Struct, tag=True):
    seq: int
    stats: WorkerStats


class Heartbeat(msgspec.Struct, tag=True):
    stats: WorkerStats


FromWorker = Hello | Ready | LoadFailed | Started | Delta | Done | Error | Tokens | Embeddings | Pong | Heartbeat


# ------------------------------------------------------------ the handshake

Role = Literal["worker", "parent"]


def proof(secret: bytes, role: Role, parent_nonce: bytes, worker_nonce: bytes) -> bytes:
    """What ``role`` sends to prove it holds ``secret`` on this connection.

    Both nonces are covered, so a proof recorded on one connection proves
    nothing on another; the role is, so one end's proof is never the other's.
    """
    return hmac.new(secret, b"gpuvisor-" + role.encode() + b"\0" + parent_nonce + worker_nonce,
                    hashlib.sha256).digest()


def proof_holds(secret: bytes, role: Role, parent_nonce: bytes, worker_nonce: bytes, given: bytes) -> bool:
    return hmac.compare_digest(proof(secret, role, parent_nonce, worker_nonce), given)


def secret_line(secret: bytes) -> bytes:
    """How the parent writes a worker's secret to its stdin."""
    return secret.hex().encode() + b"\n"


def parse_secret_line(line: bytes) -> bytes:
    """The secret a worker read from its stdin (ValueError when it is not one)."""
    secret = bytes.fromhex(line.strip().decode("ascii"))
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"the secret has {len(secret)} bytes, not {SECRET_BYTES}")
    return secret


# -------------------------------------------------------------------- framing


class Codec:
    """One encoder and one typed decoder, built once per connection."""

    def __init__(self, incoming: Any) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(incoming)

    def encode(self, msg: msgspec.Struct) -> bytes:
        body = self._enc.encode(msg)
        if len(body) > MAX_FRAME:
            raise FrameTooLarge(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
        return _HEADER.pack(len(body)) + body

    def decode(self, body: bytes) -> Any:
        try:
            return self._dec.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise InvalidMessage(str(exc)) from exc
        except RecursionError as exc:
            # msgspec's guard against deeply nested input.
            raise InvalidMessage("message nested too deeply") from exc


def parent_codec() -> Codec:
    return Codec(FromWorker)


def hello_codec() -> Codec:
    """What the parent reads first: only a Hello (any other frame is refused)."""
    return Codec(Hello)


def handshake_codec() -> Codec:
    """What the worker reads first: the parent's Challenge, then its Welcome."""
    return Codec(Challenge | Welcome)


def worker_codec() -> Codec:
    return Codec(ToWorker)


async def read_frame(reader: asyncio.StreamReader, max_frame: int = MAX_FRAME) -> bytes | None:
    """Return one frame body, or None on a clean EOF between frames."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise TruncatedFrame("EOF inside a frame header") from exc
    (length,) = _HEADER.unpack(header)
    if length > max_frame:
        raise FrameTooLarge(f"frame of {length} bytes exceeds {max_frame}")
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise TruncatedFrame(f"EOF after {len(exc.partial)} of {length} bytes") from exc
