"""How far a slot's context reaches: the model's native context, or past it
with RoPE scaling (YaRN), in the numbers llama.cpp's engine takes.

Measured with xllamacpp 2026.10 (llama.cpp's server engine) on a model of
native context 2048: a slot context above the training context
(``<arch>.context_length``) is capped there at load ("the slot context ...
exceeds the training context of the model - capping"), after the KV cache
was already allocated for the larger one. With ``rope_scaling_type`` YaRN and
a ``rope_freq_scale`` s, the engine raises its training context to
``yarn_orig_ctx / s`` ("custom YaRN scaling detected") and a slot gets that
much: 8192 with s = 0.25. Linear scaling left the cap at 2048, so YaRN is the
one scaling offered. The worker is given both numbers, so the context memfit
plans is the context the engine serves.
"""

from __future__ import annotations

import msgspec

from supervisor.config import MAX_ROPE_SCALE, ModelSettings
from supervisor.errors import BadRequest


class Reach(msgspec.Struct, frozen=True, kw_only=True):
    """The most context a slot gets, and the scaling that gets it there."""

    limit: int  # 0: the header names no native context, so nothing caps it
    native: int
    rope_scaling: str = "none"  # "yarn" when the engine is told to scale
    rope_scale: float = 0.0  # limit / native with scaling, else 0
    yarn_orig_ctx: int = 0  # the context YaRN scales from (given to the engine)
    note: str = ""  # what scaling that was named does (or why nothing)

    @property
    def freq_scale(self) -> float:
        """The engine's ``rope_freq_scale``: 0 leaves the model's own."""
        return self.yarn_orig_ctx / self.limit if self.rope_scaling == "yarn" else 0.0


def check_rope(settings: ModelSettings) -> None:
    """A 400 naming the setting when a scaling value is set with no scaling named."""
    problem = settings.rope_problem()
    if problem is not None:
        raise BadRequest(problem[1], param=problem[0])


def context_reach(settings: ModelSettings, *, native: int, header_orig: int,
                  requested: int | None) -> Reach:
    """Where a slot's context stops for a load of ``settings``.

    ``native`` is the header's context length, ``header_orig`` its
    ``rope.scaling.original_context_length`` (0: none), ``requested`` the
    explicit n_ctx (None: automatic). YaRN without ``rope_scale`` scales to
    the requested context; it is not used when that is within the native one.
    """
    check_rope(settings)
    if native <= 0:
        return Reach(limit=0, native=0)
    if settings.rope_scaling != "yarn":
        return Reach(limit=native, native=native)
    if settings.rope_scale is not None:
        limit = int(native * settings.rope_scale)
    elif requested is not None and requested > native:
        limit = min(requested, int(native * MAX_ROPE_SCALE))
    else:
        return Reach(limit=native, native=native, note=(
            f'rope_scaling = "yarn" is not used: n_ctx is within the native context {native} '
            "(set n_ctx above it, or rope_scale)"))
    orig = settings.yarn_orig_ctx or header_orig or native
    scale = round(limit / native, 4)
    return Reach(limit=limit, native=native, rope_scaling="yarn", rope_scale=scale, yarn_orig_ctx=orig,
                 note=f"YaRN scaling by {scale:g} reaches {limit} (native {native}, scaled from {orig})")


def cap_note(requested: int, reach: Reach) -> str:
    """Why an explicit n_ctx above the reach was cut to it ("" when it was not)."""
    if reach.limit <= 0 or requested <= reach.limit:
        return ""
    if reach.rope_scaling == "yarn":
        further = ("a larger rope_scale goes further" if reach.rope_scale < MAX_ROPE_SCALE
                   else f"{MAX_ROPE_SCALE:g} is the largest rope_scale taken")
        return (f"n_ctx {requested} is above the {reach.limit} that YaRN scaling by {reach.rope_scale:g}"
                f" reaches: capped at {reach.limit} ({further})")
    return (f"n_ctx {requested} is above the model's native context {reach.native}: capped at"
            f' {reach.native} (past it needs rope_scaling = "yarn")')
