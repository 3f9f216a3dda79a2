"""Facts about a GGUF model, read from its header only.

The parser walks the fixed header, the key/value section and the tensor
index of a memory-mapped file and stops there: tensor data is never touched,
so even a 100 GB model is read in a few milliseconds. Large arrays (the
tokenizer's tokens, scores and merges) are skipped by length; only their item
count is kept. Of the tensor index only the bytes per repeating layer are
kept (:class:`TensorSizes`): what partial GPU offload moves layer by layer.

:func:`read_gguf_info` turns the raw keys into :class:`GgufInfo`, resolving the
per-layer roles the way llama.cpp does when it builds a context: which layers
use a sliding window, which are recurrent (SSM) state, which own a KV cache
and which share another layer's. The memory estimate (``memfit``) only does
byte arithmetic over these lists.

A truncated or corrupt file raises :class:`GgufError` with a reason the library
shows next to the model.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from pathlib import Path
from typing import Any

import msgspec

GGUF_MAGIC = b"GGUF"
# Arrays longer than this are skipped (tokenizer data), only counted.
_MAX_DECODED_ARRAY = 8192
_MAX_KV_COUNT = 1_000_000
# Real models have a few thousand tensors; a larger count is a corrupt header
# (and would cost seconds to walk).
_MAX_TENSORS = 100_000
_MAX_TENSOR_DIMS = 8  # ggml itself has 4
_DEFAULT_ALIGNMENT = 32
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.")

# GGUF value types: (struct format, byte size) for the fixed-size ones.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING = 8
_U64 = struct.Struct("<Q")
_ARRAY = 9

# Default sliding-window patterns llama.cpp applies per architecture when the
# header has no explicit pattern: (period, dense_first).
_SWA_DEFAULTS: dict[str, tuple[int, bool]] = {
    "gemma2": (2, False),
    "gemma3": (6, False),
    "gemma3n": (5, False),
    "gemma-embedding": (6, False),
    "cohere2": (4, False),
    "gpt-oss": (2, False),
    "exaone4": (4, False),
    "olmo2": (4, False),
    "plamo3": (8, False),
    "smallthinker": (4, True),
    "afmoe": (4, False),
}
# Entirely recurrent architectures: every layer holds recurrent state.
_RECURRENT = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
# Hybrids whose recurrent layers are the ones without KV heads.
_HYBRID_BY_HEADS = frozenset(
    {"jamba", "granitehybrid", "plamo2", "lfm2", "lfm2moe", "kimi-linear", "bailingmoe3"}
)
# Hybrids whose attention layers come every ``full_attention_interval`` layers.
_HYBRID_BY_INTERVAL = frozenset({"qwen3next", "qwen35", "qwen35moe", "minimax-01"})
_NEMOTRON_H = frozenset({"nemotron_h", "nemotron_h_moe"})
# Shared-KV architectures and llama.cpp's fallback when the key is absent.
_SHARED_KV_DEFAULT_START: dict[str, int] = {"gemma3n": 20}

_TOOL_MARKERS = re.compile(r"\btools\b|\btool_calls\b|<tool_call>")
_REASONING_MARKERS = re.compile(
    r"enable_thinking|reasoning_effort|reasoning_content|<think>|\[THINK\]|<seed:think>"
    r"|<\|channel\|>analysis|thinking_budget|\bthinking\b"
)


class GgufError(Exception):
    """The file is not a readable GGUF; ``reason`` says why in a few words."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class TensorSizes(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes of tensor data in a file, grouped the way llama.cpp places them.

    The repeating layers go to the GPU from the last one down; the output
    head goes with the first offloaded layer; the input embeddings always
    stay in RAM. A model without ``output.weight`` ties its head to the token
    embeddings, and llama.cpp then copies those to the output's device.
    """

    layer_bytes: list[int] = []  # per repeating layer (blk.N), n_layer items
    output_bytes: int = 0  # the output head and final norm (output*)
    token_embd_bytes: int = 0
    other_bytes: int = 0  # everything else outside the blocks (input side)
    has_output_head: bool = False

    @property
    def output_device_bytes(self) -> int:
        """What the output layer puts on its device, a tied head included."""
        tied = 0 if self.has_output_head else self.token_embd_bytes
        return self.output_bytes + tied

    @property
    def total(self) -> int:
        return sum(self.layer_bytes) + self.output_bytes + self.token_embd_bytes + self.other_bytes

    def merged(self, other: TensorSizes) -> TensorSizes:
        """The sizes of a shard set from the sizes of its files."""
        n = max(len(self.layer_bytes), len(other.layer_bytes))
        mine = self.layer_bytes + [0] * (n - len(self.layer_bytes))
        theirs = other.layer_bytes + [0] * (n - len(other.layer_bytes))
        return TensorSizes(
            layer_bytes=[a + b for a, b in zip(mine, theirs, strict=True)],
            output_bytes=self.output_bytes + other.output_bytes,
            token_embd_bytes=self.token_embd_bytes + other.token_embd_bytes,
            other_bytes=self.other_bytes + other.other_bytes,
            has_output_head=self.has_output_head or other.has_output_head,
        )


class GgufInfo(msgspec.Struct, kw_only=True):
    """Header facts of one GGUF file; per-layer lists have ``n_layer`` items."""

    architecture: str
    name: str | None = None
    general_type: str | None = None  # "model", "mmproj", "adapter"...
    version: int = 3
    tensor_count: int = 0
    file_type: int | None = None
    quantization: str | None = None  # e.g. "Q4_K_M", from general.file_type
    context_length: int = 0
    n_layer: int = 0
    n_embd: int = 0
    n_vocab: int = 0
    n_head: int = 0
    n_head_kv: int = 0  # the largest per-layer value
    n_head_per_layer: list[int] = []
    n_head_kv_per_layer: list[int] = []
    n_ff_per_layer: list[int] = []
    n_expert_used: int = 0  # experts each token runs through (MoE)
    n_ff_exp: int = 0  # feed-forward width of one expert, when it differs from n_ff
    key_length: int = 0
    value_length: int = 0
    key_length_swa: int = 0
    value_length_swa: int = 0
    sliding_window: int = 0
    swa_layers: list[bool] = []
    kv_lora_rank: int = 0
    key_length_mla: int = 0
    value_length_mla: int = 0
    is_mla: bool = False
    ssm_conv_kernel: int = 0
    ssm_inner_size: int = 0
    ssm_state_size: int = 0
    ssm_group_count: int = 0
    ssm_time_step_rank: int = 0
    wkv_head_size: int = 0
    token_shift_count: int = 0
    shortconv_l_cache: int = 0
    recurrent_layers: list[bool] = []
    attention_layers: list[bool] = []  # layers that own a KV cache
    shared_kv_layers: int = 0
    nextn_predict_layers: int = 0
    split_count: int = 0
    split_no: int = 0
    chat_template: str | None = None
    supports_tools: bool = False
    supports_reasoning: bool = False
    # This file's tensor data by placement; other shards of a set hold the rest.
    tensors: TensorSizes = TensorSizes()

    @property
    def is_recurrent(self) -> bool:
        return any(self.recurrent_layers)

    @property
    def is_projector(self) -> bool:
        return self.general_type == "mmproj" or self.architecture == "clip"


class _Cursor:
    """Bounds-checked little-endian reads over a buffer."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.path = path

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GgufError(
                self.path, f"truncated header: {what} at byte {self.pos} runs past the end"
            )

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, size = _SCALARS[vtype]
        self._need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(10, what))

    def string(self, what: str) -> str:
        n = self.u64(what)
        self._need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GgufError(self.path, f"invalid UTF-8 in {what}") from exc

    def skip(self, n: int, what: str) -> None:
        self._need(n, what)
        self.pos += n

    def skip_strings(self, count: int, what: str) -> None:
        # A tight loop: tokenizer arrays hold a few hundred thousand strings.
        unpack, buf, pos, end = _U64.unpack_from, self.buf, self.pos, self.size - 8
        for _ in range(count):
            if pos > end:
                break
            pos += 8 + unpack(buf, pos)[0]
        else:
            if pos <= self.size:
                self.pos = pos
                return
        self.pos = min(pos, self.size)
        raise GgufError(self.path, f"truncated header: {what} runs past the end")


def _read_value(cur: _Cursor, vtype: int, key: str, counts: dict[str, int]) -> Any:
    if vtype in _SCALARS:
        return cur.scalar(vtype, key)
    if vtype == _STRING:
        return cur.string(key)
    if vtype != _ARRAY:
        raise GgufError(cur.path, f"unknown value type {vtype} for key {key!r}")
    item_type = cur.u32(key)
    count = cur.u64(key)
    counts[key] = count
    if count > cur.size:
        raise GgufError(cur.path, f"array {key!r} claims {count} items, more than the file holds")
    if item_type in _SCALARS:
        fmt, size = _SCALARS[item_type]
        cur._need(count * size, key)
        if count > _MAX_DECODED_ARRAY:
            cur.pos += count * size
            return None
        values = list(struct.unpack_from(f"<{count}{fmt[1]}", cur.buf, cur.pos))
        cur.pos += count * size
        return values
    if item_type == _STRING:
        if count > _MAX_DECODED_ARRAY:
            cur.skip_strings(count, key)
            return None
        return [cur.string(key) for _ in range(count)]
    raise GgufError(cur.path, f"unsupported array item type {item_type} for key {key!r}")


def read_gguf_kv(path: Path) -> tuple[int, int, dict[str, Any], dict[str, int]]:
    """(version, tensor_count, key -> value, array key -> item count).

    Arrays longer than a few thousand items map to None (only counted).
    """
    version, tensor_count, kv, counts, _ = _read(path, tensors=False)
    return version, tensor_count, kv, counts


_Parsed = tuple[int, int, dict[str, Any], dict[str, int], list[tuple[str, int]]]


def _read(path: Path, *, tensors: bool) -> _Parsed:
    """The header, and with ``tensors`` the (name, data bytes) of each tensor."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GgufError(path, f"file is too short to be GGUF ({size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                cur = _Cursor(mm, path)
                version, tensor_count, kv, counts = _parse(cur)
                spans = _tensor_spans(cur, tensor_count, _alignment(cur, kv)) if tensors else []
                return version, tensor_count, kv, counts, spans
    except OSError as exc:
        raise GgufError(path, f"cannot read file: {exc.strerror or exc}") from exc


def _parse(cur: _Cursor) -> tuple[int, int, dict[str, Any], dict[str, int]]:
    if bytes(cur.buf[0:4]) != GGUF_MAGIC:
        raise GgufError(cur.path, "not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.u32("version")
    if version not in (2, 3):
        raise GgufError(cur.path, f"unsupported GGUF version {version}")
    tensor_count = cur.u64("tensor count")
    kv_count = cur.u64("key/value count")
    if kv_count > _MAX_KV_COUNT:
        raise GgufError(cur.path, f"implausible key/value count {kv_count}")
    kv: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for _ in range(kv_count):
        key = cur.string("key")
        vtype = cur.u32(key)
        kv[key] = _read_value(cur, vtype, key, counts)
    return version, tensor_count, kv, counts


def _alignment(cur: _Cursor, kv: dict[str, Any]) -> int:
    value = kv.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise GgufError(cur.path, f"general.alignment {value!r} is not a power of two")
    return value


def _tensor_spans(cur: _Cursor, count: int, alignment: int) -> list[tuple[str, int]]:
    """(name, bytes) of each tensor's data, from the tensor index after the keys.

    Sizes come from the gaps between data offsets (alignment padding
    included), so tensor types unknown to this reader cost nothing.
    """
    if count > _MAX_TENSORS:
        raise GgufError(cur.path, f"implausible tensor count {count}")
    index: list[tuple[int, str]] = []
    for _ in range(count):
        name = cur.string("tensor name")
        n_dims = cur.u32(f"tensor {name!r}")
        if n_dims > _MAX_TENSOR_DIMS:
            raise GgufError(cur.path, f"tensor {name!r} claims {n_dims} dimensions")
        cur.skip(8 * n_dims + 4, f"tensor {name!r}")  # shape and type
        index.append((cur.u64(f"tensor {name!r}"), name))
    data_size = cur.size - -(-cur.pos // alignment) * alignment
    index.sort()
    spans: list[tuple[str, int]] = []
    for i, (offset, name) in enumerate(index):
        end = index[i + 1][0] if i + 1 < len(index) else data_size
        if end > data_size or offset > data_size:
            raise GgufError(cur.path, f"truncated: the data of tensor {name!r} runs past the end")
        spans.append((name, end - offset))
    return spans


def tensor_sizes(spans: list[tuple[str, int]], n_layer: int) -> TensorSizes:
    """Group tensor data bytes by layer, output head, and input side."""
    layers = [0] * n_layer
    output = token_embd = other = 0
    has_head = False
    for name, size in spans:
        block = _BLOCK_TENSOR.match(name)
        if block is not None and int(block.group(1)) < n_layer:
            layers[int(block.group(1))] += size
        elif name.startswith("output"):
            output += size
            has_head = has_head or name == "output.weight"
        elif name == "token_embd.weight":
            token_embd += size
        else:
            other += size
    return TensorSizes(
        layer_bytes=layers,
        output_bytes=output,
        token_embd_bytes=token_embd,
        other_bytes=other,
        has_output_head=has_head,
    )


def read_tensor_sizes(path: Path, n_layer: int) -> TensorSizes:
    """The tensor data of one file (e.g. a further shard) by placement."""
    *_, spans = _read(path, tensors=True)
    return tensor_sizes(spans, n_layer)


def read_gguf_info(path: Path) -> GgufInfo:
    """Read ``path``'s header into :class:`GgufInfo`; raises :class:`GgufError`."""
    version, tensor_count, kv, counts, spans = _read(path, tensors=True)
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GgufError(path, "header has no general.architecture")
    try:
        info = _interpret(arch, version, tensor_count, kv, counts)
    except (TypeError, ValueError) as exc:
        raise GgufError(path, f"malformed {arch} header: {exc}") from exc
    info.tensors = tensor_sizes(spans, info.n_layer)
    return info


def _int(kv: dict[str, Any], key: str, default: int = 0) -> int:
    value = kv.get(key)
    if value is None:
        return default
    if isinstance(value, list):
        raise ValueError(f"{key} is an array, expected a number")
    return int(value)


def _per_layer(kv: dict[str, Any], key: str, n_layer: int, default: list[int]) -> list[int]:
    value = kv.get(key)
    if value is None:
        return list(default)
    if isinstance(value, list):
        if len(value) != n_layer:
            raise ValueError(f"{key} has {len(value)} items for {n_layer} layers")
        return [int(v) for v in value]
    return [int(value)] * n_layer


def quantization_name(file_type: int | None) -> str | None:
    """``general.file_type`` as llama.cpp names it (``Q4_K_M``, ``F16``...)."""
    if file_type is None:
        return None
    import gguf  # imported here: only needed for the name table

    try:
        name = gguf.LlamaFileType(file_type).name
    except ValueError:
        return f"unknown({file_type})"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def template_features(template: str | None) -> tuple[bool, bool]:
    """(supports tools, supports reasoning) judged from a chat template."""
    if not template:
        return False, False
    return bool(_TOOL_MARKERS.search(template)), bool(_REASONING_MARKERS.search(template))


def _swa_layers(arch: str, kv: dict[str, Any], n_layer: int, n_swa: int) -> list[bool]:
    pattern = kv.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) < n_layer:
            raise ValueError("sliding_window_pattern is shorter than block_count")
        return [bool(v) for v in pattern[:n_layer]]
    if n_swa <= 0:
        return [False] * n_layer
    if pattern is None and arch not in _SWA_DEFAULTS:
        return [False] * n_layer
    period, dense_first = _SWA_DEFAULTS.get(arch, (0, False))
    if pattern is not None:
        period = int(pattern)
    if period == 0:
        return [True] * n_layer
    if dense_first:
        return [il % period != 0 for il in range(n_layer)]
    return [il % period < period - 1 for il in range(n_layer)]


def _recurrent_layers(
    arch: str, kv: dict[str, Any], n_layer: int, head_kv: list[int], ff: list[int]
) -> list[bool]:
    if arch in _RECURRENT or arch == "falcon-h1":
        return [True] * n_layer
    if arch in _HYBRID_BY_HEADS:
        return [h == 0 for h in head_kv]
    if arch in _NEMOTRON_H:
        return [h == 0 and f == 0 for h, f in zip(head_kv, ff, strict=True)]
    if arch in _HYBRID_BY_INTERVAL:
        explicit = kv.get(f"{arch}.attention.recurrent_layers")
        if isinstance(explicit, list):
            return [bool(v) for v in explicit[:n_layer]]
        interval = _int(kv, f"{arch}.full_attention_interval", 4)
        return [(il + 1) % interval != 0 for il in range(n_layer)]
    return [False] * n_layer


def _attention_layers(
    arch: str, n_layer: int, recurrent: list[bool], kv_from_start: int, n_nextn: int
) -> list[bool]:
    out: list[bool] = []
    for il in range(n_layer):
        if arch in _RECURRENT:
            owns = False
        elif arch == "falcon-h1":
            owns = True  # every falcon-h1 layer has both attention and SSM
        else:
            owns = not recurrent[il]
        if 0 <= kv_from_start <= il:
            owns = False  # reuses an earlier layer's cache
        if n_nextn and il >= n_layer - n_nextn:
            owns = False  # multi-token-prediction layers run in their own context
        out.append(owns)
    return out


def _interpret(
    arch: str, version: int, tensor_count: int, kv: dict[str, Any], counts: dict[str, int]
) -> GgufInfo:
    a = arch
    n_layer = _int(kv, f"{a}.block_count")
    n_embd = _int(kv, f"{a}.embedding_length")
    heads = _per_layer(kv, f"{a}.attention.head_count", n_layer, [0] * n_layer)
    heads_kv = _per_layer(kv, f"{a}.attention.head_count_kv", n_layer, heads)
    ff = _per_layer(kv, f"{a}.feed_forward_length", n_layer, [0] * n_layer)
    n_head0 = heads[0] if heads else 0
    head_dim = n_embd // n_head0 if n_head0 > 0 else 0
    key_length = _int(kv, f"{a}.attention.key_length", head_dim)
    value_length = _int(kv, f"{a}.attention.value_length", head_dim)
    n_swa = _int(kv, f"{a}.attention.sliding_window")
    swa = _swa_layers(a, kv, n_layer, n_swa)
    recurrent = _recurrent_layers(a, kv, n_layer, heads_kv, ff)
    shared = _int(kv, f"{a}.attention.shared_kv_layers")
    kv_from_start = n_layer - shared if shared > 0 else _SHARED_KV_DEFAULT_START.get(a, -1)
    n_nextn = _int(kv, f"{a}.nextn_predict_layers")
    template = kv.get("tokenizer.chat_template")
    template = template if isinstance(template, str) else None
    tools, reasoning = template_features(template)
    file_type = kv.get("general.file_type")
    key_mla = _int(kv, f"{a}.attention.key_length_mla")
    value_mla = _int(kv, f"{a}.attention.value_length_mla")
    name = kv.get("general.name")
    gtype = kv.get("general.type")
    return GgufInfo(
        architecture=a,
        name=name if isinstance(name, str) else None,
        general_type=gtype if isinstance(gtype, str) else None,
        version=version,
        tensor_count=tensor_count,
        file_type=int(file_type) if isinstance(file_type, int) else None,
        quantization=quantization_name(int(file_type)) if isinstance(file_type, int) else None,
        context_length=_int(kv, f"{a}.context_length"),
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=_int(kv, f"{a}.vocab_size", counts.get("tokenizer.ggml.tokens", 0)),
        n_head=n_head0,
        n_head_kv=max(heads_kv, default=0),
        n_head_per_layer=heads,
        n_head_kv_per_layer=heads_kv,
        n_ff_per_layer=ff,
        n_expert_used=_int(kv, f"{a}.expert_used_count"),
        n_ff_exp=_int(kv, f"{a}.expert_feed_forward_length"),
        key_length=key_length,
        value_length=value_length,
        key_length_swa=_int(kv, f"{a}.attention.key_length_swa", key_length),
        value_length_swa=_int(kv, f"{a}.attention.value_length_swa", value_length),
        sliding_window=n_swa,
        swa_layers=swa,
        kv_lora_rank=_int(kv, f"{a}.attention.kv_lora_rank"),
        key_length_mla=key_mla,
        value_length_mla=value_mla,
        is_mla=key_mla > 0 and value_mla > 0,
        ssm_conv_kernel=_int(kv, f"{a}.ssm.conv_kernel"),
        ssm_inner_size=_int(kv, f"{a}.ssm.inner_size"),
        ssm_state_size=_int(kv, f"{a}.ssm.state_size"),
        ssm_group_count=_int(kv, f"{a}.ssm.group_count"),
        ssm_time_step_rank=_int(kv, f"{a}.ssm.time_step_rank"),
        wkv_head_size=_int(kv, f"{a}.wkv.head_size"),
        token_shift_count=_int(kv, f"{a}.token_shift_count", 2 if a.startswith("rwkv") else 0),
        shortconv_l_cache=_int(kv, f"{a}.shortconv.l_cache"),
        recurrent_layers=recurrent,
        attention_layers=_attention_layers(a, n_layer, recurrent, kv_from_start, n_nextn),
        shared_kv_layers=n_layer - kv_from_start if kv_from_start >= 0 else 0,
        nextn_predict_layers=n_nextn,
        split_count=_int(kv, "split.count"),
        split_no=_int(kv, "split.no"),
        chat_template=template,
        supports_tools=tools,
        supports_reasoning=reasoning,
    )
