"""The LoRA adapters a worker holds, and which of them a request runs with.

The engine loads adapters only at start (``CommonParams.lora_adapters``);
with ``lora_init_without_apply`` none is applied until a request names it in
its ``lora`` list (``[{id, scale}]``, ids in load order). Requests with
different adapters then run side by side in the slots.

One engine fact shapes this module: a slot's cached prompt is dropped when
the adapters change between two requests only if both requests enable some
adapter (measured: xllamacpp 2026.10; it keeps the cache across a change
from none to some, which suits activated LoRAs only). A plain LoRA changes
every cached key and value, so a request without an adapter would reuse a
prompt computed with one, and the other way round. So a worker that holds
adapters also loads a *neutral* one: rank 1, all zeros, on one weight, which
adds exactly nothing. Requests without an adapter enable it, so every
request enables one and the engine never reuses a cache across adapters.

The engine refuses a whole start when one adapter fails to load. So each
adapter is checked alone first (readable, its tensor data laid out as the
engine reads it: formats/gguf_layout.py), and only the good ones are given
to the engine; if it still refuses them, the start is tried without each
one in turn (:meth:`AdapterSet.without_each`), so one bad adapter costs
itself alone. The refused ones are named, with why, in the worker's facts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import xllamacpp

from formats.gguf_layout import TensorRecord, layout_fault

LORA_A = ".lora_a"
LORA_B = ".lora_b"


# With more adapters than this, a start the engine refuses is not tried
# without each one (every try loads the base again): the base runs alone.
MAX_SINGLE_OUT = 8
ENGINE_REFUSED = "the engine refused it (the worker log says why)"
ENGINE_REFUSED_SET = "the engine refused the adapters given together (the worker log says why)"


class AdapterError(Exception):
    """A request names an adapter this worker does not hold."""


def adapter_fault(path: Path) -> str | None:
    """Why the engine would refuse the adapter file at ``path``; None when it can load it."""
    try:
        reader = gguf.GGUFReader(path)
        records = [TensorRecord(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type),
                                int(t.data_offset) - reader.data_offset) for t in reader.tensors]
        return layout_fault(records, data_start=reader.data_offset, alignment=reader.alignment,
                            file_size=len(reader.data))
    except (OSError, ValueError, KeyError, IndexError) as exc:
        # The reader meets a crafted file with whatever numpy or struct raises.
        return f"cannot read it: {exc}"


def write_neutral_adapter(like: Path, out: Path) -> None:
    """A rank-1 all-zero adapter on the first weight ``like`` adapts."""
    reader = gguf.GGUFReader(like)
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ValueError(f"{like.name} has no general.architecture")
    arch = str(arch_field.contents())
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    for name in sorted(shapes):
        if name.endswith(LORA_A) and name[: -len(LORA_A)] + LORA_B in shapes:
            weight = name[: -len(LORA_A)]
            n_in = shapes[name][0]  # ggml order: ne[0] is the input width
            n_out = shapes[weight + LORA_B][1]
            break
    else:
        raise ValueError(f"{like.name} has no lora_a/lora_b pair")
    writer = gguf.GGUFWriter(out, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 1.0)
    writer.add_tensor(weight + LORA_A, np.zeros((1, n_in), np.float32))
    writer.add_tensor(weight + LORA_B, np.zeros((n_out, 1), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass(frozen=True)
class AdapterSet:
    """Adapter paths in engine load order; the neutral one comes last.
    ``refused``: the adapters given but not held, each with why."""

    paths: tuple[str, ...] = ()
    neutral: str = ""
    refused: tuple[tuple[str, str], ...] = ()

    @classmethod
    def prepare(cls, paths: list[str], neutral_out: Path) -> AdapterSet:
        """The set to load: the adapters the engine can load, each checked alone."""
        good: list[str] = []
        refused: list[tuple[str, str]] = []
        for path in dict.fromkeys(paths):
            fault = adapter_fault(Path(path))
            if fault is None:
                good.append(path)
            else:
                refused.append((path, fault))
        return cls._built(good, refused, neutral_out)

    @classmethod
    def _built(cls, good: list[str], refused: list[tuple[str, str]], neutral_out: Path) -> AdapterSet:
        """``good`` with a neutral adapter written like its first (a weight every one of them may change)."""
        if not good:
            return cls(refused=tuple(refused))
        try:
            neutral_out.unlink(missing_ok=True)
            write_neutral_adapter(Path(good[0]), neutral_out)
        except (OSError, ValueError) as exc:
            why = f"cannot write the neutral adapter from {Path(good[0]).name}: {exc}"
            return cls(refused=(*refused, *((p, why) for p in good)))
        return cls(tuple(good), str(neutral_out), tuple(refused))

    def error(self) -> str:
        """The facts' ``adapter_error``: which adapters are not held and why; "" = none."""
        return "; ".join(f"{Path(p).name}: {why}" for p, why in self.refused)

    def without_each(self) -> Iterator[AdapterSet]:
        """The sets to start with once the engine refused this one: without
        each adapter in turn, then none (the base alone)."""
        if 1 < len(self.paths) <= MAX_SINGLE_OUT:
            for i, path in enumerate(self.paths):
                rest = [*self.paths[:i], *self.paths[i + 1:]]
                refused = [*self.refused, (path, ENGINE_REFUSED)]
                # The neutral one is written again: the adapter it was written like may be the bad one.
                yield self._built(rest, refused, Path(self.neutral))
        why = ENGINE_REFUSED if len(self.paths) == 1 else ENGINE_REFUSED_SET
        yield AdapterSet(refused=(*self.refused, *((p, why) for p in self.paths)))

    def configure(self, params: xllamacpp.CommonParams) -> None:
        if not self.paths:
            return
        params.lora_adapters = [xllamacpp.CommonAdapterLoraInfo(p, 0.0)
                                for p in (*self.paths, self.neutral)]
        params.lora_init_without_apply = True

    def request_field(self, adapter: str, scale: float) -> list[dict[str, Any]] | None:
        """The completion body's ``lora`` list for a request; None: no adapters held."""
        if not adapter:
            return None if not self.paths else [{"id": len(self.paths), "scale": 1.0}]
        if adapter not in self.paths:
            why = dict(self.refused).get(adapter)
            raise AdapterError(f"this worker holds no adapter {Path(adapter).name}"
                               + (f": {why}" if why else ""))
        return [{"id": self.paths.index(adapter), "scale": scale}]
