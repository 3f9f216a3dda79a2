"""ggml's row kernels, called through ctypes from the library xllamacpp ships.

The quantizer's rules live in :mod:`jobs.quantize_rules`; the arithmetic that
turns float rows into blocks is ggml's own (``ggml_quantize_chunk``, the same
kernel llama.cpp's quantizer calls), so the bytes match llama.cpp's output.
Rows are independent, so any split of a tensor into row chunks, on any number
of threads, gives the same bytes. ctypes drops the GIL around each call, so
row chunks can run on Python threads in parallel.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from jobs.context import JobError

Q = gguf.GGMLQuantizationType
_FLOAT_SOURCES: Mapping[Q, str] = MappingProxyType(
    {Q.F16: "ggml_fp16_to_fp32_row", Q.BF16: "ggml_bf16_to_fp32_row"})
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def library_path() -> Path:
    """The shared library inside the installed xllamacpp package."""
    spec = importlib.util.find_spec("xllamacpp")
    if spec is None or not spec.submodule_search_locations:
        raise JobError("xllamacpp is not installed; it provides the quantization kernels")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("xllamacpp*.so"))
        if found:
            return found[0]
    raise JobError("xllamacpp is installed without its native library")


class Kernels:
    """The few ggml entry points the quantizer needs, with their C signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._converters: dict[Q, Any] = {}
        self._bind("ggml_type_name", ctypes.c_char_p, [ctypes.c_int])
        self._bind("ggml_blck_size", _I64, [ctypes.c_int])
        self._bind("ggml_row_size", ctypes.c_size_t, [ctypes.c_int, _I64])
        self._bind("ggml_quantize_init", None, [ctypes.c_int])
        self._bind("ggml_quantize_requires_imatrix", ctypes.c_bool, [ctypes.c_int])
        self._bind("ggml_quantize_chunk", ctypes.c_size_t, [ctypes.c_int, _P, _P, _I64, _I64, _I64, _P])
        self._bind("ggml_validate_row_data", ctypes.c_bool, [ctypes.c_int, _P, ctypes.c_size_t])

    @classmethod
    def load(cls) -> Kernels:
        path = library_path()
        try:
            return cls(ctypes.CDLL(str(path)))
        except (OSError, AttributeError) as exc:
            raise JobError(f"cannot use the quantization kernels in {path.name}: {exc}") from exc

    def _bind(self, name: str, restype: Any, argtypes: list[Any]) -> None:
        fn = getattr(self._lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


    def check_type(self, qtype: Q) -> None:
        """Refuse a type whose number means something else in this build of ggml."""
        name = self._lib.ggml_type_name(int(qtype))
        if name is None or name.decode().upper() != qtype.name:
            raise JobError(f"the quantization library numbers {qtype.name} differently; update xllamacpp")
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        if int(self._lib.ggml_blck_size(int(qtype))) != block or self.row_size(qtype, block) != size:
            raise JobError(f"the quantization library lays out {qtype.name} blocks differently")
        if self._lib.ggml_quantize_requires_imatrix(int(qtype)):
            raise JobError(f"{qtype.name} needs an importance matrix, which this job does not take")

    def row_size(self, qtype: Q, n_per_row: int) -> int:
        return int(self._lib.ggml_row_size(int(qtype), n_per_row))

    def prepare(self, qtype: Q) -> None:
        # Builds the type's lookup tables once, before threads use them.
        self._lib.ggml_quantize_init(int(qtype))

    def quantize_rows(self, qtype: Q, src: npt.NDArray[np.float32], dst: npt.NDArray[np.uint8], n_per_row: int) -> None:
        """Quantize the float rows in ``src`` into ``dst``, which must be exactly their size."""
        nrows = src.size // n_per_row
        written = int(self._lib.ggml_quantize_chunk(
            int(qtype), src.ctypes.data, dst.ctypes.data, 0, nrows, n_per_row, None))
        if written != dst.size:
            raise JobError(f"ggml wrote {written} bytes for {nrows} {qtype.name} rows, expected {dst.size}")
        if not self._lib.ggml_validate_row_data(int(qtype), dst.ctypes.data, dst.size):
            raise JobError(f"the {qtype.name} data failed validation (the input has NaN or infinite values?)")

    def prepare_source(self, qtype: Q) -> None:
        """Find the converter from ``qtype`` to float, before threads use it."""
        if qtype == Q.F32 or qtype in self._converters:
            return
        fn = getattr(self._lib, _FLOAT_SOURCES.get(qtype, f"dequantize_row_{self._name(qtype)}"), None)
        if fn is None:
            raise JobError(f"cannot read {qtype.name} tensors: ggml has no converter for them")
        fn.restype = None
        fn.argtypes = [_P, _P, _I64]
        self._converters[qtype] = fn

    def to_float(self, qtype: Q, src: npt.NDArray[np.uint8], dst: npt.NDArray[np.float32]) -> None:
        """Expand ``src`` (whole rows of ``qtype``) into ``dst``, bit for bit as ggml does."""
        if qtype == Q.F32:
            dst[:] = src.view(np.float32)
            return
        self._converters[qtype](src.ctypes.data, dst.ctypes.data, dst.size)

    def _name(self, qtype: Q) -> str:
        name = self._lib.ggml_type_name(int(qtype))
        return name.decode() if name is not None else qtype.name.lower()
