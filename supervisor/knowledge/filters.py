"""Attribute filters of a search, as OpenAI defines them: a comparison
(``eq``, ``ne``, ``gt``, ``gte``, ``lt``, ``lte``, ``in``, ``nin`` of one
attribute's value) or a compound (``and``/``or`` of filters). They select
the files of a store by the attributes given when each was added.

A filter is request input: its shape, depth and size are checked, and a
bad one is a 400 naming the place in it (``filters.filters[1].key``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from supervisor.errors import BadRequest
from supervisor.knowledge.stores import Attributes

MAX_DEPTH = 8
MAX_NODES = 64
COMPARE = ("eq", "ne", "gt", "gte", "lt", "lte", "in", "nin")
Match = Callable[[Attributes], bool]
Scalar = str | float | bool


def parse(raw: object, param: str = "filters") -> Match:
    """The predicate ``raw`` describes, over a file's attributes."""
    budget = [MAX_NODES]
    return _node(raw, param, 0, budget)


def _node(raw: object, param: str, depth: int, budget: list[int]) -> Match:
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise BadRequest(f"filters may hold at most {MAX_NODES} filters, {MAX_DEPTH} deep", param=param)
    if not isinstance(raw, Mapping):
        raise BadRequest("a filter is an object", param=param)
    kind = raw.get("type")
    if kind in ("and", "or"):
        return _compound(raw, kind, param, depth, budget)
    if kind in COMPARE:
        return _comparison(raw, str(kind), param)
    raise BadRequest(f"type must be one of and, or, {', '.join(COMPARE)}", param=f"{param}.type")


def _compound(raw: Mapping[str, Any], kind: str, param: str, depth: int, budget: list[int]) -> Match:
    parts = raw.get("filters")
    if not isinstance(parts, list) or not parts:
        raise BadRequest("a compound filter needs a non-empty filters list", param=f"{param}.filters")
    extra = set(raw) - {"type", "filters"}
    if extra:
        raise BadRequest(f"unknown field {sorted(extra)[0]!r}", param=f"{param}.{sorted(extra)[0]}")
    subs = [_node(p, f"{param}.filters[{i}]", depth + 1, budget) for i, p in enumerate(parts)]
    if kind == "and":
        return lambda attrs: all(f(attrs) for f in subs)
    return lambda attrs: any(f(attrs) for f in subs)


def _scalar(value: object) -> bool:
    return isinstance(value, (str, bool, int, float))


def _comparison(raw: Mapping[str, Any], kind: str, param: str) -> Match:
    key, value = raw.get("key"), raw.get("value")
    extra = set(raw) - {"type", "key", "value"}
    if extra:
        raise BadRequest(f"unknown field {sorted(extra)[0]!r}", param=f"{param}.{sorted(extra)[0]}")
    if not isinstance(key, str) or not 1 <= len(key) <= 64:
        raise BadRequest("key must be an attribute name (1 to 64 characters)", param=f"{param}.key")
    if kind in ("in", "nin"):
        if not isinstance(value, list) or not value or len(value) > MAX_NODES or not all(map(_scalar, value)):
            raise BadRequest(f"value must be a list of 1 to {MAX_NODES} strings, numbers or booleans",
                             param=f"{param}.value")
        options = list(value)
        inside = kind == "in"
        return lambda attrs: key in attrs and (_member(attrs[key], options) == inside)
    if not _scalar(value):
        raise BadRequest("value must be a string, a number or a boolean", param=f"{param}.value")
    return _compare(kind, key, value)  # type: ignore[arg-type]  # checked by _scalar


def _member(have: Scalar, options: list[Scalar]) -> bool:
    return any(_same(have, o) for o in options)


def _same(a: Scalar, b: Scalar) -> bool:
    # True is not 1 here: a boolean attribute equals only a boolean.
    return type(a) is type(b) or (_number(a) and _number(b)) if a == b else False


def _number(v: Scalar) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _compare(kind: str, key: str, value: Scalar) -> Match:
    def match(attrs: Attributes) -> bool:
        if key not in attrs:
            return kind == "ne"
        have = attrs[key]
        if kind == "eq":
            return _same(have, value)
        if kind == "ne":
            return not _same(have, value)
        # Order compares numbers with numbers and strings with strings only.
        if _number(have) and _number(value) or isinstance(have, str) and isinstance(value, str):
            ordered = {"gt": have > value, "gte": have >= value,  # type: ignore[operator]
                       "lt": have < value, "lte": have <= value}  # type: ignore[operator]
            return ordered[kind]
        return False

    return match
