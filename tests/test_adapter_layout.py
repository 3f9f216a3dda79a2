"""An adapter file whose tensor data the engine would refuse is refused from
its header, by the library and by the worker alike (formats/gguf_layout.py):
truncated data, an unknown tensor type, a row that is no whole number of
blocks, data at another offset than the index puts it. A well-formed one
passes both. No engine runs here."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from supervisor.models.adapters import adapter_info, read_shapes
from worker.adapters import adapter_fault

pytestmark = pytest.mark.timeout(30)
WEIGHT = "blk.0.attn_q.weight"


def write_adapter(path: Path) -> Path:
    """A rank-4 F32 LoRA adapter on one 64x64 llama weight."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 8.0)
    rng = np.random.default_rng(0)
    writer.add_tensor(WEIGHT + ".lora_a", rng.standard_normal((4, 64), dtype=np.float32))
    writer.add_tensor(WEIGHT + ".lora_b", rng.standard_normal((64, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _type_field(data: bytes, tensor: str) -> int:
    """The file offset of a tensor's type in the index (its data offset follows)."""
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    return at + 4 + 8 * n_dims


def _patched(src: Path, out: Path, tensor: str, fmt: str, value: int, after_type: bool = False) -> Path:
    data = bytearray(src.read_bytes())
    struct.pack_into(fmt, data, _type_field(data, tensor) + (4 if after_type else 0), value)
    out.write_bytes(bytes(data))
    return out


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_adapter(tmp_path / "good.gguf")


def test_a_well_formed_adapter_passes_both_checks(good: Path) -> None:
    header = read_shapes(good)
    assert header.fault is None and adapter_fault(good) is None
    assert adapter_info(header.kv, header.shapes, good).weights == {WEIGHT: (64, 64)}


def test_each_layout_fault_is_named_by_the_library_and_the_worker(good: Path, tmp_path: Path) -> None:
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:-200])
    lora_b = WEIGHT + ".lora_b"
    cases = {
        # (file, what the library's reason says)
        "truncated": (truncated, f"truncated: the data of tensor '{lora_b}' runs past the end"),
        "unknown type": (_patched(good, tmp_path / "t99.gguf", WEIGHT + ".lora_a", "<I", 99),
                         "has type 99, which the engine does not know"),
        # Q8_0 blocks hold 32 values; lora_b's rows hold 4.
        "partial block": (_patched(good, tmp_path / "q8.gguf", lora_b, "<I", 8),
                          "has rows of 4 values, not a multiple of its block size 32"),
        "moved data": (_patched(good, tmp_path / "off.gguf", lora_b, "<Q", 64, after_type=True),
                       f"tensor '{lora_b}' has its data at offset 64, where the index puts it at 1024"),
    }
    for case, (path, reason) in cases.items():
        fault = read_shapes(path).fault
        assert fault is not None and reason in fault, (case, fault)
        # The worker's reader refuses some of them before the layout is looked
        # at; either way it names a fault, and never loads the file.
        assert adapter_fault(path), case


def test_a_huge_claimed_shape_is_bounded_by_the_file(good: Path, tmp_path: Path) -> None:
    """A tensor claiming 2^40 values costs no memory: it is compared to the file's size."""
    data = bytearray(good.read_bytes())
    at = _type_field(data, WEIGHT + ".lora_b") - 16  # its two dims precede the type
    struct.pack_into("<Q", data, at, 1 << 40)
    path = tmp_path / "huge.gguf"
    path.write_bytes(bytes(data))
    fault = read_shapes(path).fault
    assert fault is not None and "runs past the end" in fault
    assert adapter_fault(path)
