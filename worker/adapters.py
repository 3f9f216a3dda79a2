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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import xllamacpp

LORA_A = ".lora_a"
LORA_B = ".lora_b"


class AdapterError(Exception):
    """A request names an adapter this worker does not hold."""


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
    """Adapter paths in engine load order; the neutral one comes last."""

    paths: tuple[str, ...] = ()
    neutral: str = ""

    @classmethod
    def prepare(cls, paths: list[str], neutral_out: Path) -> tuple[AdapterSet, str]:
        """The set to load, and why none is loaded when the adapters cannot be read."""
        if not paths:
            return cls(), ""
        try:
            neutral_out.unlink(missing_ok=True)
            write_neutral_adapter(Path(paths[0]), neutral_out)
        except (OSError, ValueError) as exc:
            return cls(), f"cannot read the LoRA adapter {Path(paths[0]).name}: {exc}"
        return cls(tuple(paths), str(neutral_out)), ""

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
            raise AdapterError(f"this worker holds no adapter {Path(adapter).name}")
        return [{"id": self.paths.index(adapter), "scale": scale}]
