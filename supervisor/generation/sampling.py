"""The sampling a request runs with, field by field, and where each value came from.

A field the request sets is the request's. One it leaves out comes from, in
order: the model's ``[model_defaults.<id>]`` in the config, the model's own
file (GGUF ``general.sampling.*`` or generation_config.json, read by
supervisor/models/sampling_defaults.py), else ours (the protocol's defaults,
worker/protocol.py). Every engine gets the values spelled out, so the
engine's own fallbacks never decide: the llama.cpp server and vLLM would
each fill an omitted field differently.

The worker pool applies this when it admits a generation, for chat,
completions and the Responses API alike; ``/api/models`` shows the values
in effect for a request that sets none, with their sources.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

import msgspec

from supervisor.config import ModelSettings
from supervisor.models.entry import ModelEntry
from supervisor.models.sampling_defaults import SAMPLING_FIELDS, ModelSampling
from worker.protocol import SamplingParams

# "config": [model_defaults.<id>]; "model": the model's file; "default": ours.
Source = Literal["request", "config", "model", "default"]
_OURS = SamplingParams()


class Setting(msgspec.Struct, frozen=True):
    value: float | int
    source: Source


def model_sampling(entry: ModelEntry | None) -> ModelSampling:
    """What the model's own file says (nothing for an unknown or unreadable one)."""
    if entry is None:
        return ModelSampling()
    facts = entry.info or entry.hf
    return facts.sampling if facts is not None else ModelSampling()


def in_effect(entry: ModelEntry | None, settings: ModelSettings) -> dict[str, Setting]:
    """Each sampling field's value for a request that leaves it out."""
    own = model_sampling(entry).values
    out: dict[str, Setting] = {}
    for field in SAMPLING_FIELDS:
        configured = getattr(settings, field)
        if configured is not None:
            out[field] = Setting(configured, "config")
        elif field in own:
            out[field] = Setting(own[field], "model")
        else:
            out[field] = Setting(getattr(_OURS, field), "default")
    return out


def fill(params: SamplingParams, asked: Collection[str], effect: dict[str, Setting]) -> SamplingParams:
    """``params`` with every field the request did not set (not in ``asked``)
    taken from ``effect``."""
    chosen = {field: s.value for field, s in effect.items() if field not in asked}
    return msgspec.structs.replace(params, **chosen) if chosen else params


def asked_fields(**values: float | int | None) -> frozenset[str]:
    """The sampling fields a request set: those of ``values`` that are not None."""
    return frozenset(name for name, value in values.items() if value is not None and name in SAMPLING_FIELDS)
