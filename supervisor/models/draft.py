"""Speculative decoding at load time, parent side: the mode in effect, the
draft model from the library, the vocabulary check, and the draft's memory.

:func:`plan_speculative` turns a model's settings into the options its worker
runs with, or refuses them with a 400/404 naming the setting before any
worker is started or evicted. The engine checks vocabularies again when it
loads the draft; that check stands behind ours, which only reads headers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from supervisor.config import ModelSettings
from supervisor.errors import BadRequest, ModelNotFound
from supervisor.models.gguf_header import GgufError
from supervisor.models.hf_draft import check_hf_draft
from supervisor.models.hf_fit import mtp_draft
from supervisor.models.hf_info import HfInfo
from supervisor.models.kvsize import (
    KvOptions,
    compute_buffer_bytes,
    kv_cache_bytes,
    kv_layer_bytes,
)
from supervisor.models.library import ModelEntry
from supervisor.models.vocab import vocab_difference
from worker.protocol import SpeculativeOptions

# Upper bounds of the tokens drafted per step when draft_max is unset, for
# sizing (this engine defaults to 3 for a draft model and 48 for prompt lookup).
DEFAULT_DRAFT_MAX = 16
DEFAULT_NGRAM_MAX = 48


class DraftSource(Protocol):
    def entry(self, model_id: str) -> ModelEntry | None: ...


class VocabMismatch(BadRequest):
    code = "draft_vocab_mismatch"


@dataclass(frozen=True)
class SpeculativePlan:
    """What a worker runs with, and the library entry of its draft model."""

    options: SpeculativeOptions = SpeculativeOptions()
    draft: ModelEntry | None = field(default=None, compare=False)

    @property
    def draft_id(self) -> str | None:
        return None if self.draft is None else self.draft.id


def mtp_layers(entry: ModelEntry) -> int:
    """The model's own MTP layers: a GGUF's NextN layers, an hf checkpoint's MTP layers."""
    if entry.hf is not None:
        return entry.hf.mtp_layers
    return entry.info.nextn_predict_layers if entry.info is not None else 0


def has_mtp(entry: ModelEntry) -> bool:
    return mtp_layers(entry) > 0


def plan_speculative(entry: ModelEntry, settings: ModelSettings, models: DraftSource,
                     embedding: bool = False) -> SpeculativePlan:
    """The speculative options for ``entry``; raises BadRequest/ModelNotFound
    naming the setting. Reads GGUF headers: call it in a thread."""
    problem = settings.speculative_problem()
    if problem is not None:
        raise BadRequest(problem[1], param=problem[0])
    mode = settings.speculative_mode()
    if embedding or mode == "off":
        # An embedding worker generates nothing, so there is nothing to draft.
        return SpeculativePlan()
    if mode == "auto":
        mode = "draft" if settings.draft_model else ("mtp" if has_mtp(entry) else "off")
    low, high = settings.draft_lengths()
    if mode == "off":
        return SpeculativePlan()
    if mode == "mtp" and not has_mtp(entry):
        where = ("its config.json declares none, or its weights hold none" if entry.kind == "hf"
                 else "its header sets no nextn_predict_layers")
        raise BadRequest(f"model '{entry.id}' has no MTP layers ({where}); "
                         'use speculative = "draft" with a draft_model, or "ngram"',
                         param="speculative", code="mtp_unavailable")
    if mode == "mtp" and entry.kind == "hf":
        # vLLM must be told how many tokens to draft; its MTP layers' own count
        # is what the checkpoint was trained to predict.
        high = high or mtp_layers(entry)
        check_mtp_steps(entry, high)
    if mode != "draft":
        return SpeculativePlan(SpeculativeOptions(mode, "", low, high))
    if entry.kind == "hf":
        # vLLM's draft_model: a Hugging Face model dir of the same vocabulary,
        # or an EAGLE head, which vLLM runs as its own method.
        draft = usable_entry(settings.draft_model or "", models, heads=True)
        check_hf_draft(entry, draft)
        method = draft.hf.draft_head if draft.hf is not None and draft.hf.draft_head else "draft"
        return SpeculativePlan(SpeculativeOptions(method, draft.path, low, high), draft)
    draft = draft_entry(settings.draft_model or "", models)
    check_vocab(entry, draft)
    return SpeculativePlan(SpeculativeOptions("draft", draft.path, low, high), draft)


def check_mtp_steps(entry: ModelEntry, draft_max: int) -> None:
    """vLLM runs a checkpoint's MTP layers in turn, one drafted token each, so
    it drafts any multiple of their count (or fewer tokens than there are
    layers) and refuses to load otherwise; refused here first, naming draft_max."""
    layers = mtp_layers(entry)
    if draft_max > layers and draft_max % layers:
        raise BadRequest(f"model '{entry.id}' has {layers} MTP layers; vLLM drafts with them in turn, so "
                         f"draft_max must be at most {layers} or a multiple of it, not {draft_max}",
                         param="draft_max")


def hf_draft_info(entry: ModelEntry, plan: SpeculativePlan | None) -> HfInfo | None:
    """What drafts beside an hf model, for its fit (supervisor/models/hf_fit.py):
    the draft model's facts, or the model's own MTP layers as a draft."""
    if plan is None or entry.hf is None:
        return None
    if plan.options.mode == "mtp":
        return mtp_draft(entry.hf)
    return plan.draft.hf if plan.draft is not None else None


def usable_entry(draft_id: str, models: DraftSource, heads: bool = False) -> ModelEntry:
    """The library entry of a draft model, refused (naming draft_model) unless
    usable; with ``heads``, an EAGLE head too (unusable alone, by design)."""
    draft = models.entry(draft_id)
    if draft is None:
        raise ModelNotFound(f"draft_model '{draft_id}' does not exist in the model library",
                            param="draft_model")
    if heads and draft.hf is not None and draft.hf.draft_head is not None:
        return draft
    if not draft.usable:
        raise BadRequest(f"draft_model '{draft_id}' cannot be used: {draft.reason or 'unusable'}",
                         param="draft_model", code="draft_unusable")
    return draft


def draft_entry(draft_id: str, models: DraftSource) -> ModelEntry:
    """The GGUF entry of a draft model for a GGUF target, refused (naming draft_model) unless usable."""
    draft = usable_entry(draft_id, models)
    if draft.kind == "hf":
        raise BadRequest(f"draft_model '{draft_id}' is a Hugging Face model dir; a GGUF model drafts with "
                         "a GGUF", param="draft_model", code="draft_unusable")
    if draft.info is None:
        raise BadRequest(f"draft_model '{draft_id}' cannot be used: {draft.reason or 'its header is unreadable'}",
                         param="draft_model", code="draft_unusable")
    if draft.info.is_projector:
        raise BadRequest(f"draft_model '{draft_id}' is a vision projector, not a language model",
                         param="draft_model", code="draft_unusable")
    if len(draft.files) > 1:
        # The engine loads a draft from one path; a split draft is refused here, not half-loaded.
        raise BadRequest(f"draft_model '{draft_id}' is split into {len(draft.files)} files; "
                         "use a single-file GGUF", param="draft_model", code="draft_unusable")
    return draft


def check_vocab(target: ModelEntry, draft: ModelEntry) -> None:
    try:
        why = vocab_difference(Path(target.path), Path(draft.path))
    except GgufError as exc:
        raise BadRequest(f"cannot compare the vocabularies of '{target.id}' and draft_model '{draft.id}': "
                         f"{exc.reason}", param="draft_model", code="draft_unusable") from exc
    if why is not None:
        raise VocabMismatch(f"draft_model '{draft.id}' does not share the vocabulary of '{target.id}': {why}",
                            param="draft_model")


def draft_outputs(settings: ModelSettings) -> int:
    """Draft tokens a slot verifies per step at most (0 when drafting is off)."""
    mode = settings.speculative_mode()
    if mode == "off":
        return 0
    most = settings.draft_lengths()[1]
    return most or (DEFAULT_NGRAM_MAX if mode == "ngram" else DEFAULT_DRAFT_MAX)


def draft_bytes(entry: ModelEntry, plan: SpeculativePlan | None, *, n_ctx: int, slots: int) -> int:
    """Memory drafting takes beside the model, for ``n_ctx`` tokens in each slot.

    A draft model: its weights (all on the model's device), its f16 KV cache
    (the engine's default for a draft) and its compute buffer. MTP: the
    engine runs the NextN layers in a context of their own, so their KV
    cache (which the model's own estimate leaves out) and that context's
    compute buffer. Zero when nothing drafts or prompt lookup does."""
    if plan is None or plan.options.mode not in ("draft", "mtp"):
        return 0
    opts = KvOptions(slots=max(1, slots), n_outputs=1 + (plan.options.draft_max or DEFAULT_DRAFT_MAX))
    if plan.options.mode == "mtp":
        info = entry.info
        if info is None:
            return 0
        widest = max(kv_layer_bytes(info, n_ctx, opts), default=0)
        return info.nextn_predict_layers * widest + compute_buffer_bytes(info, n_ctx, opts)
    if plan.draft is None or plan.draft.info is None:
        return 0
    info = plan.draft.info
    return plan.draft.size_bytes + kv_cache_bytes(info, n_ctx, opts).total + compute_buffer_bytes(info, n_ctx, opts)
