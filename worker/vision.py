"""Image input through a model's projector (an "mmproj" GGUF).

Loading: a projector the engine cannot load fails the whole engine (one
generic "failed to init server" error; the reason is only in its log), and a
header without the image normalisation arrays trips an assertion that aborts
the process. :func:`check_projector` refuses the latter, and the few other
cases it can tell from the header, before the engine sees the file; the
engine then loads again without the projector when it still fails.

Requests: xllamacpp's Python completions call takes the OpenAI route, whose
validation allows only a string prompt. The engine's native ``/completions``
route takes ``{"prompt_string", "multimodal_data": [base64...]}``, so
requests with images go there, over the engine's private socket, and
:func:`oai_chunk` turns its events into the OpenAI chunks the rest of the
engine reads. Text-only requests keep the direct call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from formats.gguf_meta import GGUFMetaError, read_header

_REQUIRED_ARRAYS = ("clip.vision.image_mean", "clip.vision.image_std")


class ProjectorError(Exception):
    """The projector file cannot serve images (the model still serves text)."""


def check_projector(path: Path) -> None:
    try:
        meta, names = read_header(path)
    except (OSError, GGUFMetaError) as exc:
        raise ProjectorError(f"cannot read the projector {path.name}: {exc}") from exc
    if meta.get("general.architecture") != "clip":
        raise ProjectorError(f"{path.name} is not a projector (architecture "
                             f"{meta.get('general.architecture')!r}, not 'clip')")
    vision = meta.get("clip.has_vision_encoder") is True
    if not vision and meta.get("clip.has_audio_encoder") is not True:
        raise ProjectorError(f"the projector {path.name} has no vision or audio encoder")
    missing = [k for k in _REQUIRED_ARRAYS if k not in names] if vision else []
    if missing:
        raise ProjectorError(f"the projector {path.name} lacks {', '.join(missing)}")


def oai_chunk(event: dict[str, Any]) -> dict[str, Any]:
    """One native ``/completions`` stream event as an OpenAI completion chunk."""
    if "error" in event:
        return event
    out: dict[str, Any] = {k: event[k] for k in ("prompt_progress", "timings") if k in event}
    choice: dict[str, Any] = {"text": event.get("content") or ""}
    probs = event.get("completion_probabilities")
    if probs:
        choice["logprobs"] = {"content": probs}
    if event.get("stop"):
        choice["finish_reason"] = "length" if event.get("stop_type") == "limit" else "stop"
        timings = event.get("timings") or {}
        out["usage"] = {
            "prompt_tokens": int(event.get("tokens_evaluated", 0)),
            "completion_tokens": int(event.get("tokens_predicted", 0)),
            "prompt_tokens_details": {"cached_tokens": int(timings.get("cache_n", 0))},
        }
    out["choices"] = [choice]
    return out
