"""The worker a load asks for: the :class:`WorkerSpec` built from the
model's settings, its memory fit (context, slots, RoPE scaling) and its GPU
placement, and whether a running worker already is what an explicit load
asks for (so that the load is a no-op instead of a reload).
"""

from __future__ import annotations

from pathlib import Path

from supervisor.config import ModelSettings
from supervisor.models.draft import SpeculativePlan
from supervisor.models.gpu_place import GpuPlacement
from supervisor.models.library import ModelEntry
from supervisor.models.memfit import ContextDecision
from supervisor.models.placement import FALLBACK_CTX
from supervisor.workers.handle import WorkerHandle
from supervisor.workers.spec import WorkerSpec
from worker.protocol import RopeOptions


def build_spec(key: tuple[str, bool], entry: ModelEntry, settings: ModelSettings,
               decision: ContextDecision | None, placed: GpuPlacement, plan: SpeculativePlan, *,
               parallel: int, n_threads: int, default_ctx: int, device: str, pinned: bool,
               vllm_python: str = "") -> WorkerSpec:
    """What the worker for ``key`` runs; ``pinned``: per-GPU devices, the worker
    is pinned to the GPUs it was placed on instead of running on ``device``.
    ``parallel``: its slots where there is no fit (an unreadable header)."""
    model_id, embedding = key
    n_ctx = decision.n_ctx if decision is not None else (settings.n_ctx or default_ctx or FALLBACK_CTX)
    rope = RopeOptions()
    if decision is not None and decision.rope_scaling == "yarn":
        rope = RopeOptions(freq_scale=decision.yarn_orig_ctx / decision.max_ctx,
                           yarn_orig_ctx=decision.yarn_orig_ctx)
    gpu_layers = settings.n_gpu_layers if settings.n_gpu_layers is not None else -1
    if decision is not None:
        gpu_layers = decision.n_gpu_layers  # fewer than asked with partial offload
    return WorkerSpec(model_id, Path(entry.path), embedding, n_ctx, gpu_layers,
                      n_threads, placed.devices[0] if pinned else device,
                      settings.cache_type or "f16",
                      plan.options, decision.slots if decision is not None else parallel,
                      # An embedding worker never takes images.
                      mmproj=Path(entry.mmproj) if entry.mmproj and not embedding else None,
                      lora=() if embedding else tuple(Path(a.path) for a in entry.adapters),
                      lora_versions=() if embedding else tuple((a.size_bytes, a.mtime) for a in entry.adapters),
                      devices=tuple(placed.devices) if pinned else (device,),
                      gpu_indices=tuple(placed.indices) if pinned else None,
                      tensor_split=tuple(placed.tensor_split),
                      # An hf model runs in a vLLM worker, from the vLLM environment.
                      engine="vllm" if entry.kind == "hf" else "llamacpp",
                      python=vllm_python if entry.kind == "hf" else "",
                      model_bytes=entry.size_bytes,
                      chat_template_file=Path(settings.chat_template_file) if settings.chat_template_file else None,
                      rope=rope, asked=load_ask(settings))


def load_ask(settings: ModelSettings) -> tuple[object, ...]:
    """What a load asked for beyond the context and layers: the slots (0 =
    automatic) and the RoPE scaling, as set (the fit derives the rest)."""
    return (settings.parallel or 0, settings.rope_scaling or "none", settings.rope_scale,
            settings.yarn_orig_ctx)


def unchanged(handle: WorkerHandle, entry: ModelEntry, options: ModelSettings | None,
              settings: ModelSettings, fit: ContextDecision | None) -> bool:
    """Does the running worker already run what a load with ``options`` asks for?

    ``fit`` is the worker's memory fit. An n_ctx is compared with the one
    that worker was asked for (its fit may have capped it).
    """
    if options is None:
        return True
    s = handle.spec
    ran_ctx = fit.requested if fit is not None and fit.requested is not None else s.n_ctx
    want_ctx = options.n_ctx if options.n_ctx is not None else ran_ctx
    want = (Path(entry.path), want_ctx, settings.n_gpu_layers, settings.cache_type, load_ask(settings))
    # Partial offload runs fewer GPU layers than were asked for: compare what was asked.
    asked = fit.n_gpu_layers_asked if fit is not None else s.n_gpu_layers
    template = Path(settings.chat_template_file) if settings.chat_template_file else None
    return want == (s.path, ran_ctx, asked, s.cache_type, s.asked) and template == s.chat_template_file
