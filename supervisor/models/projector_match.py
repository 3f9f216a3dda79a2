"""Which of a folder's projectors (mmproj GGUFs) a text model can load.

A projector maps images (or audio) into one text model's embedding space, so
the engine refuses a pair whose widths differ, after loading both, and then
starts again without it. Linking by folder alone would, in a flat models
dir, tag every model there "vision", hold the projector's memory for each,
and start each engine twice. So each pair is checked from the headers:

- **width**: the projector's output width against the model's
  ``<arch>.embedding_length``. Current converters write the text width as
  ``clip.vision.projection_dim`` (``clip.audio.projection_dim``) and mark the
  file ``general.type = mmproj``. Older LLaVA-style files (``mlp``) wrote the
  image encoder's own width under that key; for them the last projection
  tensor's shape (``mm.2.weight``, what the engine checks) says it.
- **family**: projector types made for one text family
  (``clip.projector_type``: ``gemma3``, ``qwen2.5vl_merger``...) fit only
  models of that ``general.architecture``.

A pair the headers rule out is never linked, and the model's entry says why
(``projector_note``). A projector whose header cannot tell (an old converter,
an unreadable file) is linked by folder as before, when nothing in the folder
is known to fit: its worker then checks it on load and reports. Of several
fitting projectors, one of the model's own family, then one sharing most
words of the model's file name, then an f16 one, is taken.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from jobs.gguf_names import model_stem, pick_projector
from supervisor.models.gguf_header import GgufError, read_tensor_dims
from supervisor.models.gguf_info import GgufInfo

log = logging.getLogger(__name__)

# Projector types that only feed one text family: type -> text architectures.
# A type missing here (mlp, pixtral, ultravox, qwen2a...) fits any family.
FAMILIES: dict[str, frozenset[str]] = {
    "gemma3": frozenset({"gemma3"}),
    "gemma3nv": frozenset({"gemma3n"}),
    "gemma3na": frozenset({"gemma3n"}),
    "gemma4v": frozenset({"gemma4"}),
    "gemma4a": frozenset({"gemma4"}),
    "qwen2vl_merger": frozenset({"qwen2vl"}),
    "qwen2.5vl_merger": frozenset({"qwen2vl"}),
    "qwen3vl_merger": frozenset({"qwen3vl", "qwen3vlmoe"}),
    "llama4": frozenset({"llama4"}),
}
# The LLaVA-style MLP's last layer: its rows are the text width.
_MLP_OUT = "mm.2.weight"
_NOTE_CHARS = 300  # a note stays short whatever a header holds
_WORD = re.compile(r"[a-z0-9]+")
_NO_WORDS = frozenset({"mmproj", "model", "gguf"})
# Quantization words (Q4_K_M, IQ2_XS, f16...): a projector's own quant says
# nothing of which model it belongs to.
_QUANT_WORD = re.compile(r"i?q\d+|[kmsl]|x*s|b?f\d+|\d+")

Verdict = Literal["fits", "unknown", "misfit"]


class ProjectorFacts(NamedTuple):
    """What a projector's header says about the models it fits."""

    width: int | None = None  # the text width it maps into; None: not told
    trusted: bool = False  # a width that disagrees rules the pair out
    families: frozenset[str] | None = None  # text architectures; None: any
    # Why it fits no model (no encoder at all); None when it may fit.
    unfit: str | None = None
    # Why the header cannot tell (unreadable, no projector header).
    untold: str | None = None


class ProjectorLink(NamedTuple):
    path: Path | None  # the projector to load with the model, if any
    note: str | None  # why none was linked, or why the link is unchecked


def link_projector(model: Path, info: GgufInfo | None, candidates: Sequence[Path]) -> ProjectorLink:
    """The projector of ``candidates`` (the model's folder) the model loads with."""
    if not candidates:
        return ProjectorLink(None, None)
    fits: list[Path] = []
    unknown: list[tuple[Path, str]] = []
    misfits: list[str] = []
    for path in candidates:
        facts = projector_facts(path)
        verdict, why = judge(info, facts)
        if verdict == "fits":
            fits.append(path)
        elif verdict == "unknown":
            unknown.append((path, why))
        else:
            misfits.append(f"{path.name} {why}")
    if fits:
        return ProjectorLink(_best(model, info, fits), None)
    if unknown:
        chosen = _by_name([p for p, _ in unknown])
        why = dict(unknown)[chosen]
        return ProjectorLink(chosen, _short(f"{chosen.name} linked by folder, unchecked: {why}"))
    return ProjectorLink(None, _short("no projector fits: " + "; ".join(misfits)))


def judge(info: GgufInfo | None, facts: ProjectorFacts) -> tuple[Verdict, str]:
    """Whether a projector fits a model, and why not (or why it cannot tell)."""
    if facts.unfit is not None:
        return "misfit", facts.unfit
    if facts.untold is not None:
        return "unknown", facts.untold
    arch = info.architecture if info is not None else ""
    if facts.families is not None and arch and arch not in facts.families:
        return "misfit", f"is a projector for {'/'.join(sorted(facts.families))} models, this one is {arch}"
    n_embd = info.n_embd if info is not None else 0
    if facts.width is None:
        return "unknown", "its header does not say the text width it maps into"
    if n_embd <= 0:
        return "unknown", "the model's header does not say its width"
    if facts.width == n_embd:
        return "fits", ""
    if facts.trusted:
        return "misfit", f"maps into width {facts.width}, this model's width is {n_embd}"
    return "unknown", (f"its header says width {facts.width} (this model's is {n_embd}), "
                       "which old converters wrote for the encoder's own width")


def projector_facts(path: Path) -> ProjectorFacts:
    """The fit facts of a projector file, cached per file version."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return ProjectorFacts(untold=f"cannot read it ({exc.strerror or exc})")
    return _facts(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=256)
def _facts(path: str, _mtime_ns: int, _size: int) -> ProjectorFacts:
    try:
        kv, dims = read_tensor_dims(Path(path), frozenset({_MLP_OUT}))
    except GgufError as exc:
        return ProjectorFacts(untold=f"its header is unreadable ({exc.reason})")
    except Exception as exc:  # a crafted header costs this one pairing, never the library's scan
        log.warning("%s: unreadable projector header: %s: %s", path, type(exc).__name__, exc)
        return ProjectorFacts(untold=f"its header is unreadable ({type(exc).__name__})")
    return facts_from_header(kv, dims)


def facts_from_header(kv: dict[str, Any], dims: dict[str, list[int]]) -> ProjectorFacts:
    """:class:`ProjectorFacts` from a header's keys and the dims of its last projection."""
    arch = kv.get("general.architecture")
    if arch != "clip":
        return ProjectorFacts(untold=f"its header is not a projector's (architecture {_show(arch)})")
    vision = kv.get("clip.has_vision_encoder") is True
    audio = kv.get("clip.has_audio_encoder") is True
    if not vision and not audio:
        return ProjectorFacts(unfit="has no vision or audio encoder")
    types = [t for t in (kv.get("clip.projector_type"), kv.get("clip.vision.projector_type"),
                         kv.get("clip.audio.projector_type")) if isinstance(t, str)]
    kind = types[0] if types else "mlp"  # the engine's default when the key is absent
    known = [FAMILIES[t] for t in types if t in FAMILIES]
    families = frozenset().union(*known) if known else None
    out = dims.get(_MLP_OUT)
    if vision and kind == "mlp" and out is not None and len(out) >= 2 and out[1] > 0:
        return ProjectorFacts(width=out[1], trusted=True, families=families)
    width = _positive(kv.get("clip.vision.projection_dim" if vision else "clip.audio.projection_dim"))
    # Files marked as an mmproj come from a converter that writes the text width there.
    trusted = kv.get("general.type") == "mmproj"
    return ProjectorFacts(width=width, trusted=trusted, families=families)


def _best(model: Path, info: GgufInfo | None, fits: list[Path]) -> Path:
    if len(fits) == 1:
        return fits[0]
    arch = info.architecture if info is not None else ""
    words = _words(model_stem(model.name))

    def score(path: Path) -> tuple[bool, int]:
        families = projector_facts(path).families
        return families is not None and arch in families, len(words & _words(model_stem(path.name)))

    top = max(score(p) for p in fits)
    return _by_name([p for p in fits if score(p) == top])


def _by_name(paths: list[Path]) -> Path:
    """An f16 one, else the first by name (as the download job picks)."""
    chosen = pick_projector([str(p) for p in paths])
    return next(p for p in paths if str(p) == chosen)


def _words(stem: str) -> set[str]:
    return {w for w in _WORD.findall(stem.lower()) if w not in _NO_WORDS and not _QUANT_WORD.fullmatch(w)}


def _positive(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def _show(value: object) -> str:
    """A header value in a note: quoted, and cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _short(note: str) -> str:
    return note if len(note) <= _NOTE_CHARS else note[: _NOTE_CHARS - 3] + "..."
