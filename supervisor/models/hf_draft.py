"""A draft model for an ``hf`` target (vLLM's ``draft_model`` speculative
decoding, or its EAGLE heads), parent side: which library entry drafts, and
whether it shares the target's vocabulary.

An EAGLE head (supervisor/models/hf_info.py's ``draft_head``) is listed but
unusable on its own; as a draft it must also have the target's hidden size
(its ``fc`` takes the target's hidden state), and vLLM runs it as
``method="eagle"`` or ``"eagle3"``, sharing the target's embedding and LM
head where the head has none.

vLLM verifies every drafted token id with the target, so a draft must number
its tokens as the target does: the same ``vocab_size`` in config.json, and,
where both dirs hold one, the same tokenizer file (byte for byte; a
fine-tune or a smaller sibling of one family ships the same file). The
engine checks again when it loads the draft; this check only answers sooner,
with a 400 naming ``draft_model``, before any worker is started or evicted.
Its memory is in supervisor/models/hf_fit.py (``draft``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from supervisor.errors import BadRequest
from supervisor.models.entry import ModelEntry

# The tokenizer files compared, first found in both dirs wins.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# Bytes read at most per tokenizer file (a hostile dir cannot make us read more).
MAX_TOKENIZER_BYTES = 256 << 20


def check_hf_draft(target: ModelEntry, draft: ModelEntry) -> None:
    """Raise a 400 naming ``draft_model`` unless ``draft`` can draft for ``target``."""
    if draft.kind != "hf" or draft.hf is None:
        raise BadRequest(f"draft_model '{draft.id}' is a GGUF; '{target.id}' runs in vLLM, which drafts with "
                         "a Hugging Face model dir of the same vocabulary", param="draft_model",
                         code="draft_unusable")
    if draft.id == target.id:
        raise BadRequest(f"draft_model '{draft.id}' is the model itself", param="draft_model",
                         code="draft_unusable")
    assert target.hf is not None  # an hf entry with no facts is unusable, refused before this
    if draft.hf.draft_head is not None and draft.hf.hidden_size != target.hf.hidden_size:
        raise BadRequest(f"draft_model '{draft.id}' is an {draft.hf.draft_head.upper()} head for a hidden size "
                         f"of {draft.hf.hidden_size}; '{target.id}' has {target.hf.hidden_size}",
                         param="draft_model", code="draft_unusable")
    if draft.hf.vocab_size != target.hf.vocab_size:
        raise BadRequest(f"draft_model '{draft.id}' does not share the vocabulary of '{target.id}': "
                         f"vocab_size {draft.hf.vocab_size} against {target.hf.vocab_size}",
                         param="draft_model", code="draft_vocab_mismatch")
    why = _tokenizer_difference(Path(target.path), Path(draft.path))
    if why is not None:
        raise BadRequest(f"draft_model '{draft.id}' does not share the vocabulary of '{target.id}': {why}",
                         param="draft_model", code="draft_vocab_mismatch")


def _tokenizer_difference(target: Path, draft: Path) -> str | None:
    for name in TOKENIZER_FILES:
        a, b = target / name, draft / name
        if a.is_file() and b.is_file():
            return None if _digest(a) == _digest(b) else f"their {name} files differ"
    return None  # nothing to compare: vLLM checks the vocab size again at load


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        left = MAX_TOKENIZER_BYTES
        while left > 0 and (chunk := f.read(min(1 << 20, left))):
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()
