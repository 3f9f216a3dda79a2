"""The vLLM engine: a Hugging Face model dir (kind ``hf``) served by vLLM's
``AsyncLLM``. Imported only by a worker started with ``--engine vllm``, from
the vLLM environment (``make install-vllm``), so torch never enters a
llama.cpp worker.

Threads (worker/engine_api.py says why): ``AsyncLLM`` lives on its own
asyncio loop in one dedicated thread, started at load and stopped in
:meth:`VllmEngine.close`. A request thread renders and tokenizes its prompt,
submits one coroutine to that loop and blocks until the coroutine has sent
the request's last message. A cancel sets the request's event; one sweeper
task on the engine's loop looks at the events of the requests in flight
every few milliseconds and cancels their tasks, and vLLM aborts a request
whose stream is cancelled (also in its prefill). The worker's own loop never
waits on the engine's.

Memory: vLLM gets an exact KV cache budget (``kv_cache_memory_bytes``), the
pages of ``n_ctx`` tokens for each of the ``parallel`` sequences, never its
default share of the device (90 % of a GPU, or of RAM on the CPU build).
The parent's fit (supervisor/models/hf_fit.py) sizes the same budget.

Embeddings: a worker loaded with ``--embedding`` runs vLLM's pooling runner
(``runner="pooling"``, a causal LM converted with ``convert="embed"``: the
last token's hidden state, normalised), one ``encode`` per input, all
inputs of a call in flight together so vLLM batches them.

Speculative decoding: vLLM's own (prompt lookup for ``ngram``, a draft
model dir for ``draft``), mapped in worker/vllm_speculative.py; the draft's
KV pages are part of the budget, and the drafting counters come from vLLM's
scheduler stats.

Images: a model vLLM serves as multimodal takes a request's images,
checked as on llama.cpp (worker/images.py: count, bytes, pixels, format),
decoded with PIL and passed as ``multi_modal_data`` beside the token
prompt. Each image part of a chat renders as the model's own placeholder
(vLLM's ``get_placeholder_str``), which vLLM's processor expands into the
image's feature tokens; a model without one (BLIP-2) gets nothing in the
text, and vLLM inserts its image tokens where the model wants them (BLIP-2:
its query tokens ahead of the prompt). A model with no chat template of its
own is prompted with vLLM's fallback for its model type where vLLM has one
(BLIP-2: "Question: ... Answer:", as vLLM's own server and examples prompt
it), else as any hf model.

What this engine does not do yet, and says so: audio, and a LoRA adapter
at a ``lora_scale`` other than 1 (vLLM applies an adapter as trained; 0
runs the base alone).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import itertools
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from formats.chat_templates import ChosenTemplate, TemplateFileError, choose_template
from worker.chat_template import ChatRenderer, TemplateError, override_template
from worker.engine_api import (
    Counters,
    Emit,
    EngineApi,
    EngineOptions,
    LoadError,
    Refused,
)
from worker.images import ImageError, check_images, placements
from worker.protocol import (
    MEDIA_MARKER,
    Delta,
    Done,
    Error,
    Generate,
    ModelFacts,
    Started,
)
from worker.vllm_params import (
    MAX_LOGPROBS,
    ConstraintError,
    logprobs,
    lora_rank,
    max_lora_rank,
    sampling,
)
from worker.vllm_speculative import (
    Unsupported,
    draft_kv_bytes_per_token,
    kv_values_per_layer,
    speculative_config,
)
from worker.vllm_speculative import factory as draft_counter

# vLLM spawns its engine core process; fork would copy our threads' state.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

from PIL import Image
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.model_executor.model_loader import get_model_cls
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.platforms import current_platform
from vllm.pooling_params import PoolingParams
from vllm.transformers_utils.chat_templates import get_chat_template_fallback_path
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

log = logging.getLogger("gpuvisor.worker")
T = TypeVar("T")
# How often the sweeper looks for cancelled requests.
CANCEL_SWEEP_S = 0.005
# Exit code when vLLM's engine core died: a crash, the parent restarts us.
EXIT_ENGINE_DEAD = 70
Finish = Literal["stop", "length", "cancelled"]
_FINISH: dict[str, Finish] = {"stop": "stop", "length": "length", "abort": "cancelled"}


def load(opts: EngineOptions) -> EngineApi:
    """This engine's entry in the registry (worker/engine_api.py)."""
    return VllmEngine(opts)


class _Loop:
    """An asyncio loop running in its own thread, owned by the engine."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-loop", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class _GroupReaper:
    """Kills this worker's process group once the parent is gone.

    vLLM's engine-core process does not watch us: when the parent dies, the
    worker exits at its stdin's EOF (worker/server.py) and the engine core
    would live on, orphaned. This small process shares our stdin (the
    parent's end, written by nobody) and our process group; at the EOF it
    kills the whole group, itself included. While the parent lives, it kills
    the group whenever the worker ends (supervisor/workers/process.py).
    """

    CODE = ("import os, signal\n"
            "while os.read(0, 65536):\n"
            "    pass\n"
            "os.killpg(os.getpgrp(), signal.SIGKILL)\n")

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        if not self.wanted():
            return
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", self.CODE],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @staticmethod
    def wanted() -> bool:
        """Only in a worker as the parent starts it: leading its own process
        group, its stdin the parent's pipe. Elsewhere (the engine loaded in
        a script, stdin a terminal or /dev/null) the group is not ours to kill."""
        try:
            mode = os.fstat(0).st_mode
        except OSError:
            return False
        return os.getpgrp() == os.getpid() and (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class _Request:
    """One generation in flight on the engine's loop."""

    req: Generate
    emit: Emit
    cancelled: threading.Event
    prompt_ids: list[int]
    params: Any  # vLLM's SamplingParams
    lora: LoRARequest | None
    images: list[Any] = field(default_factory=list)  # decoded, in the prompt's order
    ended: threading.Event = field(default_factory=threading.Event)
    task: asyncio.Task[None] | None = None
    started_at: float = field(default_factory=time.perf_counter)


def kv_budget(vllm_config: Any, n_ctx: int, parallel: int) -> int:
    """Bytes of KV pages for ``parallel`` sequences of ``n_ctx`` tokens, from
    vLLM's own view of the model (layers, KV heads, head size, MLA or not,
    dtype, block size), and of its draft model's when one drafts (their
    pages share the one budget).

    Plus one page: vLLM's block pool holds one back for good (its null
    block) and refuses to start unless a sequence of ``n_ctx`` tokens fits in
    the rest, so an exact budget for one sequence failed every load with
    ``parallel`` 1 (and left the last of several sequences a page short).
    supervisor/models/hf_fit.py counts the same page."""
    model = vllm_config.model_config
    block = int(vllm_config.cache_config.block_size or 16)
    layers = model.get_num_layers(vllm_config.parallel_config)
    per_token = layers * kv_values_per_layer(model, vllm_config.parallel_config)
    per_token_bytes = per_token * model.dtype.itemsize + draft_kv_bytes_per_token(vllm_config)
    pages = -(-n_ctx // block) * max(1, parallel) + 1
    return int(per_token_bytes * block * pages)


class VllmEngine:
    """vLLM's AsyncLLM holding one model; an ``EngineApi``."""

    def __init__(self, opts: EngineOptions) -> None:
        self.opts = opts
        try:
            override = override_template(opts.chat_template_file)
        except TemplateFileError as exc:
            raise LoadError(f"chat_template_file: {exc}") from exc
        self.counters = Counters()
        self._ids = itertools.count(1)
        self._active: dict[int, _Request] = {}
        self._busy: asyncio.Event | None = None  # set while requests are in flight (the sweeper's)
        self._tok_lock = threading.Lock()
        self._loras = {path: LoRARequest(f"adapter-{i}", i, path) for i, path in enumerate(opts.lora, 1)}
        self._reaper = _GroupReaper()
        self._loop = _Loop()
        try:
            args = self._engine_args(opts)
            self.llm, self.kv_bytes = self._loop.run(self._start(args, self.counters))
        except (RuntimeError, ValueError, OSError, VLLMClientError, Unsupported) as exc:
            self._loop.stop()
            self._reaper.stop()
            raise LoadError(f"cannot load {opts.model_path} with vLLM: {exc}") from exc
        self._sweeper = self._loop.submit(self._sweep())
        self.tokenizer = self.llm.get_tokenizer()
        template = getattr(self.tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else None
        model = self.llm.model_config
        model_type = str(getattr(model.hf_config, "model_type", "") or "")
        chosen = (_vllm_fallback_template(model_type, opts.model_path) if template is None and override is None
                  else None) or choose_template(template, model_type, self.tokenizer.get_vocab().__contains__,
                                                override)
        self.image_limit, self.placeholder = _image_support(model)
        self.renderer = ChatRenderer.of(chosen, str(self.tokenizer.bos_token or ""),
                                        str(self.tokenizer.eos_token or ""))
        self.n_ctx = int(model.max_model_len)
        self.facts = ModelFacts(
            path=opts.model_path, n_ctx=self.n_ctx,
            n_ctx_train=int(getattr(model.hf_text_config, "max_position_embeddings", self.n_ctx)),
            n_vocab=int(model.get_vocab_size()), has_chat_template=template is not None,
            embedding=opts.embedding, chat_template=chosen.text, adapters=list(self._loras),
            template_source=chosen.source, template_name=chosen.name, vision=self.image_limit > 0,
        )
        log.info("vLLM engine ready: max_model_len %d, %d sequences, KV cache budget %d bytes",
                 self.n_ctx, opts.parallel, self.kv_bytes)

    @staticmethod
    def _engine_args(opts: EngineOptions) -> AsyncEngineArgs:
        ranks = [lora_rank(p) for p in opts.lora]
        # An embedding worker: the pooling runner on the same weights, no adapters.
        pooling: dict[str, Any] = {"runner": "pooling", "convert": "embed"} if opts.embedding else {}
        return AsyncEngineArgs(
            model=opts.model_path, max_model_len=opts.n_ctx, max_num_seqs=max(1, opts.parallel),
            # CUDA graphs take minutes to capture on the CPU build and buy nothing there.
            enforce_eager=current_platform.is_cpu(), seed=0, disable_log_stats=True,
            # Sampling defaults come from our request, never the model's generation_config.json.
            generation_config="vllm", max_logprobs=MAX_LOGPROBS,
            enable_lora=bool(opts.lora), max_loras=max(1, len(opts.lora)),
            max_lora_rank=max_lora_rank(ranks),
            # An embedding worker generates nothing, so nothing drafts.
            speculative_config=None if opts.embedding else speculative_config(opts.speculative), **pooling,
        )

    @staticmethod
    async def _start(args: AsyncEngineArgs, counters: Counters | None = None) -> tuple[Any, int]:
        """AsyncLLM on this loop, with our exact KV budget (vLLM's engine
        config first, for its block size and its view of the model). With
        drafting on and ``counters`` given, vLLM's per-step stats feed them;
        otherwise vLLM keeps no stats at all."""
        config = args.create_engine_config()
        budget = kv_budget(config, args.max_model_len, args.max_num_seqs or 1)
        config.cache_config.kv_cache_memory_bytes = budget
        loggers = [draft_counter(counters)] if counters is not None and config.speculative_config else None
        return AsyncLLM.from_vllm_config(config, disable_log_stats=True, stat_loggers=loggers), budget

    # ---------------------------------------------------------- requests

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        with self._tok_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special))

    def _prompt(self, req: Generate) -> tuple[list[int], list[str], list[Any]]:
        """Token ids, extra stop strings and the decoded images. A rendered
        chat prompt carries its own special tokens (as with transformers'
        apply_chat_template)."""
        images: list[Any] = []
        if req.images or (req.messages is not None and placements(req) > 0):
            check_images(req, vision=self.image_limit > 0, audio=False,
                         why="vLLM does not serve this model as multimodal")
            if len(req.images) > self.image_limit:
                raise ImageError("too_many_images", f"{len(req.images)} images; this model takes at most "
                                                    f"{self.image_limit} per request")
            images = [_decode(i, data) for i, data in enumerate(req.images)]
        if req.messages is not None:
            try:
                text = self.renderer.render(req.messages, req.tools, req.template_vars, MEDIA_MARKER)
            except ValueError as exc:
                raise TemplateError(str(exc)) from exc
            return self.tokenize(self._place(text, images), add_special=False), self.renderer.extra_stops, images
        return self.tokenize(self._place(req.prompt or "", images), add_special=True), [], images

    def _place(self, text: str, images: list[Any]) -> str:
        """Each image's marker as the model's placeholder for it (vLLM numbers
        them from 1); none at all for a model that has none. Text without
        images is left as it is, markers and all, as it was before."""
        if not images:
            return text
        pieces = text.split(MEDIA_MARKER)
        out = [pieces[0]]
        for i, piece in enumerate(pieces[1:], 1):
            out.append(self.placeholder(i))
            out.append(piece)
        return "".join(out)

    def generate(self, req: Generate, emit: Emit, cancelled: threading.Event) -> None:
        try:
            ids, extra_stops, images = self._prompt(req)
            lora = self._lora(req)
        except ImageError as exc:
            emit(exc.reply(req.id))
            return
        except TemplateError as exc:
            emit(Error(req.id, "template_error", str(exc)))
            return
        except _AdapterMissing as exc:
            emit(Error(req.id, "adapter_unavailable", str(exc)))
            return
        except _AdapterScale as exc:
            emit(Error(req.id, "invalid_request", str(exc)))
            return
        if len(ids) >= self.n_ctx:
            emit(Error(req.id, "context_length_exceeded",
                       f"the prompt has {len(ids)} tokens; the model's context is {self.n_ctx}"))
            return
        room = self.n_ctx - len(ids)
        max_tokens = room if req.params.max_tokens is None else min(req.params.max_tokens, room)
        try:
            params = sampling(req.params, max_tokens=max(1, max_tokens), stops=[*req.params.stop, *extra_stops])
        except ConstraintError as exc:
            emit(Error(req.id, "invalid_grammar", f"cannot build the output constraint: {exc}"))
            return
        except (ValueError, VLLMClientError) as exc:
            emit(Error(req.id, "invalid_request", f"vLLM does not take these sampling parameters: {exc}"))
            return
        run = _Request(req, emit, cancelled, ids, params, lora, images)
        self._loop.submit(self._run(run))
        run.ended.wait()

    def _lora(self, req: Generate) -> LoRARequest | None:
        if not req.adapter:
            return None
        lora = self._loras.get(req.adapter)
        if lora is None:
            raise _AdapterMissing(f"this worker holds no adapter {req.adapter}")
        # vLLM applies an adapter as trained: no per-request scale but none at all.
        if req.adapter_scale == 0.0:
            return None
        if req.adapter_scale != 1.0:
            raise _AdapterScale(f"the vllm engine applies a LoRA adapter at lora_scale 1 (or 0: the base "
                                f"alone), not {req.adapter_scale:g}")
        return lora

    async def _run(self, run: _Request) -> None:
        run.task = asyncio.current_task()
        self._active[run.req.id] = run
        if self._busy is not None:
            self._busy.set()
        try:
            await self._stream(run)
        finally:
            self._active.pop(run.req.id, None)
            run.ended.set()

    async def _stream(self, run: _Request) -> None:
        req, emit = run.req, run.emit
        rid = f"{req.request_id or 'req'}-{next(self._ids)}"
        generated = cached = 0
        finish: Finish = "length"
        first_at: float | None = None
        prompt = TokensPrompt(prompt_token_ids=run.prompt_ids)
        if run.images:
            prompt["multi_modal_data"] = {"image": run.images if len(run.images) > 1 else run.images[0]}
        prompt_tokens = len(run.prompt_ids)
        try:
            async for out in self.llm.generate(prompt, run.params, rid, lora_request=run.lora):
                if first_at is None:
                    first_at = time.perf_counter()
                    # vLLM's prompt holds the images' feature tokens too.
                    prompt_tokens = len(out.prompt_token_ids or run.prompt_ids)
                    emit(Started(req.id, prompt_tokens))
                comp = out.outputs[0]
                ids = list(comp.token_ids)
                cached = int(out.num_cached_tokens or 0)
                if comp.text or ids:
                    probs = None if req.params.logprobs is None else logprobs(ids, comp.logprobs, req.params.logprobs)
                    emit(Delta(req.id, comp.text, len(ids), probs))
                    generated += len(ids)
                if comp.finish_reason:
                    finish = _FINISH.get(comp.finish_reason, "stop")
        except asyncio.CancelledError:
            finish = "cancelled"  # vLLM aborted the request as its stream was cancelled
        except EngineDeadError:
            log.critical("vLLM's engine core died; the worker exits for the parent to restart it")
            os._exit(EXIT_ENGINE_DEAD)
        except (VLLMClientError, ValueError) as exc:
            code = "invalid_grammar" if run.params.structured_outputs is not None else "invalid_request"
            emit(Error(req.id, code if first_at is None else "engine_error", str(exc)))
            return
        now = time.perf_counter()
        first = first_at if first_at is not None else now
        self.counters.count(finish, generated)
        emit(Done(req.id, finish, prompt_tokens, generated, cached, first - run.started_at, now - first))

    async def _sweep(self) -> None:
        """Cancel the tasks of requests whose cancel event is set; idle while none are in flight."""
        self._busy = asyncio.Event()
        while True:
            if not self._active:
                self._busy.clear()
                await self._busy.wait()
            await asyncio.sleep(CANCEL_SWEEP_S)
            for run in list(self._active.values()):
                if run.cancelled.is_set() and run.task is not None and not run.task.cancelling():
                    run.task.cancel()

    def embed(self, inputs: list[str]) -> tuple[list[list[float]], int]:
        prompts = [self.tokenize(text, add_special=True) for text in inputs]
        for i, ids in enumerate(prompts):
            if not ids:
                raise Refused("invalid_request", f"input {i} has no tokens to embed")
            if len(ids) > self.n_ctx:
                raise Refused("context_length_exceeded",
                              f"input {i} has {len(ids)} tokens; the model's context is {self.n_ctx}")
        vectors = self._loop.run(self._embed_all(prompts))
        return vectors, sum(len(ids) for ids in prompts)

    async def _embed_all(self, prompts: list[list[int]]) -> list[list[float]]:
        base = next(self._ids)
        return list(await asyncio.gather(*(self._embed_one(ids, f"embed-{base}-{i}")
                                           for i, ids in enumerate(prompts))))

    async def _embed_one(self, ids: list[int], rid: str) -> list[float]:
        last: Any = None
        try:
            async for out in self.llm.encode(TokensPrompt(prompt_token_ids=ids), PoolingParams(task="embed"), rid):
                last = out
        except EngineDeadError:
            log.critical("vLLM's engine core died; the worker exits for the parent to restart it")
            os._exit(EXIT_ENGINE_DEAD)
        except (VLLMClientError, ValueError) as exc:
            raise Refused("invalid_request", str(exc)) from exc
        if last is None or getattr(last, "error", None) is not None:
            raise RuntimeError(f"vLLM returned no embedding for {rid}: {getattr(last, 'error', None)}")
        return [float(x) for x in last.outputs.data.tolist()]

    def close(self) -> None:
        """Stop the sweeper, vLLM's engine core process, the loop thread and the reaper."""
        self._sweeper.cancel()
        self._loop.loop.call_soon_threadsafe(self.llm.shutdown)
        self._loop.stop()
        self._reaper.stop()


def _vllm_fallback_template(model_type: str, model_path: str) -> ChosenTemplate | None:
    """vLLM's own template for a model type that ships none (BLIP-2's
    "Question: ... Answer:"), so such a model is prompted as vLLM's server
    prompts it rather than in ChatML it never saw."""
    path = get_chat_template_fallback_path(model_type, model_path)
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LoadError(f"cannot read vLLM's chat template for {model_type}: {exc}") from exc
    return ChosenTemplate("architecture", text, f"vllm-{model_type}")


def _image_support(model: Any) -> tuple[int, Callable[[int], str]]:
    """How many images one prompt may hold (0: none) and the model's
    placeholder for image ``i`` ("" where vLLM inserts the image tokens
    itself), from vLLM's view of the model."""
    if not model.is_multimodal_model:
        return 0, lambda i: ""
    limit = int(MULTIMODAL_REGISTRY.get_processing_info(model).allowed_mm_limits.get("image", 0))
    cls = get_model_cls(model)

    def placeholder(i: int) -> str:
        return str(cls.get_placeholder_str("image", i) or "")

    return limit, placeholder


def _decode(i: int, data: bytes) -> Any:
    """An RGB image from checked bytes (worker/images.py read their header
    and bounded their pixels); a corrupt body is the request's 400."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError("invalid_image", f"image {i} cannot be decoded: {exc}") from exc


class _AdapterMissing(Exception):
    """A request names an adapter this worker does not hold."""


class _AdapterScale(Exception):
    """A request asks for an adapter scale vLLM cannot apply."""
