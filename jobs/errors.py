"""Errors of the job side that the parent turns into HTTP answers.

``jobs/`` never imports the parent: a params check raises :class:`ParamError`
naming the field, and the parent maps it to a 400 in one place.
:func:`validation_param` is the one reader of msgspec's error text, shared by
both sides.
"""

from __future__ import annotations

import re

import msgspec

# msgspec names the failing location as " - at `$.field[0].sub`".
_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


class ParamError(Exception):
    """Job params (or the kind) are invalid; ``param`` names the field."""

    def __init__(self, message: str, *, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class FieldValueError(ValueError):
    """A struct's own check (``__post_init__``) refused one field's value.

    msgspec reports such an error at the struct, not at the field, and keeps
    this exception as the cause: :func:`validation_param` adds ``field``."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


def validation_param(exc: msgspec.ValidationError) -> str | None:
    """The dotted field path msgspec reports for a validation error (with
    the field a :class:`FieldValueError` named, when one caused it)."""
    found = _AT.search(str(exc))
    at = found.group(1) if found else None
    cause = exc.__cause__
    if isinstance(cause, FieldValueError):
        return f"{at}.{cause.field}" if at else cause.field
    return at


def unknown_field(exc: msgspec.ValidationError) -> str | None:
    """The name of the unknown field a top-level error is about, if any
    (msgspec reports no location for it)."""
    found = _UNKNOWN.search(str(exc))
    return found.group(1) if found else None
