"""Hugging Face model dir (safetensors) -> GGUF F32/F16.

Our own converter on top of the ``gguf`` package: tensor names come from
gguf's tensor map for the family's architecture, hyperparameters and family
metadata from ``config.json`` (:mod:`jobs.hf_arch`, which also lists the
families), the vocabulary from :mod:`jobs.hf_vocab`. Per-expert weights of a
mixture-of-experts layer are stacked into one tensor per projection, as
llama.cpp's expert kernels read them.

Safetensors files are read by their header and memory-mapped, so no torch is
needed, and tensors are streamed to the output one at a time: memory stays
about one tensor, whatever the model size.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np

from jobs.context import JobError

# Re-exported: the adapter export and the tests read them from here.
from jobs.hf_arch import ARCHS as ARCHS
from jobs.hf_arch import ArchSpec, add_hparams, add_rope
from jobs.hf_arch import HParams as HParams
from jobs.hf_arch import model_arch as model_arch
from jobs.hf_files import check_model_dir, model_file
from jobs.hf_vocab import load_vocab

OutType = Literal["F32", "F16"]
Progress = Callable[[int, int, str], None]


_DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8"),
}
# HF buffers that are not weights.
_SKIP_SUFFIXES = (".rotary_emb.inv_freq",)
# One expert's projection: <layer>.mlp.experts.<n>.<proj>.weight
_EXPERT = re.compile(r"^(?P<head>.+\.experts)\.(?P<n>\d+)\.(?P<tail>.+)$")
# Kept F32 in an F16 file, as llama.cpp's converter keeps them: the expert
# router decides which weights run at all, so its rounding is not local.
_KEEP_F32 = (".ffn_gate_inp.weight",)


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
        try:
            files = sorted({str(f) for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise JobError(f"cannot read {index.name}: {exc!r}") from exc
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise JobError("the model dir has no safetensors weights (model.safetensors or an index)")
    out: dict[str, TensorRef] = {}
    for name in files:
        out.update(_read_header(model_file(model_dir, name, "model.safetensors.index.json")))
    return out


# ------------------------------------------------------------------ tensors


def permute_rotary(w: np.ndarray[Any, Any], n_head: int) -> np.ndarray[Any, Any]:
    """HF's split-halves rotary layout -> llama.cpp's interleaved one (per head)."""
    if not w.shape or w.shape[0] % (2 * n_head):
        raise JobError(f"a Q/K weight of shape {list(w.shape)} does not split into {n_head} heads "
                       "(config.json's head counts do not fit the weights)")
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


Transform = Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]]


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    sources: tuple[TensorRef, ...]  # more than one: stacked (experts) along a new first axis
    transform: Transform | None
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    data: np.ndarray[Any, Any] | None = None

    def array(self) -> np.ndarray[Any, Any]:
        if self.data is not None:
            return self.data
        parts = []
        for ref in self.sources:
            arr = ref.load()
            parts.append(arr if self.transform is None else self.transform(arr))
        arr = parts[0] if len(parts) == 1 else np.stack(parts)
        return np.ascontiguousarray(arr, dtype=self.dtype)


def _out_dtype(name: str, shape: tuple[int, ...], outtype: OutType) -> np.dtype[Any]:
    # Norms and biases stay F32, as llama.cpp expects.
    half = outtype == "F16" and len(shape) >= 2 and not name.endswith(_KEEP_F32)
    return np.dtype(np.float16) if half else np.dtype(np.float32)


def _group_experts(refs: dict[str, TensorRef]) -> dict[str, tuple[TensorRef, ...]]:
    """HF name -> its tensors; one expert's projections under the stacked name
    (``...mlp.experts.down_proj.weight``), in expert order."""
    out: dict[str, tuple[TensorRef, ...]] = {}
    experts: dict[str, dict[int, TensorRef]] = {}
    for hf_name, ref in refs.items():
        m = _EXPERT.match(hf_name)
        if m is None:
            out[hf_name] = (ref,)
        else:
            experts.setdefault(f"{m['head']}.{m['tail']}", {})[int(m["n"])] = ref
    for stacked, by_n in experts.items():
        if sorted(by_n) != list(range(len(by_n))):
            raise JobError(f"{stacked}: experts {sorted(by_n)} are not numbered 0..{len(by_n) - 1}")
        parts = tuple(by_n[i] for i in range(len(by_n)))
        if len({p.shape for p in parts}) != 1:
            raise JobError(f"{stacked}: the experts' weights differ in shape")
        out[stacked] = parts
    return out


def _transform(hf_name: str, spec: ArchSpec, hp: HParams) -> Transform | None:
    if spec.permute_qk and ".q_proj." in hf_name:
        return _permuter(hp.n_head)
    if spec.permute_qk and ".k_proj." in hf_name:
        return _permuter(hp.n_head_kv)
    if spec.norm_plus_one and hf_name.endswith("norm.weight"):
        return _plus_one
    return None


def _plus_one(w: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return w + np.float32(1.0)


def _tied_output(refs: dict[str, TensorRef], arch: str) -> None:
    """An architecture without an output tensor reuses the embeddings: a
    separate head that differs from them cannot be written."""
    head, embed = refs["lm_head.weight"], refs.get("model.embed_tokens.weight")
    if embed is None or not np.array_equal(head.load(), embed.load()):
        raise JobError(f"the model has an output head of its own, but llama.cpp's {arch} "
                       "ties it to the token embeddings")


def plan_tensors(
    refs: dict[str, TensorRef], spec: ArchSpec, hp: HParams, outtype: OutType
) -> list[PlannedTensor]:
    names = gguf.get_tensor_name_map(spec.arch, hp.n_layer)
    arch = gguf.MODEL_ARCH_NAMES[spec.arch]
    plan = []
    for hf_name, parts in sorted(_group_experts(refs).items()):
        if hf_name.endswith(_SKIP_SUFFIXES):
            continue
        if hf_name == "lm_head.weight" and not spec.has_output:
            _tied_output(refs, arch)
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise JobError(f"cannot map tensor {hf_name!r} to a GGUF name of {arch}")
        shape = parts[0].shape if len(parts) == 1 else (len(parts), *parts[0].shape)
        plan.append(PlannedTensor(name, parts, _transform(hf_name, spec, hp),
                                  _out_dtype(name, shape, outtype), shape))
    return plan


def _permuter(n_head: int) -> Transform:
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
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise JobError(f"cannot read config.json: {exc}") from exc
    if not isinstance(cfg, dict):
        raise JobError("config.json is not a JSON object")
    return cfg


def convert(
    model_dir: Path, out: Path, outtype: OutType, name: str,
    progress: Progress | None = None, check_stop: Callable[[], None] | None = None,
) -> Converted:
    """Write ``out`` (which the caller renames into place when complete)."""
    check_model_dir(model_dir)
    cfg = read_config(model_dir)
    arch_name, spec = model_arch(cfg)
    hp = HParams.from_config(cfg)
    vocab = load_vocab(model_dir, hp.n_vocab)
    plan = plan_tensors(read_tensors(model_dir), spec, hp, outtype)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[spec.arch])
    ftype = gguf.LlamaFileType.ALL_F32 if outtype == "F32" else gguf.LlamaFileType.MOSTLY_F16
    add_hparams(writer, hp, name, ftype)
    notes = spec.meta(writer, cfg, hp) if spec.meta is not None else []
    rope_freqs = add_rope(writer, hp)
    if rope_freqs is not None:
        plan.append(PlannedTensor("rope_freqs.weight", (), None, rope_freqs.dtype, rope_freqs.shape, rope_freqs))
    vocab.add_to(writer, model_dir)
    if vocab.model == "llama" and not spec.space_prefix:
        writer.add_add_space_prefix(False)
    total = _write(writer, plan, progress, check_stop)
    return Converted(arch_name, len(plan), total, [*vocab.notes, *notes])


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
