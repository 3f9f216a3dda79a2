"""Hugging Face model dir (Llama family, safetensors) -> GGUF F32/F16.

Our own converter on top of the ``gguf`` package: tensor names come from
gguf's tensor map, hyperparameters from ``config.json``, the vocabulary from
:mod:`jobs.hf_vocab`. Llama and Mistral Q/K weights are permuted the way
llama.cpp's rotary embedding expects (HF stores the two rotary halves apart,
llama.cpp wants them interleaved); Qwen2 uses NeoX rotary and is left as is.

Safetensors files are read by their header and memory-mapped, so no torch is
needed, and tensors are streamed to the output one at a time: memory stays
about one tensor, whatever the model size.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np

from jobs.context import JobError
from jobs.hf_vocab import load_vocab

OutType = Literal["F32", "F16"]
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class ArchSpec:
    arch: gguf.MODEL_ARCH
    permute_qk: bool


ARCHS: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(gguf.MODEL_ARCH.LLAMA, True),
    "MistralForCausalLM": ArchSpec(gguf.MODEL_ARCH.LLAMA, True),
    "Qwen2ForCausalLM": ArchSpec(gguf.MODEL_ARCH.QWEN2, False),
}
_DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8"),
}
# HF buffers that are not weights.
_SKIP_SUFFIXES = (".rotary_emb.inv_freq",)


# ------------------------------------------------------------------ safetensors


@dataclass(frozen=True)
class TensorRef:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int

    def load(self) -> np.ndarray[Any, Any]:
        """The tensor as float32 (a memory map for F32 input)."""
        if self.dtype not in _DTYPES:
            raise JobError(f"tensor dtype {self.dtype} is not supported (F32, F16, BF16 only)")
        raw = np.memmap(self.path, dtype=_DTYPES[self.dtype], mode="r", offset=self.begin,
                        shape=self.shape or (1,))
        if self.dtype == "BF16":
            # bfloat16 is the top half of a float32.
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(self.shape)
        return raw.astype(np.float32, copy=False).reshape(self.shape)


def _read_header(path: Path) -> dict[str, TensorRef]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100 * 2**20:
            raise JobError(f"{path.name}: implausible safetensors header size")
        header = json.loads(f.read(size))
    base = 8 + size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, _end = info["data_offsets"]
        out[name] = TensorRef(path, str(info["dtype"]), tuple(int(d) for d in info["shape"]), base + begin)
    return out


def read_tensors(model_dir: Path) -> dict[str, TensorRef]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise JobError("the model dir has no safetensors weights (model.safetensors or an index)")
    out: dict[str, TensorRef] = {}
    for name in files:
        out.update(_read_header(model_dir / name))
    return out


# ------------------------------------------------------------------ config


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_ctx: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> HParams:
        try:
            n_head = int(cfg["num_attention_heads"])
            n_embd = int(cfg["hidden_size"])
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
            scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
            return cls(
                n_vocab=int(cfg["vocab_size"]),
                n_ctx=int(cfg.get("max_position_embeddings", 4096)),
                n_embd=n_embd,
                n_layer=int(cfg["num_hidden_layers"]),
                n_ff=int(cfg["intermediate_size"]),
                n_head=n_head,
                n_head_kv=int(cfg.get("num_key_value_heads") or n_head),
                head_dim=int(cfg.get("head_dim") or n_embd // n_head),
                rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=scaling,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise JobError(f"config.json lacks or mangles a hyperparameter: {exc}") from exc


def model_arch(cfg: dict[str, Any]) -> tuple[str, ArchSpec]:
    archs = cfg.get("architectures") or []
    name = str(archs[0]) if archs else f"(model_type {cfg.get('model_type')!r})"
    spec = ARCHS.get(name)
    if spec is None:
        raise JobError(
            f"cannot convert architecture {name} to GGUF; supported: {', '.join(sorted(ARCHS))}"
        )
    return name, spec


def _add_rope(writer: gguf.GGUFWriter, hp: HParams) -> np.ndarray[Any, Any] | None:
    """Rope scaling keys; Llama 3 scaling becomes a ``rope_freqs`` tensor."""
    rs = hp.rope_scaling
    if rs is None:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rs["factor"]))
        return None
    if kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rs["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rs["original_max_position_embeddings"]))
        return None
    if kind == "llama3":
        return _llama3_rope_factors(hp, rs)
    raise JobError(f"rope scaling {kind!r} is not supported (linear, yarn, llama3)")


def _llama3_rope_factors(hp: HParams, rs: dict[str, Any]) -> np.ndarray[Any, Any]:
    factor = float(rs.get("factor", 8.0))
    low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (hp.rope_theta ** (np.arange(0, hp.head_dim, 2, dtype=np.float64) / hp.head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _add_hparams(writer: gguf.GGUFWriter, hp: HParams, name: str, outtype: OutType) -> None:
    writer.add_name(name)
    writer.add_context_length(hp.n_ctx)
    writer.add_embedding_length(hp.n_embd)
    writer.add_block_count(hp.n_layer)
    writer.add_feed_forward_length(hp.n_ff)
    writer.add_head_count(hp.n_head)
    writer.add_head_count_kv(hp.n_head_kv)
    writer.add_rope_dimension_count(hp.head_dim)
    if hp.head_dim != hp.n_embd // hp.n_head:
        writer.add_key_length(hp.head_dim)
        writer.add_value_length(hp.head_dim)
    writer.add_rope_freq_base(hp.rope_theta)
    writer.add_layer_norm_rms_eps(hp.rms_eps)
    writer.add_vocab_size(hp.n_vocab)
    ftype = gguf.LlamaFileType.ALL_F32 if outtype == "F32" else gguf.LlamaFileType.MOSTLY_F16
    writer.add_file_type(int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# ------------------------------------------------------------------ tensors


def permute_rotary(w: np.ndarray[Any, Any], n_head: int) -> np.ndarray[Any, Any]:
    """HF's split-halves rotary layout -> llama.cpp's interleaved one (per head)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    source: TensorRef | None
    transform: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]] | None
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    data: np.ndarray[Any, Any] | None = None

    def array(self) -> np.ndarray[Any, Any]:
        if self.data is not None:
            return self.data
        assert self.source is not None
        arr = self.source.load()
        if self.transform is not None:
            arr = self.transform(arr)
        return np.ascontiguousarray(arr, dtype=self.dtype)


def _out_dtype(shape: tuple[int, ...], outtype: OutType) -> np.dtype[Any]:
    # Norms and biases stay F32, as llama.cpp expects.
    return np.dtype(np.float16) if outtype == "F16" and len(shape) >= 2 else np.dtype(np.float32)


def plan_tensors(
    refs: dict[str, TensorRef], spec: ArchSpec, hp: HParams, outtype: OutType
) -> list[PlannedTensor]:
    names = gguf.get_tensor_name_map(spec.arch, hp.n_layer)
    plan = []
    for hf_name, ref in sorted(refs.items()):
        if hf_name.endswith(_SKIP_SUFFIXES):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise JobError(f"cannot map tensor {hf_name!r} to a GGUF name")
        transform = None
        if spec.permute_qk and ".q_proj." in hf_name:
            transform = _permuter(hp.n_head)
        elif spec.permute_qk and ".k_proj." in hf_name:
            transform = _permuter(hp.n_head_kv)
        plan.append(PlannedTensor(name, ref, transform, _out_dtype(ref.shape, outtype), ref.shape))
    return plan


def _permuter(n_head: int) -> Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]]:
    return lambda w: permute_rotary(w, n_head)


# ------------------------------------------------------------------ convert


@dataclass
class Converted:
    arch: str
    tensors: int
    bytes: int
    notes: list[str]


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise JobError(f"{model_dir.name} is not a Hugging Face model dir (no config.json)")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(cfg, dict):
        raise JobError("config.json is not a JSON object")
    return cfg


def convert(
    model_dir: Path, out: Path, outtype: OutType, name: str,
    progress: Progress | None = None, check_stop: Callable[[], None] | None = None,
) -> Converted:
    """Write ``out`` (which the caller renames into place when complete)."""
    cfg = read_config(model_dir)
    arch_name, spec = model_arch(cfg)
    hp = HParams.from_config(cfg)
    vocab = load_vocab(model_dir, hp.n_vocab)
    plan = plan_tensors(read_tensors(model_dir), spec, hp, outtype)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[spec.arch])
    _add_hparams(writer, hp, name, outtype)
    rope_freqs = _add_rope(writer, hp)
    if rope_freqs is not None:
        plan.append(PlannedTensor("rope_freqs.weight", None, None, rope_freqs.dtype, rope_freqs.shape, rope_freqs))
    vocab.add_to(writer, model_dir)
    total = _write(writer, plan, progress, check_stop)
    return Converted(arch_name, len(plan), total, vocab.notes)


def _write(
    writer: gguf.GGUFWriter, plan: list[PlannedTensor],
    progress: Progress | None, check_stop: Callable[[], None] | None,
) -> int:
    for t in plan:
        nbytes = int(np.prod(t.shape, dtype=np.int64)) * t.dtype.itemsize
        writer.add_tensor_info(t.name, t.shape, t.dtype, nbytes)
    total = sum(int(np.prod(t.shape, dtype=np.int64)) * t.dtype.itemsize for t in plan)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done = 0
    for t in _checked(plan, check_stop):
        arr = t.array()
        writer.write_tensor_data(arr)
        done += arr.nbytes
        if progress is not None:
            progress(done, total, t.name)
    writer.close()
    return total


def _checked(plan: list[PlannedTensor], check_stop: Callable[[], None] | None) -> Iterator[PlannedTensor]:
    for t in plan:
        if check_stop is not None:
            check_stop()
        yield t
