"""The engine's settings for one worker: ``xllamacpp.CommonParams`` from the
worker's options (context per slot, cache types, layers and their split over
GPUs, the projector, speculative decoding, YaRN scaling, LoRA adapters).

Apart from the engine itself so that the memory fit's tests and the
benchmarks build exactly the settings a worker runs with. The options
themselves are engine-free (``EngineOptions``, worker/engine_api.py).
"""

from __future__ import annotations

import xllamacpp

from worker.adapters import AdapterSet
from worker.engine_api import EngineOptions
from worker.protocol import RopeOptions, SpeculativeOptions

CACHE_TYPES = {
    "f16": xllamacpp.ggml_type.GGML_TYPE_F16,
    "q8_0": xllamacpp.ggml_type.GGML_TYPE_Q8_0,
    "q4_0": xllamacpp.ggml_type.GGML_TYPE_Q4_0,
}
# Prompt tokens evaluated per engine step. The engine reports prefill progress
# once per step, and that report is the only point where a cancel is seen
# during a long prefill; by then it has begun the next step, so a cancelled
# prefill runs on for up to two of them (measured: bench/engine.py).
PREFILL_BATCH = 512
_SPECULATIVE_TYPES = {
    "draft": xllamacpp.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE,
    "mtp": xllamacpp.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_MTP,
    "ngram": xllamacpp.common_speculative_type.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE,
}


def apply_speculative(p: xllamacpp.CommonParams, spec: SpeculativeOptions, n_gpu_layers: int) -> None:
    """Set the engine's speculative parameters (nothing when off)."""
    if spec.mode == "off":
        return
    if spec.mode not in _SPECULATIVE_TYPES:
        # EAGLE heads are vLLM's; the parent never plans one for a GGUF.
        raise ValueError(f"speculative mode {spec.mode} runs on the vllm engine only")
    p.speculative.types = [_SPECULATIVE_TYPES[spec.mode]]
    if spec.mode == "ngram":
        # Prompt lookup drafts up to size_m tokens after a match of the last size_n.
        if spec.draft_max:
            p.speculative.ngram_simple.size_m = spec.draft_max
        return
    draft = p.speculative.draft
    if spec.draft_min:
        draft.n_min = spec.draft_min
    if spec.draft_max:
        draft.n_max = spec.draft_max
    if spec.mode == "mtp":
        # The MTP head lives in the target's own file; loading it is opt-in.
        p.load_mtp = True
        return
    draft.mparams.path = spec.draft_model
    # The draft sits where the target does: all on the GPU, or all on the CPU.
    draft.n_gpu_layers = -1 if n_gpu_layers != 0 else 0


# The engine's tensor_split is a fixed array: one share per possible device.
ENGINE_MAX_DEVICES = 128


def apply_tensor_split(p: xllamacpp.CommonParams, shares: tuple[float, ...]) -> None:
    """Split the layers over the visible GPUs in these shares (whole layers per GPU)."""
    if len(shares) < 2:
        return
    if len(shares) > ENGINE_MAX_DEVICES:
        raise ValueError(f"tensor split over {len(shares)} GPUs; the engine takes {ENGINE_MAX_DEVICES}")
    p.tensor_split = [*shares, *([0.0] * (ENGINE_MAX_DEVICES - len(shares)))]
    p.split_mode = xllamacpp.llama_split_mode.LLAMA_SPLIT_MODE_LAYER


def apply_rope(p: xllamacpp.CommonParams, rope: RopeOptions) -> None:
    """YaRN past the native context: the engine then raises its training
    context to yarn_orig_ctx / freq_scale and lets a slot have that much
    (supervisor/models/rope.py); nothing when none was asked for."""
    if not rope.freq_scale:
        return
    p.rope_scaling_type = xllamacpp.llama_rope_scaling_type.LLAMA_ROPE_SCALING_TYPE_YARN
    p.rope_freq_scale = rope.freq_scale
    p.yarn_orig_ctx = rope.yarn_orig_ctx


def engine_params(opts: EngineOptions, mmproj: str = "",
                  adapters: AdapterSet | None = None) -> xllamacpp.CommonParams:
    p = xllamacpp.CommonParams()
    p.model.path = opts.model_path
    parallel = max(1, opts.parallel)
    # Every slot gets the full per-request context (as Ollama does): the
    # engine splits n_ctx evenly among slots, and memfit counts all of them.
    p.n_parallel = parallel
    p.n_ctx = opts.n_ctx * parallel
    # Embeddings of several inputs in one batch came out wrong with per-slot
    # caches (measured: xllamacpp 2026.10, mean pooling); a unified cache
    # gives the same vectors as one input at a time.
    p.kv_unified = opts.embedding
    # Fitting is ours (memfit): the engine must not change n_ctx or layers.
    p.fit_params = False
    # Sliding-window layers keep only their window, as memfit assumes.
    p.swa_full = False
    p.ctx_shift = False
    p.n_gpu_layers = opts.n_gpu_layers
    apply_tensor_split(p, opts.tensor_split)
    p.n_batch = PREFILL_BATCH
    p.n_ubatch = PREFILL_BATCH
    p.warmup = False
    p.n_threads_http = 2
    # We render prompts ourselves; the engine's own Jinja parse of the model's
    # template refuses some real templates at load, and would fail the model.
    p.use_jinja = False
    p.chat_template = "chatml"
    if opts.n_threads > 0:
        p.cpuparams.n_threads = opts.n_threads
        p.cpuparams_batch.n_threads = opts.n_threads
    if opts.embedding:
        p.embedding = True
        p.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN
    if opts.cache_type != "f16":
        p.cache_type_k = CACHE_TYPES[opts.cache_type]
        p.cache_type_v = CACHE_TYPES[opts.cache_type]
    # Flash attention always (a quantized V cache needs it anyway). "Auto"
    # turns it off for the whole model when a layer's attention lands on
    # another device than the layer (partial offload, or a head size without
    # a GPU kernel); the compute buffer then grows by a layer's attention
    # scores, which memfit does not plan for. Forced on, such an op just runs
    # on the device that has the kernel.
    p.flash_attn_type = xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_ENABLED
    apply_speculative(p, opts.speculative, opts.n_gpu_layers)
    apply_rope(p, opts.rope)
    p.hostnames = [opts.engine_socket]
    if mmproj:
        p.mmproj.path = mmproj
        # A CPU-only model keeps its projector on the CPU too.
        p.mmproj_use_gpu = opts.n_gpu_layers != 0
        # Requests with images stream over the listener, one HTTP thread
        # each for their whole generation, beside tokenize calls.
        p.n_threads_http = 2 + max(1, opts.parallel)
    if adapters is not None:
        adapters.configure(p)
    return p
