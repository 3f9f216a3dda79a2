"""The model inside a worker: llama.cpp's own server engine, through xllamacpp.

``xllamacpp.Server`` runs llama.cpp's server loop in native threads:
``n_parallel`` slots with continuous batching, a prompt cache per slot,
sampling, stop strings and grammars. Calls from several Python threads run
concurrently in those slots; each call streams through a callback, and
returning True from it stops that generation.

We render chat prompts ourselves (worker/chat_template.py) and use the
engine's completions path with a grammar: with small or unusual vocabs the
engine's chat path did not force tool calls. JSON output formats go through
the engine's LLGuidance where the model's vocab allows it (probed at load,
worker/guidance.py), else through a GBNF grammar built by us; a forced tool
call's grammar comes from the parent, LLGuidance's (``%llguidance``, checked
like a schema's) or GBNF. Its HTTP listener is bound to a private
Unix socket and serves only tokenization and model facts to this process.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import xllamacpp

from formats.chat_templates import TemplateFileError, choose_template
from formats.gguf_meta import GGUFMetaError, read_metadata
from formats.schema_gbnf import json_object_gbnf
from worker.adapters import AdapterError, AdapterSet
from worker.chat_template import ChatRenderer, TemplateError, override_template
from worker.engine_api import Counters, Emit, EngineApi, EngineOptions, LoadError
from worker.engine_params import engine_params
from worker.grammar_guard import bounded_schema, check_grammar, schema_to_grammar
from worker.guidance import CompileCheck, json_lark, vocab_accepts
from worker.images import ImageError, check_images, placements
from worker.protocol import (
    MEDIA_MARKER,
    Delta,
    Done,
    Error,
    Generate,
    ModelFacts,
    SamplingParams,
    Started,
    TokenLogprob,
    TopLogprob,
)
from worker.refusal import rejection
from worker.speculative import load_note
from worker.unix_http import UnixJSONClient
from worker.vision import ProjectorError, check_projector, oai_chunk

log = logging.getLogger("gpuvisor.worker")


def _sampling(params: SamplingParams, grammar: str | None, stops: list[str]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        "min_p": params.min_p, "repeat_penalty": params.repeat_penalty,
        "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
        "stop": stops, "ignore_eos": params.ignore_eos,
    }
    if params.seed is not None:
        body["seed"] = params.seed & 0xFFFFFFFF
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens
    if grammar is not None:
        body["grammar"] = grammar
    if params.logprobs is not None:
        # Probabilities of the raw logits, not after top-k/top-p cut them.
        body.update(n_probs=max(1, params.logprobs), post_sampling_probs=False)
    return body


def _logprobs(choice: dict[str, Any], top: int) -> list[TokenLogprob]:
    content = (choice.get("logprobs") or {}).get("content") or []
    return [TokenLogprob(str(t.get("token", "")), float(t.get("logprob", 0.0)), t.get("bytes"),
                         [TopLogprob(str(a.get("token", "")), float(a.get("logprob", 0.0)), a.get("bytes"))
                          for a in (t.get("top_logprobs") or [])[:top]])
            for t in content]


def output_grammar(params: SamplingParams, llguidance: bool = False) -> str | None:
    """The grammar that constrains the output: a JSON format in LLGuidance's
    Lark where ``llguidance``, else GBNF, bounded first (a too deep grammar
    crashes llama.cpp's parser)."""
    if llguidance and params.grammar is None and (params.json_schema or params.json_object):
        schema = bounded_schema(params.json_schema) if params.json_schema else {"type": "object"}
        return check_grammar(json_lark(schema, lenient=params.json_lenient))
    if params.grammar:
        return check_grammar(params.grammar)
    if params.json_schema:
        return schema_to_grammar(params.json_schema)
    if params.json_object:
        return json_object_gbnf()
    return None


class _Stream:
    """One generation's view of the engine's chunks."""

    def __init__(self, req: Generate, emit: Emit, cancelled: threading.Event) -> None:
        self.req = req
        self.emit = emit
        self.cancelled = cancelled
        self.started_at = time.perf_counter()
        self.first_at: float | None = None
        self.prompt_tokens = 0
        self.cached = 0
        self.generated = 0
        # The engine's per-request draft counters (cumulative in its timings).
        self.drafted = 0
        self.accepted = 0
        self.finish = "length"
        self.error: dict[str, Any] | None = None
        self.began = False

    def on_chunk(self, chunk: Any) -> bool:
        for item in chunk if isinstance(chunk, list) else [chunk]:
            self._one(item)
        return self.cancelled.is_set()

    def _one(self, chunk: dict[str, Any]) -> None:
        if "error" in chunk:
            self.error = chunk["error"]
            return
        progress = chunk.get("prompt_progress")
        if progress is not None and not self.began:
            self.began = True
            self.prompt_tokens = int(progress.get("total", 0))
            self.cached = int(progress.get("cache", 0))
            self.emit(Started(self.req.id, self.prompt_tokens))
        timings = chunk.get("timings") or {}
        n = int(timings.get("predicted_n", self.generated))
        self.drafted = int(timings.get("draft_n", self.drafted))
        self.accepted = int(timings.get("draft_n_accepted", self.accepted))
        if "cache_n" in timings:
            self.cached = int(timings["cache_n"])
            self.prompt_tokens = self.cached + int(timings.get("prompt_n", 0))
        top = self.req.params.logprobs
        for choice in chunk.get("choices", []):
            text = choice.get("text") or ""
            if text or n > self.generated:
                if self.first_at is None:
                    self.first_at = time.perf_counter()
                probs = None if top is None else _logprobs(choice, top)
                self.emit(Delta(self.req.id, text, max(0, n - self.generated), probs))
                self.generated = max(self.generated, n)
            if choice.get("finish_reason"):
                self.finish = str(choice["finish_reason"])
        usage = chunk.get("usage")
        if usage:
            self.generated = int(usage.get("completion_tokens", self.generated))
            self.prompt_tokens = int(usage.get("prompt_tokens", self.prompt_tokens))
            details = usage.get("prompt_tokens_details") or {}
            self.cached = int(details.get("cached_tokens", self.cached))

    def done(self) -> Done:
        now = time.perf_counter()
        first = self.first_at if self.first_at is not None else now
        finish = "cancelled" if self.cancelled.is_set() else self.finish
        if finish not in ("stop", "length", "cancelled"):
            finish = "stop"
        return Done(self.req.id, finish, self.prompt_tokens, self.generated,  # type: ignore[arg-type]
                    self.cached, first - self.started_at, now - first)


def load(opts: EngineOptions) -> EngineApi:
    """This engine's entry in the registry (worker/engine_api.py)."""
    return Engine(opts)


class Engine:
    """llama.cpp's server engine holding one model; an ``EngineApi``."""

    def __init__(self, opts: EngineOptions) -> None:
        self.opts = opts
        self.counters = Counters()
        path = Path(opts.model_path)
        try:
            meta = read_metadata(path)
        except (OSError, GGUFMetaError) as exc:
            raise LoadError(f"cannot load {opts.model_path}: {exc}") from exc
        try:
            override = override_template(opts.chat_template_file)
        except TemplateFileError as exc:
            raise LoadError(f"chat_template_file: {exc}") from exc
        sock = Path(opts.engine_socket)
        self.vision_error = ""
        mmproj = opts.mmproj
        if mmproj:
            try:
                check_projector(Path(mmproj))
            except ProjectorError as exc:
                self.vision_error = str(exc)
                mmproj = ""
        self.adapters = AdapterSet.prepare(opts.lora, sock.with_suffix(".neutral.gguf"))
        try:
            self.server = self._start_held(opts, sock, mmproj)
        except LoadError:
            if not mmproj:
                raise
            # The engine reports any load failure the same way: retry
            # without the projector to tell whose it was, and serve text.
            self.server = self._start_held(opts, sock, "")
            self.vision_error = (f"the engine could not load the projector {Path(mmproj).name} "
                                 "(its log says why, e.g. an embedding width unlike the model's)")
        if self.vision_error:
            log.warning("serving text only: %s", self.vision_error)
        self.http = UnixJSONClient(sock)
        props = self.http.request("GET", "/props")
        modalities = props.get("modalities") or {}
        self.vision = bool(modalities.get("vision"))
        self.audio = bool(modalities.get("audio"))
        # The engine draws a random marker at start, so text from a client
        # can never place an image by spelling it.
        self.media_marker = str(props.get("media_marker") or "")
        info = self.http.request("GET", "/v1/models")["data"][0].get("meta", {})
        raw_template = meta.get("tokenizer.chat_template")
        template = raw_template if isinstance(raw_template, str) else None
        chosen = choose_template(template, str(meta.get("general.architecture") or ""), self._has_token, override)
        log.info("chat template: %s%s", chosen.source, f" ({chosen.name})" if chosen.name else "")
        self.renderer = ChatRenderer.of(chosen, str(props.get("bos_token") or ""),
                                        str(props.get("eos_token") or ""))
        self.n_ctx = int(props["default_generation_settings"]["n_ctx"])
        self.facts = ModelFacts(
            path=opts.model_path,
            n_ctx=self.n_ctx,
            n_ctx_train=int(info.get("n_ctx_train", self.n_ctx)),
            n_vocab=int(info.get("n_vocab", 0)),
            has_chat_template=template is not None,
            embedding=opts.embedding,
            chat_template=chosen.text,
            template_source=chosen.source,
            template_name=chosen.name,
            vision=self.vision,
            vision_error=self.vision_error,
            audio=self.audio,
            adapters=list(self.adapters.paths),
            adapter_error=self.adapters.error(),
            refused_adapters=dict(self.adapters.refused),
            # An embedding worker generates nothing, so it is not asked.
            schema_grammar="" if opts.embedding else "llguidance" if vocab_accepts(self._complete) else "gbnf",
        )
        self.llguidance = self.facts.schema_grammar == "llguidance"
        self.guidance = CompileCheck(self._complete)

    def _has_token(self, text: str) -> bool:
        """Whether the vocab holds ``text`` as one token (a turn marker)."""
        return len(self.tokenize(text, add_special=False)) == 1

    def _start_held(self, opts: EngineOptions, sock: Path, mmproj: str) -> xllamacpp.Server:
        """Start with the adapters; if the engine refuses them, without each
        in turn, then without any (worker/adapters.py), saying which and why."""
        if not self.adapters.paths:
            return self._start(opts, sock, mmproj)
        try:
            return self._start(opts, sock, mmproj, self.adapters)
        except LoadError as exc:
            log.warning("the engine refused the LoRA adapters %s: %s",
                        [Path(p).name for p in self.adapters.paths], exc)
        for fewer in self.adapters.without_each():
            try:
                server = self._start(opts, sock, mmproj, fewer)
            except LoadError:
                if not fewer.paths:
                    raise  # the base alone fails too: the fault is not the adapters'
                continue
            self.adapters = fewer
            log.warning("serving without some LoRA adapters: %s", fewer.error())
            return server
        raise AssertionError("without_each ends with the base alone, which returns or raises")

    @staticmethod
    def _start(opts: EngineOptions, sock: Path, mmproj: str,
               adapters: AdapterSet | None = None) -> xllamacpp.Server:
        # A stale socket file makes the engine's listener fail to bind.
        sock.unlink(missing_ok=True)
        try:
            return xllamacpp.Server(engine_params(opts, mmproj, adapters))
        except (RuntimeError, ValueError, OSError) as exc:
            raise LoadError(f"cannot load {opts.model_path}{load_note(opts.speculative)}: {exc}") from exc

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.http.tokenize(text, add_special=add_special, parse_special=True)

    def prompt_text(self, req: Generate) -> tuple[str, list[str]]:
        if req.messages is not None:
            text = self.renderer.render(req.messages, req.tools, req.template_vars,
                                        self.media_marker or MEDIA_MARKER)
            return text, self.renderer.extra_stops
        prompt = req.prompt or ""
        if req.images:
            prompt = prompt.replace(MEDIA_MARKER, self.media_marker)
        return prompt, []

    def _check_images(self, req: Generate) -> None:
        check_images(req, vision=self.vision, audio=self.audio, why=self.vision_error)

    def generate(self, req: Generate, emit: Emit, cancelled: threading.Event) -> None:
        try:
            # A raw prompt's markers mean images only when it carries some.
            if req.images or (req.messages is not None and placements(req) > 0):
                self._check_images(req)
            try:
                text, extra_stops = self.prompt_text(req)
            except ValueError as exc:
                # A template that fails on this request's data (a filter given
                # a bad value) is the request's template error, not a grammar's.
                raise TemplateError(str(exc)) from exc
            if req.images and text.endswith(self.media_marker):
                # The engine aborts the process on a prompt whose last chunk
                # is an image (it needs a text token to sample from).
                raise ImageError("invalid_request", "the prompt ends with an image; text must follow it")
            grammar = output_grammar(req.params, self.llguidance)
            lora = self.adapters.request_field(req.adapter, req.adapter_scale)
            if grammar is not None and grammar.startswith("%llguidance"):
                # On the request's own prompt and adapter, so the slot's cache
                # holds its prefill for the request itself.
                shared: dict[str, Any] = {"prompt": "a" if req.images else text}
                if lora is not None:
                    shared["lora"] = lora
                self.guidance.require(grammar, shared, cancelled)
        except AdapterError as exc:
            emit(Error(req.id, "adapter_unavailable", str(exc)))
            return
        except ImageError as exc:
            emit(exc.reply(req.id))
            return
        except TemplateError as exc:
            emit(Error(req.id, "template_error", str(exc)))
            return
        except (ValueError, json.JSONDecodeError) as exc:
            emit(Error(req.id, "invalid_grammar", f"cannot build the output grammar: {exc}"))
            return
        body = _sampling(req.params, grammar, [*req.params.stop, *extra_stops])
        body.update(prompt=text, stream=True, return_progress=True, timings_per_token=True,
                    cache_prompt=True)
        if lora is not None:
            body["lora"] = lora
        stream = _Stream(req, emit, cancelled)
        if req.images:
            self._native_completion(req, body, stream)
        else:
            self.server.handle_completions(body, stream.on_chunk)
        if stream.error is not None and not stream.began:
            emit(rejection(req, stream.error, grammar=grammar, n_ctx=self.n_ctx,
                           grammar_refusal=self._grammar_refusal))
            return
        if stream.error is not None:
            emit(Error(req.id, "engine_error", str(stream.error.get("message", stream.error))))
            return
        done = stream.done()
        self.counters.count(done.finish_reason, done.completion_tokens, stream.drafted, stream.accepted)
        emit(done)

    def _native_completion(self, req: Generate, body: dict[str, Any], stream: _Stream) -> None:
        """Run a request with images on the engine's native route (the only
        one that takes them), feeding ``stream`` OpenAI-shaped chunks."""
        body["prompt"] = {"prompt_string": body["prompt"],
                          "multimodal_data": [base64.b64encode(b).decode("ascii") for b in req.images]}
        with contextlib.closing(self.http.stream("/completions", body)) as events:
            for event in events:
                if stream.on_chunk(oai_chunk(event)):
                    break  # closing the connection stops the generation

    def _complete(self, body: dict[str, Any], cancelled: threading.Event) -> tuple[str, dict[str, Any] | None]:
        """One short completion for the worker itself (the LLGuidance probes):
        its text, and the engine's error if it refused."""
        text: list[str] = []
        errors: list[dict[str, Any]] = []

        def on_chunk(chunk: Any) -> bool:
            for item in chunk if isinstance(chunk, list) else [chunk]:
                if "error" in item:
                    errors.append(item["error"])
                text.extend(c.get("text") or "" for c in item.get("choices", []))
            return cancelled.is_set() or bool(errors)

        self.server.handle_completions({**body, "stream": True}, on_chunk)
        return "".join(text), errors[0] if errors else None

    def _grammar_refusal(self, grammar: str) -> dict[str, Any] | None:
        """The engine's refusal of this grammar alone, or None: one token of a
        one-token prompt under it (a grammar is parsed as its slot starts)."""
        refused: list[dict[str, Any]] = []

        def on_chunk(chunk: Any) -> bool:
            refused.extend(c["error"] for c in (chunk if isinstance(chunk, list) else [chunk]) if "error" in c)
            return bool(refused)

        self.server.handle_completions({"prompt": "a", "max_tokens": 1, "temperature": 0.0,
                                        "grammar": grammar, "stream": True}, on_chunk)
        return refused[0] if refused else None

    def embed(self, inputs: list[str]) -> tuple[list[list[float]], int]:
        out = self.server.handle_embeddings({"input": inputs})
        if "error" in out:
            raise ValueError(str(out["error"].get("message", out["error"])))
        data = sorted(out["data"], key=lambda d: int(d["index"]))
        vectors = [[float(x) for x in d["embedding"]] for d in data]
        return vectors, int(out.get("usage", {}).get("prompt_tokens", 0))

    def close(self) -> None:
        """Nothing to release: the worker exits with ``os._exit``, and the OS
        frees the engine. Its destructor is never run: it can wait forever for
        a server loop that never started serving (seen with xllamacpp 2026.10)."""
