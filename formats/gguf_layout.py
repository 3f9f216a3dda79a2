"""Where a GGUF's tensor data lies, checked as the engine's loader checks it.

The engine's GGUF reader refuses a file whose tensor index does not add up:
a tensor type it does not know, a row not a whole number of blocks, a data
offset other than the end of the tensor before it (each padded to the
alignment), or data that runs past the end of the file. For a LoRA adapter
such a refusal happens inside the engine's start, after the base model is
loaded, and takes every other adapter of that start down with it. So both
the library (the parent) and the worker check an adapter's layout from its
header before the engine sees it, with this one function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_SIZES = {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()}
_NAMES = {int(t): t.name for t in GGMLQuantizationType}


class TensorRecord(NamedTuple):
    """One entry of a GGUF's tensor index."""

    name: str
    dims: tuple[int, ...]  # ggml order: ne[0] first
    ggml_type: int
    offset: int  # relative to the start of the data section


def tensor_bytes(record: TensorRecord) -> int:
    """The bytes of a tensor's data; ValueError for a type or row the engine refuses."""
    sizes = _SIZES.get(record.ggml_type)
    if sizes is None:
        raise ValueError(f"tensor {record.name!r} has type {record.ggml_type}, which the engine does not know")
    block, type_size = sizes
    n_row = record.dims[0] if record.dims else 1
    if n_row % block:
        raise ValueError(f"tensor {record.name!r} of type {_NAMES.get(record.ggml_type)} has rows of "
                         f"{n_row} values, not a multiple of its block size {block}")
    return math.prod(record.dims) // block * type_size


def layout_fault(tensors: Sequence[TensorRecord], *, data_start: int, alignment: int,
                 file_size: int) -> str | None:
    """Why the engine would refuse this tensor index; None when it adds up.

    The index is walked in its own order, as the engine walks it: tensor i
    must start where tensor i-1 ends, padded to ``alignment``.
    """
    expected = 0
    for record in tensors:
        try:
            size = tensor_bytes(record)
        except ValueError as exc:
            return str(exc)
        if record.offset != expected:
            return (f"tensor {record.name!r} has its data at offset {record.offset}, "
                    f"where the index puts it at {expected}")
        if data_start + record.offset + size > file_size:
            return f"truncated: the data of tensor {record.name!r} runs past the end of the file"
        expected += -(-size // alignment) * alignment
    return None
