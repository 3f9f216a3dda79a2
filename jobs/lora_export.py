"""A PEFT LoRA adapter (safetensors) -> a GGUF LoRA adapter llama.cpp loads.

The facts llama.cpp's engine expects of such a file (its own converter
writes the same): ``general.type = adapter``, ``adapter.type = lora``,
``adapter.lora.alpha`` and the base model's ``general.architecture``; each
adapted weight ``W`` of the base becomes two tensors named ``<W>.lora_a``
(PEFT's ``lora_A``, rank x n_in) and ``<W>.lora_b`` (``lora_B``,
n_out x rank), under the base's GGUF tensor name. The engine scales the
product by ``alpha / rank``, as PEFT does; rank-stabilised LoRA scales by
``alpha / sqrt(rank)``, so its alpha is written as ``alpha * sqrt(rank)``.
Llama's Q and K weights are stored permuted for llama.cpp's rotary layout
(see :mod:`jobs.hf_convert`); only the output side (``lora_b``) carries that
permutation, since ``B @ A`` permuted by rows is ``(P B) @ A``.

The base model's name is recorded (``general.base_model.0.name``) so that
the model library can link the adapter to the GGUF of that base.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jobs.context import JobError
from jobs.finetune_params import base_name

# The model converter's safetensors reader, for the adapter's one file.
from jobs.hf_convert import (
    HParams,
    OutType,
    TensorRef,
    _read_header,
    model_arch,
    permute_rotary,
    read_config,
)
from jobs.hf_files import check_model_dir

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT names: base_model.model.<HF module path>.lora_A.weight (or lora_B).
_PEFT_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float  # as llama.cpp applies it: scale = alpha / rank
    base: str  # the base model's path or repo id, as PEFT recorded it


@dataclass(frozen=True)
class ConvertedAdapter:
    arch: str
    tensors: int
    bytes: int
    alpha: float
    rank: int
    base_name: str


def is_adapter_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()


def read_adapter_config(adapter_dir: Path) -> AdapterConfig:
    """The facts of ``adapter_config.json``; a LoRA variant the engine cannot run is refused."""
    try:
        cfg = json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise JobError(f"cannot read {ADAPTER_CONFIG}: {exc}") from exc
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise JobError(f"{ADAPTER_CONFIG} is not a LoRA adapter (peft_type {cfg.get('peft_type')!r})")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan-in/fan-out (Conv1D) weights"),
                     ("alpha_pattern", "per-module alphas"), ("modules_to_save", "fully trained modules")):
        if cfg.get(key):
            raise JobError(f"the adapter uses {why} ({key}), which a GGUF LoRA adapter cannot hold")
    try:
        rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    except (KeyError, TypeError, ValueError) as exc:
        raise JobError(f"{ADAPTER_CONFIG} lacks r or lora_alpha: {exc}") from exc
    if cfg.get("use_rslora"):
        if cfg.get("rank_pattern"):
            raise JobError("rank-stabilised LoRA with per-module ranks cannot be written as one alpha")
        alpha *= math.sqrt(rank)
    return AdapterConfig(rank, alpha, str(cfg.get("base_model_name_or_path") or ""))


@dataclass(frozen=True)
class _Pair:
    name: str  # the GGUF name of the base tensor
    a: TensorRef
    b: TensorRef
    rows_permute: int  # heads to permute lora_b by; 0 = none


def _pairs(refs: dict[str, TensorRef], arch: gguf.MODEL_ARCH, hp: HParams, permute_qk: bool) -> list[_Pair]:
    names = gguf.get_tensor_name_map(arch, hp.n_layer)
    found: dict[str, dict[str, TensorRef]] = {}
    for peft_name, ref in refs.items():
        m = _PEFT_NAME.match(peft_name)
        if m is None:
            raise JobError(f"adapter tensor {peft_name!r} is not a LoRA A/B weight "
                           "(embedding adapters and extra weights are not supported)")
        found.setdefault(m.group("module"), {})[m.group("ab")] = ref
    out = []
    for module, ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise JobError(f"adapter module {module} has lora_{''.join(ab)} without its pair")
        name = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if name is None:
            raise JobError(f"cannot map adapted module {module!r} to a GGUF tensor name")
        heads = 0
        if permute_qk and module.endswith(".q_proj"):
            heads = hp.n_head
        elif permute_qk and module.endswith(".k_proj"):
            heads = hp.n_head_kv
        out.append(_Pair(name, ab["A"], ab["B"], heads))
    if not out:
        raise JobError("the adapter has no LoRA weights")
    return out


def _arrays(pair: _Pair, dtype: np.dtype[Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    a, b = pair.a.load(), pair.b.load()
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise JobError(f"{pair.name}: lora_A {a.shape} and lora_B {b.shape} do not pair up")
    if pair.rows_permute:
        b = permute_rotary(b, pair.rows_permute)
    return np.ascontiguousarray(a, dtype=dtype), np.ascontiguousarray(b, dtype=dtype)


def convert_adapter(
    adapter_dir: Path, base_dir: Path, out: Path, outtype: OutType, name: str,
    check_stop: Callable[[], None] | None = None,
) -> ConvertedAdapter:
    """Write ``out`` (which the caller renames into place when complete)."""
    check_model_dir(adapter_dir)
    check_model_dir(base_dir)
    acfg = read_adapter_config(adapter_dir)
    cfg = read_config(base_dir)
    _, spec = model_arch(cfg)
    hp = HParams.from_config(cfg)
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise JobError(f"the adapter dir has no {ADAPTER_WEIGHTS}")
    pairs = _pairs(_read_header(weights), spec.arch, hp, spec.permute_qk)
    dtype = np.dtype(np.float16) if outtype == "F16" else np.dtype(np.float32)
    based_on = base_name(acfg.base or str(base_dir))
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[spec.arch])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_name(name)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, acfg.alpha)
    writer.add_base_model_count(1)
    writer.add_base_model_name(0, based_on)
    total = 0
    for pair in pairs:
        for suffix, ref in (("lora_a", pair.a), ("lora_b", pair.b)):
            nbytes = int(np.prod(ref.shape, dtype=np.int64)) * dtype.itemsize
            writer.add_tensor_info(f"{pair.name}.{suffix}", ref.shape, dtype, nbytes)
            total += nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for pair in pairs:
        if check_stop is not None:
            check_stop()
        for arr in _arrays(pair, dtype):
            writer.write_tensor_data(arr)
    writer.close()
    return ConvertedAdapter(gguf.MODEL_ARCH_NAMES[spec.arch], 2 * len(pairs), total, acfg.alpha,
                            acfg.rank, based_on)
