"""GGUF LoRA adapters in the model library, and the base models they fit.

A GGUF whose ``general.type`` is ``adapter`` is no model of its own: the
library lists it here and links it to base models. The candidates are the
models named by the adapter's recorded base (``general.base_model.0.name``,
matched against a model's ``general.name`` and its file name; a base
named ``<name>-hf`` also names the GGUF ``<name>``), or, when it records
none, every model of its architecture. A candidate fits when its
architecture is the adapter's and every weight the adapter changes exists
in it with the same shape (the engine refuses anything else at load, and
would take the base down with it). Each fitting pair is served under its
own model id, ``<base id>:<adapter id>``; a candidate that does not fit is
listed with the reason and never loaded with the adapter.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

# The header reader's own cursor and key parser: its tensor index keeps only
# sizes, and linking needs each tensor's shape.
from formats.gguf_layout import TensorRecord, layout_fault
from supervisor.models.file_faults import FaultLog
from supervisor.models.gguf_header import GgufError, _alignment, _Cursor, _parse

if TYPE_CHECKING:
    from supervisor.models.library import ModelEntry

_LORA_A, _LORA_B = ".lora_a", ".lora_b"
_MAX_TENSORS = 100_000
_MAX_DIMS = 8
# A file name's quantization or precision suffix, e.g. "-Q8_0", ".F16".
_QUANT_SUFFIX = re.compile(r"[-_.](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)
# A model's Hugging Face form is often named "<name>-hf" beside its GGUF
# "<name>": Llama 2's repos, and the demo pair tiny-random-demo-hf and
# tiny-random-demo (supervisor/models/demo_hf.py).
_HF_SUFFIX = re.compile(r"[-_.]hf$", re.IGNORECASE)

Shapes = dict[str, tuple[int, ...]]  # tensor name -> ggml dims (ne[0] first)


class AdapterInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Header facts of a GGUF LoRA adapter."""

    architecture: str
    name: str | None = None
    base_name: str | None = None
    alpha: float = 0.0
    rank: int = 0
    # Each adapted base weight -> (n_in, n_out), as ggml dims of the weight.
    weights: dict[str, tuple[int, int]] = {}


class AdapterLink(msgspec.Struct, frozen=True, kw_only=True):
    base: str  # the base model's id
    id: str  # the pair's model id
    fits: bool
    reason: str | None = None


class AdapterEntry(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    path: str
    size_bytes: int
    mtime: float
    info: AdapterInfo | None = None
    links: list[AdapterLink] = []
    usable: bool = True
    reason: str | None = None
    # The file's own fault (its tensor data as the engine reads it), when it
    # has one: then no base takes it, whatever the shapes say.
    fault: str | None = None


class AdapterRef(msgspec.Struct, frozen=True, kw_only=True):
    """An adapter as its base's entry holds it: what a worker loads."""

    id: str
    path: str
    size_bytes: int
    mtime: float = 0.0


def pair_id(base_id: str, adapter_id: str) -> str:
    return f"{base_id}:{adapter_id}"


# ------------------------------------------------------------------ headers


class Header(msgspec.Struct, frozen=True):
    """An adapter's (or a base's) header: keys, each tensor's dims, and why
    the engine would refuse its tensor data (formats/gguf_layout.py), if so."""

    kv: dict[str, Any]
    shapes: Shapes
    fault: str | None = None


def read_shapes(path: Path) -> Header:
    """The header's keys and each tensor's dims; raises :class:`GgufError`."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            cur = _Cursor(mm, path)
            _, count, kv, _ = _parse(cur)
            if count > _MAX_TENSORS:
                raise GgufError(path, f"implausible tensor count {count}")
            records: list[TensorRecord] = []
            for _ in range(count):
                name = cur.string("tensor name")
                n_dims = cur.u32(f"tensor {name!r}")
                if n_dims > _MAX_DIMS:
                    raise GgufError(path, f"tensor {name!r} claims {n_dims} dimensions")
                dims = tuple(cur.u64(f"tensor {name!r}") for _ in range(n_dims))
                records.append(TensorRecord(name, dims, cur.u32(f"tensor {name!r}"), cur.u64(f"tensor {name!r}")))
            alignment = _alignment(cur, kv)
            fault = layout_fault(records, data_start=-(-cur.pos // alignment) * alignment,
                                 alignment=alignment, file_size=cur.size)
            return Header(kv, {r.name: r.dims for r in records}, fault)
    except (OSError, ValueError) as exc:
        raise GgufError(path, f"cannot read file: {exc}") from exc


def adapter_info(kv: dict[str, Any], shapes: Shapes, path: Path) -> AdapterInfo:
    """Interpret an adapter's header; an adapter the engine cannot load raises GgufError."""
    if kv.get("adapter.type") != "lora":
        raise GgufError(path, f"adapter type {kv.get('adapter.type')!r} is not lora")
    weights: dict[str, tuple[int, int]] = {}
    ranks = set()
    for name, a in shapes.items():
        if not name.endswith(_LORA_A):
            continue
        weight = name[: -len(_LORA_A)]
        b = shapes.get(weight + _LORA_B)
        if b is None or len(a) != 2 or len(b) != 2 or a[1] != b[0]:
            raise GgufError(path, f"{weight}: lora_a {list(a)} and lora_b {list(b or [])} do not pair up")
        weights[weight] = (a[0], b[1])
        ranks.add(a[1])
    if not weights:
        raise GgufError(path, "the adapter has no lora_a/lora_b tensors")
    base = kv.get("general.base_model.0.name")
    return AdapterInfo(
        architecture=str(kv.get("general.architecture", "")),
        name=kv.get("general.name") if isinstance(kv.get("general.name"), str) else None,
        base_name=base if isinstance(base, str) and base else None,
        alpha=float(kv.get("adapter.lora.alpha") or 0.0),
        rank=max(ranks),
        weights=weights,
    )


class HeaderCache:
    """Tensor shapes per file, read again only when its size or mtime changes."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, int, Header | GgufError]] = {}

    def get(self, path: Path) -> Header:
        st = os.stat(path)
        key = str(path)
        hit = self._cache.get(key)
        if hit is None or hit[:2] != (st.st_size, st.st_mtime_ns):
            try:
                value: Header | GgufError = read_shapes(path)
            except GgufError as exc:
                value = exc
            hit = self._cache[key] = (st.st_size, st.st_mtime_ns, value)
        if isinstance(hit[2], GgufError):
            raise hit[2]
        return hit[2]

    def keep(self, alive: Iterable[str]) -> None:
        keep = set(alive)
        self._cache = {k: v for k, v in self._cache.items() if k in keep}


# ------------------------------------------------------------------ linking


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _names(base: ModelEntry) -> set[str]:
    stem = base.id.rsplit("/", 1)[-1]
    names = {stem, _QUANT_SUFFIX.sub("", stem)}
    if base.info is not None and base.info.name:
        names.add(base.info.name)
    return {_norm(n) for n in names}


def _wanted(base_name: str) -> set[str]:
    """The names a recorded base goes by: its own, and without a ``-hf`` suffix."""
    return {_norm(base_name), _norm(_HF_SUFFIX.sub("", base_name))}


def misfit(info: AdapterInfo, base: ModelEntry, shapes: Shapes) -> str | None:
    """Why ``info`` cannot run on ``base``; None when it fits."""
    arch = base.info.architecture if base.info is not None else None
    if arch != info.architecture:
        return f"the adapter is for {info.architecture}, the base is {arch}"
    for weight, (n_in, n_out) in sorted(info.weights.items()):
        dims = shapes.get(weight)
        if dims is None:
            return f"the base has no tensor {weight}"
        if tuple(dims[:2]) != (n_in, n_out):
            # Any number of dims: a crafted base may give this weight one, or none.
            shape = "x".join(map(str, dims)) or "a scalar"
            return f"{weight} is {shape} in the base, the adapter expects {n_in}x{n_out}"
    return None


def link(info: AdapterInfo, adapter_id: str, bases: list[ModelEntry],
         shapes_of: Callable[[ModelEntry], Shapes]) -> tuple[list[AdapterLink], str | None]:
    """The adapter's candidate bases, each fitting or not; why none fits, if so."""
    usable = [b for b in bases if b.usable and b.info is not None]
    if info.base_name is not None:
        want = _wanted(info.base_name)
        candidates = [b for b in usable if want & _names(b)]
        if not candidates:
            return [], f"no model named {info.base_name} (its recorded base) in the library"
    else:
        candidates = [b for b in usable if b.info is not None and b.info.architecture == info.architecture]
        if not candidates:
            return [], f"no {info.architecture} model in the library"
    links = []
    for base in sorted(candidates, key=lambda b: b.id):
        try:
            why = misfit(info, base, shapes_of(base))
        except (GgufError, OSError) as exc:
            why = f"cannot read the base's tensors: {exc}"
        links.append(AdapterLink(base=base.id, id=pair_id(base.id, adapter_id), fits=why is None, reason=why))
    if not any(lk.fits for lk in links):
        return links, "fits none of its candidate bases: " + "; ".join(
            f"{lk.base}: {lk.reason}" for lk in links)
    return links, None


def adapter_bytes(adapters: Iterable[AdapterRef]) -> int:
    """What a worker's adapters add to its memory: their tensor data, which
    the engine keeps beside the weights they change (the file size bounds it)."""
    return sum(a.size_bytes for a in adapters)


def _is_adapter(entry: ModelEntry) -> bool:
    return entry.info is not None and entry.info.general_type == "adapter"


class AdapterLinker:
    """Takes the adapters out of a scan's entries and links them to the bases they fit."""

    def __init__(self) -> None:
        self._headers = HeaderCache()
        self._faults = FaultLog()

    def split(self, found: dict[str, ModelEntry], alive: Iterable[str]
              ) -> tuple[dict[str, ModelEntry], dict[str, AdapterEntry]]:
        """(models, each holding the adapters that fit it; adapters by id)."""
        models = {k: e for k, e in found.items() if not _is_adapter(e)}
        adapters = {e.id: self._adapter(e, list(models.values()))
                    for e in found.values() if _is_adapter(e)}
        self._headers.keep(alive)
        self._faults.keep(alive)
        refs: dict[str, list[AdapterRef]] = {}
        for a in adapters.values():
            for lk in a.links:
                if lk.fits:
                    refs.setdefault(lk.base, []).append(
                        AdapterRef(id=a.id, path=a.path, size_bytes=a.size_bytes, mtime=a.mtime))
        return {k: msgspec.structs.replace(e, adapters=refs.get(k, [])) for k, e in models.items()}, adapters

    def _adapter(self, entry: ModelEntry, bases: list[ModelEntry]) -> AdapterEntry:
        info: AdapterInfo | None = None
        links: list[AdapterLink] = []
        fault: str | None = None
        try:
            header = self._headers.get(Path(entry.path))
            info = adapter_info(header.kv, header.shapes, Path(entry.path))
            links, reason = link(info, entry.id, bases, self._base_shapes)
            if header.fault is not None:
                # Listed with its candidates, each refused for the file's own fault.
                fault = reason = f"the engine would refuse the file: {header.fault}"
                links = [msgspec.structs.replace(lk, fits=False, reason=fault) for lk in links]
        except GgufError as exc:
            reason = exc.reason
        except OSError as exc:
            reason = f"cannot read the adapter: {exc}"
        except Exception as exc:  # a crafted file's fault costs this adapter alone (file_faults.py)
            reason = self._faults.reason(entry.path, "cannot interpret the adapter", exc)
        return AdapterEntry(id=entry.id, path=entry.path, size_bytes=entry.size_bytes, mtime=entry.mtime,
                            info=info, links=links, usable=reason is None, reason=reason, fault=fault)

    def _base_shapes(self, base: ModelEntry) -> Shapes:
        shapes: Shapes = {}
        for f in base.files:
            shapes.update(self._headers.get(Path(f)).shapes)
        return shapes
