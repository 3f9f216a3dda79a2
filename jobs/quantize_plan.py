"""The quantize plan: what a GGUF header says about the input (its type,
its tensors in write order, what each becomes) and the expected output size.

Imported by the ``quantize`` and ``export`` kinds; reads headers only (memory-mapped).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jobs.context import JobError
from jobs.quantize_rules import (
    MIXES,
    Mix,
    ModelFacts,
    TensorSpec,
    is_quantizable,
    plan_types,
    tensor_order,
)

Q = gguf.GGMLQuantizationType
TYPES: Mapping[str, Mix] = MIXES
UNQUANTIZED = frozenset({Q.F32, Q.F16, Q.BF16})


@dataclass
class Plan:
    """What the header says about the input and the expected output."""

    file_type: int | None
    quantized: bool
    estimate_bytes: int
    incompatible: list[tuple[str, int]]
    quantizable: int


@dataclass(frozen=True)
class TensorItem:
    """One tensor to write: where it is in the input and what it becomes."""

    name: str
    shape: tuple[int, ...]
    src_type: Q
    dst_type: Q
    offset: int
    n_bytes: int

    @property
    def n_per_row(self) -> int:
        return self.shape[0]

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64))

    def out_bytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.dst_type]
        return self.n_per_row // block * size * self.n_rows


def open_gguf(path: Path) -> gguf.GGUFReader:
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise JobError(f"{path.name} is not a GGUF file")
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise JobError(f"{path.name} is not a readable GGUF file: {exc}") from exc


def scalar(reader: gguf.GGUFReader, key: str) -> Any:
    """A field's value, or the first element of an array field; None when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    return value[0] if isinstance(value, list) else value


def model_facts(reader: gguf.GGUFReader) -> ModelFacts:
    arch = scalar(reader, gguf.Keys.General.ARCHITECTURE)
    if not isinstance(arch, str):
        raise JobError("the model has no general.architecture")
    n_layer = scalar(reader, f"{arch}.block_count")
    if n_layer is None:
        raise JobError(f"the model has no {arch}.block_count")
    n_head = int(scalar(reader, f"{arch}.attention.head_count") or 0)
    n_head_kv = scalar(reader, f"{arch}.attention.head_count_kv")
    return ModelFacts(
        arch=arch, n_layer=int(n_layer), n_head=n_head,
        n_head_kv=n_head if n_head_kv is None else int(n_head_kv),
        n_expert=int(scalar(reader, f"{arch}.expert_count") or 0),
    )


def tensor_specs(reader: gguf.GGUFReader) -> list[TensorSpec]:
    return [TensorSpec(str(t.name), tuple(int(d) for d in t.shape), Q(int(t.tensor_type)))
            for t in reader.tensors]


def type_plan(reader: gguf.GGUFReader, mix: Mix) -> dict[str, Q]:
    try:
        return plan_types(tensor_specs(reader), mix, model_facts(reader))
    except ValueError as exc:
        raise JobError(f"cannot plan the tensor types: {exc}") from exc


def tensor_items(reader: gguf.GGUFReader, mix: Mix) -> list[TensorItem]:
    """The tensors in llama.cpp's output order, each with its output type."""
    types = type_plan(reader, mix)
    items = [
        TensorItem(str(t.name), tuple(int(d) for d in t.shape), Q(int(t.tensor_type)),
              types[str(t.name)], int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    ]
    return sorted(items, key=lambda i: tensor_order(i.name))


def inspect_model(path: Path, type_name: str) -> Plan:
    """Read the GGUF header (memory-mapped) and plan the conversion."""
    reader = open_gguf(path)
    field = reader.fields.get(gguf.Keys.General.FILE_TYPE)
    file_type = int(field.parts[field.data[0]][0]) if field is not None else None
    mix = TYPES[type_name]
    block = gguf.GGML_QUANT_SIZES[mix.base][0]
    arch = str(scalar(reader, gguf.Keys.General.ARCHITECTURE))
    items = tensor_items(reader, mix)
    estimate = path.stat().st_size - sum(i.n_bytes for i in items)
    incompatible, quantizable, quantized = [], 0, False
    for item in items:
        quantized = quantized or item.src_type not in UNQUANTIZED
        estimate += item.out_bytes()
        if is_quantizable(item.name, item.shape, arch):
            quantizable += 1
            if item.n_per_row % block:
                incompatible.append((item.name, item.n_per_row))
    if file_type is not None and file_type not in (0, 1, 32):
        quantized = True
    return Plan(file_type, quantized, estimate, incompatible, quantizable)
