"""The ``quantize`` kind: GGUF -> GGUF with llama.cpp's mixes and ggml's kernels.

Before any work it refuses, with a clear error, a file that is not GGUF, an
already-quantized model (unless ``allow_requantize``), a type the tensor
shapes cannot take, and a disk without room for the output. The output is
written under a hidden temporary name in the models dir and renamed into
place only when complete, so a half-written file is never served.

Each tensor's type comes from :mod:`jobs.quantize_rules` (llama.cpp's rules);
its bytes from ggml's row kernels (:mod:`jobs.quantize_native`). The input is
read in slabs of rows, so memory stays bounded by the slab, not the model,
and a stop request is honoured between slabs: the partial output is removed.
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import IO, Any

import gguf
import numpy as np
import numpy.typing as npt

from jobs.context import JobContext, JobError, JobStopped
from jobs.events import JobIO
from jobs.params import JobParams, QuantizeParams
from jobs.quantize_native import Kernels
from jobs.quantize_plan import (
    TYPES,
    UNQUANTIZED,
    Plan,
    TensorItem,
    inspect_model,
    open_gguf,
    scalar,
    tensor_items,
)
from jobs.quantize_rules import (
    Mix,
    n_dims,
)
from jobs.sizes import size_text

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
_DISK_MARGIN = 64 * 1024 * 1024
# Float values converted per slab: large enough to keep every thread busy,
# small enough that a stop request is seen within a fraction of a second.
_SLAB_VALUES = 4 * 1024 * 1024
_SPLIT_KEYS = frozenset({
    gguf.Keys.Split.LLM_KV_SPLIT_NO, gguf.Keys.Split.LLM_KV_SPLIT_COUNT,
    gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT,
})
# Written last, in this order, as llama.cpp does.
_REWRITTEN_KEYS = (gguf.Keys.General.QUANTIZATION_VERSION, gguf.Keys.General.FILE_TYPE)


def check_plan(io: JobIO, plan: Plan, params: QuantizeParams, out_dir: Path) -> None:
    if plan.quantized and not params.allow_requantize:
        raise JobError(
            "the model is already quantized; requantizing loses quality, set allow_requantize to do it"
        )
    block = gguf.GGML_QUANT_SIZES[TYPES[params.type].base][0]
    if plan.incompatible and len(plan.incompatible) * 2 > plan.quantizable:
        name, row = plan.incompatible[0]
        raise JobError(
            f"{params.type} needs weight rows that are a multiple of {block} values, but "
            f"{len(plan.incompatible)} of {plan.quantizable} weights do not (e.g. {name} has "
            f"rows of {row}); pick a type with smaller blocks such as Q8_0 or F16"
        )
    if plan.incompatible:
        io.log(f"{len(plan.incompatible)} tensors cannot take {params.type}; they get a fallback type as in llama.cpp")
    free = shutil.disk_usage(out_dir).free
    needed = int(plan.estimate_bytes * 1.05) + _DISK_MARGIN
    if free < needed:
        raise JobError(
            f"not enough free disk in the models dir: {free // 2**20} MiB free, "
            f"about {needed // 2**20} MiB needed"
        )


def _kv_value(key: str, field: gguf.ReaderField) -> tuple[Any, V, V | None]:
    """A field as GGUFWriter takes it; strings stay raw bytes, so nothing is re-encoded."""
    main = V(field.types[0])
    if main == V.STRING:
        return bytes(field.parts[field.data[0]]), main, None
    if main != V.ARRAY:
        return field.contents(), main, None
    if len(field.types) != 2:
        raise JobError(f"cannot copy {key}: nested arrays are not supported")
    sub = V(field.types[1])
    if sub == V.STRING:
        return [bytes(field.parts[i]) for i in field.data], main, sub
    return field.contents(), main, sub


def _copy_kv(io: JobIO, reader: gguf.GGUFReader, writer: gguf.GGUFWriter, mix: Mix) -> None:
    for key, field in reader.fields.items():
        # GGUF.* are the reader's view of the file header; the writer makes its own.
        if key.startswith("GGUF.") or key in _SPLIT_KEYS or key in _REWRITTEN_KEYS:
            continue
        if key == gguf.Keys.General.ARCHITECTURE:
            continue  # the writer starts with it
        value, vtype, sub = _kv_value(key, field)
        if vtype == V.ARRAY and len(value) == 0:
            io.log(f"dropped the empty array {key}: GGUF writers cannot store empty arrays")
            continue
        writer.add_key_value(key, value, vtype, sub)
    writer.add_uint32(gguf.Keys.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION)
    writer.add_uint32(gguf.Keys.General.FILE_TYPE, int(mix.ftype))


def _write_header(io: JobIO, reader: gguf.GGUFReader, items: list[TensorItem], mix: Mix, tmp: Path) -> None:
    arch = scalar(reader, gguf.Keys.General.ARCHITECTURE)
    writer = gguf.GGUFWriter(tmp, str(arch))
    writer.data_alignment = reader.alignment
    _copy_kv(io, reader, writer, mix)
    for item in items:
        shape = item.shape[: n_dims(item.shape)]
        writer.add_tensor_info(item.name, list(reversed(shape)), np.dtype(np.float32),
                               item.out_bytes(), raw_dtype=item.dst_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
    finally:
        writer.close()


def _check_input(reader: gguf.GGUFReader, items: list[TensorItem], params: QuantizeParams) -> None:
    if reader.byte_order != "I":
        raise JobError("big-endian GGUF files are not supported")
    splits = scalar(reader, gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
    if splits is not None and int(splits) > 1:
        raise JobError("the model is split into several files; merge them first")
    for item in items:
        if item.src_type != item.dst_type and item.src_type not in UNQUANTIZED and not params.allow_requantize:
            raise JobError(f"{item.name} is already {item.src_type.name}; set allow_requantize to convert it")


class _Writer:
    """The output's tensor data section: aligned tensors, appended in order."""

    def __init__(self, out: IO[bytes], alignment: int) -> None:
        self._out = out
        self._alignment = alignment
        self.written = 0
        self._pad()

    def _pad(self) -> None:
        self._out.write(b"\0" * (-self._out.tell() % self._alignment))

    def write(self, data: npt.NDArray[np.uint8]) -> None:
        self._out.write(data.data)
        self.written += data.size

    def end_tensor(self) -> None:
        self._pad()


def _read(src: BufferedReader, offset: int, buf: npt.NDArray[np.uint8]) -> None:
    src.seek(offset)
    if src.readinto(buf.data) != buf.size:
        raise JobError("the input ended inside a tensor (truncated file?)")


def _row_parts(n_rows: int, parts: int) -> list[tuple[int, int]]:
    """Split ``n_rows`` into up to ``parts`` contiguous, non-empty [start, stop) ranges."""
    parts = max(1, min(parts, n_rows))
    return list(itertools.pairwise(n_rows * i // parts for i in range(parts + 1)))


@dataclass
class _Slab:
    """Reusable buffers for one tensor's row slabs."""

    raw: npt.NDArray[np.uint8]
    floats: npt.NDArray[np.float32]
    out: npt.NDArray[np.uint8]
    rows: int


def _slab(kernels: Kernels, item: TensorItem) -> _Slab:
    rows = max(1, min(item.n_rows, _SLAB_VALUES // item.n_per_row))
    src_row = kernels.row_size(item.src_type, item.n_per_row)
    dst_row = kernels.row_size(item.dst_type, item.n_per_row)
    floats = np.empty(0 if item.src_type == Q.F32 else rows * item.n_per_row, dtype=np.float32)
    return _Slab(np.empty(rows * src_row, np.uint8), floats, np.empty(rows * dst_row, np.uint8), rows)


class _Converter:
    """Turns slabs of input rows into output rows on a pool of threads."""

    def __init__(self, kernels: Kernels, pool: ThreadPoolExecutor, threads: int) -> None:
        self.kernels = kernels
        self._pool = pool
        self._threads = threads

    def _part(self, item: TensorItem, slab: _Slab, rows: tuple[int, int]) -> None:
        k, n = self.kernels, item.n_per_row
        src_row, dst_row = k.row_size(item.src_type, n), k.row_size(item.dst_type, n)
        a, b = rows
        raw = slab.raw[a * src_row: b * src_row]
        if item.src_type == Q.F32:
            floats = raw.view(np.float32)
        else:
            floats = slab.floats[a * n: b * n]
            k.to_float(item.src_type, raw, floats)
        k.quantize_rows(item.dst_type, floats, slab.out[a * dst_row: b * dst_row], n)

    def convert(self, item: TensorItem, slab: _Slab, nrows: int) -> npt.NDArray[np.uint8]:
        """Convert the first ``nrows`` rows held in ``slab.raw``; returns their output bytes."""
        futures = [self._pool.submit(self._part, item, slab, part)
                   for part in _row_parts(nrows, self._threads)]
        for f in futures:
            f.result()
        return slab.out[: nrows * self.kernels.row_size(item.dst_type, item.n_per_row)]


def _slabs(item: TensorItem, kernels: Kernels, slab: _Slab) -> Iterator[tuple[int, int]]:
    """(input byte offset, rows) of each slab of ``item``."""
    src_row = kernels.row_size(item.src_type, item.n_per_row)
    for first in range(0, item.n_rows, slab.rows):
        yield item.offset + first * src_row, min(slab.rows, item.n_rows - first)


@dataclass
class _Progress:
    io: JobIO
    total: int
    estimate: int
    done: int = 0

    def advance(self, n_bytes: int, written: int, tensor: int, tensors: int) -> None:
        self.done += n_bytes
        self.io.progress(min(0.99, self.done / max(1, self.total)),
                         message=f"tensor {tensor}/{tensors}, {size_text(written)} of about "
                                 f"{size_text(self.estimate)} written")


def _stop_point(io: JobIO) -> None:
    if io.stop_requested:
        raise JobStopped("stopped on request while quantizing (partial output removed)")


def _copy_tensor(src: BufferedReader, out: _Writer, item: TensorItem, progress: _Progress, n: tuple[int, int]) -> None:
    buf = np.empty(min(item.n_bytes, _SLAB_VALUES * 4), np.uint8)
    for start in range(0, item.n_bytes, buf.size):
        _stop_point(progress.io)
        part = buf[: min(buf.size, item.n_bytes - start)]
        _read(src, item.offset + start, part)
        out.write(part)
        progress.advance(part.size, out.written, *n)


def _convert_tensor(src: BufferedReader, out: _Writer, item: TensorItem, conv: _Converter,
                    progress: _Progress, n: tuple[int, int]) -> None:
    slab = _slab(conv.kernels, item)
    src_row = conv.kernels.row_size(item.src_type, item.n_per_row)
    for offset, rows in _slabs(item, conv.kernels, slab):
        _stop_point(progress.io)
        _read(src, offset, slab.raw[: rows * src_row])
        out.write(conv.convert(item, slab, rows))
        progress.advance(rows * src_row, out.written, *n)


def _threads(params: QuantizeParams) -> int:
    if params.nthread:
        return params.nthread
    # The CPUs this process may run on, which a container or taskset may limit.
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _kernels_for(items: list[TensorItem]) -> Kernels:
    """ggml's kernels, checked and prepared for every conversion ``items`` need."""
    kernels = Kernels.load()
    converted = [i for i in items if i.dst_type != i.src_type]
    for qtype in {i.dst_type for i in converted}:
        kernels.check_type(qtype)
        kernels.prepare(qtype)
    for qtype in {i.src_type for i in converted}:
        kernels.prepare_source(qtype)
    return kernels


def _write_tensors(fin: BufferedReader, out: _Writer, items: list[TensorItem], conv: _Converter,
                   progress: _Progress) -> None:
    for n, item in enumerate(items, 1):
        before = out.written
        if item.dst_type == item.src_type:
            _copy_tensor(fin, out, item, progress, (n, len(items)))
        else:
            _convert_tensor(fin, out, item, conv, progress, (n, len(items)))
        if out.written - before != item.out_bytes():
            # The header already promised this size; a mismatch would shift every later tensor.
            raise JobError(f"{item.name}: wrote {out.written - before} bytes, the header says {item.out_bytes()}")
        out.end_tensor()


def quantize(io: JobIO, src: Path, tmp: Path, params: QuantizeParams, estimate: int) -> None:
    """Write ``src`` quantized to ``params.type`` into ``tmp``."""
    mix = TYPES[params.type]
    reader = open_gguf(src)
    items = tensor_items(reader, mix)
    _check_input(reader, items, params)
    kernels = _kernels_for(items)
    _write_header(io, reader, items, mix, tmp)
    progress = _Progress(io, sum(i.n_bytes for i in items), estimate)
    threads = _threads(params)
    with ThreadPoolExecutor(threads, thread_name_prefix="quantize") as pool, \
            src.open("rb") as fin, tmp.open("ab") as fout:
        _write_tensors(fin, _Writer(fout, reader.alignment), items, _Converter(kernels, pool, threads), progress)
        fout.flush()
        os.fsync(fout.fileno())


def run(io: JobIO, params: JobParams, ctx: JobContext) -> dict[str, Any]:
    if not isinstance(params, QuantizeParams) or params.output_name is None:
        raise JobError("quantize needs resolved QuantizeParams")
    src = Path(params.model)
    out_dir = Path(ctx.models_dir)
    out = out_dir / params.output_name
    io.stage("checking")
    plan = inspect_model(src, params.type)
    check_plan(io, plan, params, out_dir)
    if out.exists() and not params.overwrite:
        raise JobError(f"{out.name} already exists; set overwrite to replace it")
    tmp = out_dir / f".{out.name}.{ctx.job_id}.partial"
    io.stage("quantizing")
    io.log(f"quantizing {src.name} to {params.type}, about {size_text(plan.estimate_bytes)}")
    started = time.monotonic()
    try:
        quantize(io, src, tmp, params, plan.estimate_bytes)
        with tmp.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise JobError("the quantizer wrote an output that is not GGUF")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    size = out.stat().st_size
    return {
        "output_path": str(out),
        "bytes": size,
        "type": params.type,
        "model": out.name[: -len(".gguf")],
        "input_bytes": src.stat().st_size,
        "seconds": round(time.monotonic() - started, 3),
    }
