"""The model inside a worker: llama-cpp-python, driven token by token.

Generation uses ``Llama.generate()`` with our own prefill (so cancel is seen
between prefill batches) and our own detokenizer (constant cost per token).
Everything here runs in the worker's single generation thread.
"""

from __future__ import annotations

import ctypes
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llama_cpp
from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from worker.chat_template import ChatRenderer, TemplateError
from worker.detok import Detokenizer
from worker.grammar_guard import check_grammar, schema_to_grammar
from worker.protocol import Delta, Done, Error, Generate, ModelFacts, SamplingParams, Started

Emit = Callable[[Started | Delta | Done | Error], None]

CACHE_TYPES = {
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}


class LoadError(Exception):
    """The model cannot be loaded (bad file, missing file, does not fit)."""


@dataclass
class EngineOptions:
    model_path: str
    n_ctx: int
    n_gpu_layers: int
    n_threads: int
    embedding: bool
    cache_type: str = "f16"
    # Prompt-lookup (n-gram) speculative decoding: draft tokens per step; 0 = off.
    draft_ngram: int = 0


@dataclass
class Counters:
    requests_done: int = 0
    requests_cancelled: int = 0
    tokens_generated: int = 0


class Engine:
    def __init__(self, opts: EngineOptions) -> None:
        self.opts = opts
        self.counters = Counters()
        kwargs: dict[str, Any] = {
            "model_path": opts.model_path,
            "n_ctx": opts.n_ctx,
            "n_gpu_layers": opts.n_gpu_layers,
            "embedding": opts.embedding,
            "verbose": False,
        }
        if opts.n_threads > 0:
            kwargs["n_threads"] = opts.n_threads
        if opts.embedding:
            kwargs["pooling_type"] = llama_cpp.LLAMA_POOLING_TYPE_MEAN
        if opts.cache_type != "f16":
            ggml_type = CACHE_TYPES[opts.cache_type]
            # llama.cpp needs flash attention for a quantized V cache.
            kwargs.update(type_k=ggml_type, type_v=ggml_type, flash_attn=True)
        if opts.draft_ngram > 0:
            kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=opts.draft_ngram)
            # Drafting verifies with every position's logits; llama-cpp-python
            # sizes its logits buffer from this flag (n_ctx x n_vocab floats),
            # not from the draft model, so it must be set explicitly.
            kwargs["logits_all"] = True
        try:
            self.llm = llama_cpp.Llama(**kwargs)
        except (ValueError, RuntimeError, OSError) as exc:
            raise LoadError(f"cannot load {opts.model_path}: {exc}") from exc
        self._vocab = self.llm._model.vocab
        self._piece_buf = ctypes.create_string_buffer(256)
        template = self.llm.metadata.get("tokenizer.chat_template")
        self.renderer = ChatRenderer(template, self._token_text(self.llm.token_bos()),
                                     self._token_text(self.llm.token_eos()))
        self.facts = ModelFacts(
            path=opts.model_path,
            n_ctx=self.llm.n_ctx(),
            n_ctx_train=self.llm._model.n_ctx_train(),
            n_vocab=self.llm.n_vocab(),
            has_chat_template=template is not None,
            embedding=opts.embedding,
            chat_template=template,
        )

    # ------------------------------------------------------------ tokens

    def _piece(self, token: int, special: bool = False) -> bytes:
        n = llama_cpp.llama_token_to_piece(self._vocab, token, self._piece_buf, 256, 0, special)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._vocab, token, big, -n, 0, special)
            return bytes(big.raw[:n])
        return bytes(self._piece_buf.raw[:n])

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._piece(token, special=True).decode("utf-8", errors="replace")

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True)

    def _is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    # ------------------------------------------------------------ generation

    def prompt_text(self, req: Generate) -> tuple[str, list[str]]:
        if req.messages is not None:
            text = self.renderer.render(req.messages, req.tools, req.template_vars)
            return text, self.renderer.extra_stops
        return req.prompt or "", []

    def _grammar(self, params: SamplingParams) -> LlamaGrammar | None:
        # Bounded first: a too deep grammar crashes llama.cpp's parser.
        if params.grammar:
            return LlamaGrammar.from_string(check_grammar(params.grammar), verbose=False)
        if params.json_schema:
            return LlamaGrammar.from_string(schema_to_grammar(params.json_schema), verbose=False)
        if params.json_object:
            return LlamaGrammar.from_string(JSON_GBNF, verbose=False)
        return None

    def _prefill(self, tokens: list[int], cancelled: threading.Event) -> int | None:
        """Evaluate all but the last prompt token in batches; reuse a cached prefix.

        Returns the number of cached tokens, or None when cancelled. generate()
        then finds the evaluated prefix and only decodes the last token.
        """
        llm = self.llm
        common = 0
        limit = min(llm.n_tokens, len(tokens) - 1)
        ids = llm.input_ids
        while common < limit and ids[common] == tokens[common]:
            common += 1
        if common < llm.n_tokens:
            if not llm._ctx.kv_cache_seq_rm(-1, common, -1):
                common = 0
                llm.reset()  # type: ignore[no-untyped-call]
            llm.n_tokens = common
        cached = common
        todo = tokens[common:-1]
        step = llm.n_batch
        for i in range(0, len(todo), step):
            if cancelled.is_set():
                return None
            llm.eval(todo[i : i + step])
        return cached

    def generate(self, req: Generate, emit: Emit, cancelled: threading.Event) -> None:
        started = time.perf_counter()
        try:
            text, extra_stops = self.prompt_text(req)
            grammar = self._grammar(req.params)
        except TemplateError as exc:
            emit(Error(req.id, "template_error", str(exc)))
            return
        except (ValueError, RuntimeError, json.JSONDecodeError) as exc:
            emit(Error(req.id, "invalid_grammar", f"cannot build the output grammar: {exc}"))
            return
        tokens = self.tokenize(text)
        n_ctx = self.llm.n_ctx()
        if len(tokens) >= n_ctx:
            emit(Error(req.id, "context_length_exceeded",
                       f"the prompt has {len(tokens)} tokens; the model's context is {n_ctx}"))
            return
        if not tokens:
            tokens = [self.llm.token_bos()]
        emit(Started(req.id, len(tokens)))
        room = n_ctx - len(tokens)
        max_tokens = room if req.params.max_tokens is None else min(req.params.max_tokens, room)
        cached = self._prefill(tokens, cancelled)
        if cached is None:
            self.counters.requests_cancelled += 1
            emit(Done(req.id, "cancelled", len(tokens), 0, 0, time.perf_counter() - started, 0.0))
            return
        self._decode(req, tokens, cached, max_tokens, grammar, extra_stops, emit, cancelled, started)

    def _decode(
        self,
        req: Generate,
        tokens: list[int],
        cached: int,
        max_tokens: int,
        grammar: LlamaGrammar | None,
        extra_stops: list[str],
        emit: Emit,
        cancelled: threading.Event,
        started: float,
    ) -> None:
        p = req.params
        self.llm.set_seed(p.seed if p.seed is not None else llama_cpp.LLAMA_DEFAULT_SEED)
        detok = Detokenizer(self._piece, [*p.stop, *extra_stops])
        finish: str = "length"
        n = 0
        first_at: float | None = None
        gen = self.llm.generate(
            tokens, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, temp=p.temperature,
            repeat_penalty=p.repeat_penalty, frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty, grammar=grammar,
        )
        try:
            while n < max_tokens:
                token = next(gen)
                if first_at is None:
                    first_at = time.perf_counter()
                if cancelled.is_set():
                    finish = "cancelled"
                    break
                if self._is_eog(token) and not p.ignore_eos:
                    finish = "stop"
                    break
                n += 1
                piece = detok.push(token)
                if piece:
                    emit(Delta(req.id, piece, 1))
                if detok.stopped:
                    finish = "stop"
                    break
        finally:
            gen.close()
        tail = detok.flush()
        if tail:
            emit(Delta(req.id, tail, 0))
        now = time.perf_counter()
        first = first_at if first_at is not None else now
        self.counters.tokens_generated += n
        if finish == "cancelled":
            self.counters.requests_cancelled += 1
        else:
            self.counters.requests_done += 1
        emit(Done(req.id, finish, len(tokens), n, cached, first - started, now - first))  # type: ignore[arg-type]

    def embed(self, inputs: list[str]) -> tuple[list[list[float]], int]:
        vectors, count = self.llm.embed(inputs, normalize=True, return_count=True)
        return [list(map(float, v)) for v in vectors], int(count)
