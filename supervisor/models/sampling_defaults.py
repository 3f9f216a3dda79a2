"""A model's own sampling defaults, as its files give them.

A GGUF carries its author's recommended sampler settings as
``general.sampling.*`` keys (llama.cpp's converter writes them from the
checkpoint's generation_config.json); a Hugging Face model dir (kind ``hf``)
has that generation_config.json itself. They fill what a request leaves out;
supervisor/generation/sampling.py says in which order against the config and
our own defaults.

The files are untrusted. A value of the wrong type, not finite, or outside the
range a request may ask for is not taken, and ``ignored`` says why, key by
key; the model stays usable. So does a sampler key we do not apply (mirostat,
XTC, the sampler order): it is listed as ignored, not silently dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

# The request fields a model's file may give a default for, in display order.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty")
GGUF_PREFIX = "general.sampling."
GENERATION_CONFIG = "generation_config.json"
MAX_GENERATION_CONFIG_BYTES = 1 << 20
# The largest top_k worth saying: past every vocabulary (262,144 is the largest we know).
MAX_TOP_K = 1 << 20
# Ignored keys listed at most (a hostile header may hold a million of them).
MAX_IGNORED = 16
_MAX_KEY_CHARS = 80

# Our field -> (its GGUF key, its generation_config.json key).
_KEYS: dict[str, tuple[str, str]] = {
    "temperature": (GGUF_PREFIX + "temp", "temperature"),
    "top_p": (GGUF_PREFIX + "top_p", "top_p"),
    "top_k": (GGUF_PREFIX + "top_k", "top_k"),
    "min_p": (GGUF_PREFIX + "min_p", "min_p"),
    "repeat_penalty": (GGUF_PREFIX + "penalty_repeat", "repetition_penalty"),
}
# Each field's accepted range: (low, high, low included). The request bounds
# where a request has them (temperature 0..2, top_p above 0 up to 1); a
# repeat penalty above 2 garbles any model, 0 or below is no penalty at all.
_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, True),
    "top_p": (0.0, 1.0, False),
    "top_k": (0, MAX_TOP_K, True),
    "min_p": (0.0, 1.0, True),
    "repeat_penalty": (0.0, 2.0, False),
}
# generation_config.json keys that are sampler settings we do not apply
# (the rest of the file, token ids and lengths, is no sampling default).
_HF_UNUSED = ("typical_p", "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size")


class ModelSampling(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The sampling defaults one model's file gives."""

    # Field (SAMPLING_FIELDS) -> the file's value, checked.
    values: dict[str, float | int] = {}
    # Key of the file -> why its value was not taken.
    ignored: dict[str, str] = {}


def check_value(field: str, value: Any) -> tuple[float | int | None, str]:
    """(the value as a field takes it, "") or (None, why not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"is {type(value).__name__}, not a number"
    if not math.isfinite(value):
        return None, f"is {value}, not a finite number"
    low, high, low_ok = _RANGES[field]
    if field == "top_k":
        if value != int(value):
            return None, f"is {value}, not a whole number"
        value = int(value)
    else:
        # GGUF stores float32: 0.6 reads back as 0.6000000238...; say what was meant.
        value = round(float(value), 6)
    if value > high or value < low or (value == low and not low_ok):
        opening = "[" if low_ok else "("
        return None, f"is {value}, outside {opening}{_number(low)}, {_number(high)}]"
    return value, ""


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _short(key: str) -> str:
    return key if len(key) <= _MAX_KEY_CHARS else key[:_MAX_KEY_CHARS] + "..."


class _Reading:
    """Values taken and keys ignored, while one file is read."""

    def __init__(self) -> None:
        self.values: dict[str, float | int] = {}
        self.ignored: dict[str, str] = {}

    def take(self, field: str, key: str, raw: Any) -> None:
        value, why = check_value(field, raw)
        if value is None:
            self.ignore(key, why)
        else:
            self.values[field] = value

    def ignore(self, key: str, why: str) -> None:
        if len(self.ignored) < MAX_IGNORED:
            self.ignored[_short(key)] = why

    def result(self) -> ModelSampling:
        ordered = {f: self.values[f] for f in SAMPLING_FIELDS if f in self.values}
        return ModelSampling(values=ordered, ignored=self.ignored)


def gguf_sampling(kv: Mapping[str, Any]) -> ModelSampling:
    """The defaults of a GGUF header's ``general.sampling.*`` keys."""
    reading = _Reading()
    by_key = {gguf_key: field for field, (gguf_key, _) in _KEYS.items()}
    for key, raw in kv.items():
        if not key.startswith(GGUF_PREFIX):
            continue
        field = by_key.get(key)
        if field is None:
            reading.ignore(key, "gpuvisor does not apply this sampler setting")
        else:
            reading.take(field, key, raw)
    return reading.result()


def generation_config_sampling(config: Mapping[str, Any]) -> ModelSampling:
    """The defaults of a generation_config.json's fields.

    ``do_sample`` is not read, as vLLM does not read it either: its values
    are the author's recommendation whichever way it is set.
    """
    reading = _Reading()
    for field, (_, hf_key) in _KEYS.items():
        if hf_key in config and config[hf_key] is not None:
            reading.take(field, f"{GENERATION_CONFIG}:{hf_key}", config[hf_key])
    for hf_key in _HF_UNUSED:
        if config.get(hf_key) is not None:
            reading.ignore(f"{GENERATION_CONFIG}:{hf_key}", "gpuvisor does not apply this sampler setting")
    return reading.result()


def unreadable(why: str) -> ModelSampling:
    """No defaults, because the file that gives them could not be read."""
    return ModelSampling(ignored={GENERATION_CONFIG: why})
