"""Facts about a GGUF model, derived from its header (read by ``gguf_header``).

Of the tensor index only the bytes per repeating layer are kept
(:class:`TensorSizes`): what partial GPU offload moves layer by layer.

:func:`read_gguf_info` turns the raw keys into :class:`GgufInfo`, resolving the
per-layer roles the way llama.cpp does when it builds a context: which layers
use a sliding window, which are recurrent (SSM) state, which own a KV cache
and which share another layer's. The memory estimate (``memfit``) only does
byte arithmetic over these lists.

A truncated or corrupt file raises :class:`GgufError` with a reason the library
shows next to the model.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import msgspec

from supervisor.models.gguf_header import GgufError, read_header
from supervisor.models.sampling_defaults import ModelSampling, gguf_sampling

# GgufError: what read_gguf_info raises; its callers catch it from here.
__all__ = ["GgufError", "GgufInfo", "TensorSizes", "quantization_name", "read_gguf_info",
           "read_tensor_sizes", "template_features", "tensor_sizes"]

_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.")
# llama.cpp's per-layer arrays have this many entries (LLAMA_MAX_LAYERS).
LLAMA_MAX_LAYERS = 512


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
    # The context a model with its own RoPE scaling was trained at before it
    # (<arch>.rope.scaling.original_context_length); 0 = none named.
    rope_orig_ctx: int = 0
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
    # The author's sampling defaults (general.sampling.*), hostile values left out.
    sampling: ModelSampling = ModelSampling()
    # This file's tensor data by placement; other shards of a set hold the rest.
    tensors: TensorSizes = TensorSizes()

    @property
    def is_recurrent(self) -> bool:
        return any(self.recurrent_layers)

    @property
    def is_projector(self) -> bool:
        return self.general_type == "mmproj" or self.architecture == "clip"



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
    *_, spans = read_header(path, tensors=True)
    return tensor_sizes(spans, n_layer)


def read_gguf_info(path: Path) -> GgufInfo:
    """Read ``path``'s header into :class:`GgufInfo`; raises :class:`GgufError`."""
    version, tensor_count, kv, counts, spans = read_header(path, tensors=True)
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GgufError(path, "header has no general.architecture")
    try:
        info = _interpret(arch, version, tensor_count, kv, counts)
        _check_plausible(arch, kv, info.n_layer, spans)
    except (TypeError, ValueError) as exc:
        raise GgufError(path, f"malformed {arch} header: {exc}") from exc
    info.tensors = tensor_sizes(spans, info.n_layer)
    return info


def _check_plausible(arch: str, kv: dict[str, Any], n_layer: int, spans: list[tuple[str, int]]) -> None:
    """Refuse values the engine meets with an abort (SIGABRT) instead of an
    error: a crash on every load, so a restart loop before ``failed``. A
    refusal here is a reason shown once, and no worker starts at all."""
    if n_layer > LLAMA_MAX_LAYERS:
        raise ValueError(f"block_count {n_layer} exceeds the engine's {LLAMA_MAX_LAYERS} layers")
    single_file = int(kv.get("split.count") or 1) <= 1
    if n_layer > 0 and single_file and kv.get("general.type") != "adapter":
        held = [int(m.group(1)) for name, _ in spans if (m := _BLOCK_TENSOR.match(name))]
        if held and n_layer > max(held) + 1:
            raise ValueError(f"block_count {n_layer} claims more layers than the file's {max(held) + 1}")
    for key, value in kv.items():
        # A NaN or infinite hyperparameter (an epsilon, a rope base) is no model.
        if key.startswith(arch + ".") and isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key} is {value}")


def _int(kv: dict[str, Any], key: str, default: int = 0) -> int:
    value = kv.get(key)
    if value is None:
        return default
    if isinstance(value, list):
        raise TypeError(f"{key} is an array, expected a number")
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


def _general(kv: dict[str, Any], a: str, counts: dict[str, int]) -> dict[str, Any]:
    """What the file says about itself: name, type, quantization, vocabulary, template."""
    template = kv.get("tokenizer.chat_template")
    template = template if isinstance(template, str) else None
    tools, reasoning = template_features(template)
    file_type = kv.get("general.file_type")
    name = kv.get("general.name")
    gtype = kv.get("general.type")
    return {
        "name": name if isinstance(name, str) else None,
        "general_type": gtype if isinstance(gtype, str) else None,
        "file_type": int(file_type) if isinstance(file_type, int) else None,
        "quantization": quantization_name(int(file_type)) if isinstance(file_type, int) else None,
        "context_length": _int(kv, f"{a}.context_length"),
        "rope_orig_ctx": _int(kv, f"{a}.rope.scaling.original_context_length"),
        "n_vocab": _int(kv, f"{a}.vocab_size", counts.get("tokenizer.ggml.tokens", 0)),
        "split_count": _int(kv, "split.count"),
        "split_no": _int(kv, "split.no"),
        "chat_template": template,
        "supports_tools": tools,
        "supports_reasoning": reasoning,
        "sampling": gguf_sampling(kv),
    }


def _attention(kv: dict[str, Any], a: str, n_layer: int, n_embd: int,
               heads: list[int], heads_kv: list[int]) -> dict[str, Any]:
    """The attention's shape: heads, key and value widths, sliding window, MLA."""
    n_head0 = heads[0] if heads else 0
    head_dim = n_embd // n_head0 if n_head0 > 0 else 0
    key_length = _int(kv, f"{a}.attention.key_length", head_dim)
    value_length = _int(kv, f"{a}.attention.value_length", head_dim)
    n_swa = _int(kv, f"{a}.attention.sliding_window")
    key_mla = _int(kv, f"{a}.attention.key_length_mla")
    value_mla = _int(kv, f"{a}.attention.value_length_mla")
    return {
        "n_head": n_head0,
        "n_head_kv": max(heads_kv, default=0),
        "key_length": key_length,
        "value_length": value_length,
        "key_length_swa": _int(kv, f"{a}.attention.key_length_swa", key_length),
        "value_length_swa": _int(kv, f"{a}.attention.value_length_swa", value_length),
        "sliding_window": n_swa,
        "swa_layers": _swa_layers(a, kv, n_layer, n_swa),
        "kv_lora_rank": _int(kv, f"{a}.attention.kv_lora_rank"),
        "key_length_mla": key_mla,
        "value_length_mla": value_mla,
        "is_mla": key_mla > 0 and value_mla > 0,
    }


def _recurrent_state(kv: dict[str, Any], a: str) -> dict[str, Any]:
    """The sizes of a recurrent layer's state (SSM, RWKV, short convolution)."""
    return {
        "ssm_conv_kernel": _int(kv, f"{a}.ssm.conv_kernel"),
        "ssm_inner_size": _int(kv, f"{a}.ssm.inner_size"),
        "ssm_state_size": _int(kv, f"{a}.ssm.state_size"),
        "ssm_group_count": _int(kv, f"{a}.ssm.group_count"),
        "ssm_time_step_rank": _int(kv, f"{a}.ssm.time_step_rank"),
        "wkv_head_size": _int(kv, f"{a}.wkv.head_size"),
        "token_shift_count": _int(kv, f"{a}.token_shift_count", 2 if a.startswith("rwkv") else 0),
        "shortconv_l_cache": _int(kv, f"{a}.shortconv.l_cache"),
    }


def _interpret(
    arch: str, version: int, tensor_count: int, kv: dict[str, Any], counts: dict[str, int]
) -> GgufInfo:
    a = arch
    n_layer = _int(kv, f"{a}.block_count")
    n_embd = _int(kv, f"{a}.embedding_length")
    heads = _per_layer(kv, f"{a}.attention.head_count", n_layer, [0] * n_layer)
    heads_kv = _per_layer(kv, f"{a}.attention.head_count_kv", n_layer, heads)
    ff = _per_layer(kv, f"{a}.feed_forward_length", n_layer, [0] * n_layer)
    recurrent = _recurrent_layers(a, kv, n_layer, heads_kv, ff)
    shared = _int(kv, f"{a}.attention.shared_kv_layers")
    kv_from_start = n_layer - shared if shared > 0 else _SHARED_KV_DEFAULT_START.get(a, -1)
    n_nextn = _int(kv, f"{a}.nextn_predict_layers")
    return GgufInfo(
        architecture=a,
        version=version,
        tensor_count=tensor_count,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head_per_layer=heads,
        n_head_kv_per_layer=heads_kv,
        n_ff_per_layer=ff,
        n_expert_used=_int(kv, f"{a}.expert_used_count"),
        n_ff_exp=_int(kv, f"{a}.expert_feed_forward_length"),
        recurrent_layers=recurrent,
        attention_layers=_attention_layers(a, n_layer, recurrent, kv_from_start, n_nextn),
        shared_kv_layers=n_layer - kv_from_start if kv_from_start >= 0 else 0,
        nextn_predict_layers=n_nextn,
        **_general(kv, a, counts),
        **_attention(kv, a, n_layer, n_embd, heads, heads_kv),
        **_recurrent_state(kv, a),
    )
