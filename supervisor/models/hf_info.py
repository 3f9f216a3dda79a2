"""Facts about a Hugging Face model directory (kind ``hf``), read without torch.

A model dir holds ``config.json`` and its weights as ``*.safetensors``: one
file, or shards named by ``model.safetensors.index.json``. The facts come
from config.json (for multimodal configs, from its ``text_config``) and the
safetensors headers: each file starts with an 8-byte little-endian header
length and a JSON header naming every tensor's dtype, shape and byte range.
The chat template comes from ``chat_template.jinja`` or
``tokenizer_config.json``.

Every file is treated as hostile: JSON files and headers are read with a
size bound, a header must lie inside its file and every tensor's bytes
inside the data that follows, shard names must be plain names in the
model's own dir, and a file that resolves outside the root it was found in
(a symlink out of the models dir) is refused. Any refusal is an
:class:`HfError` naming the file and why; the library lists the model as
unusable with that reason.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Literal

import msgspec

from supervisor.models.sampling_defaults import (
    GENERATION_CONFIG,
    MAX_GENERATION_CONFIG_BYTES,
    ModelSampling,
    generation_config_sampling,
    unreadable,
)

MAX_HEADER_BYTES = 100 << 20  # a safetensors JSON header
MAX_JSON_BYTES = 64 << 20  # config, tokenizer config, shard index
MAX_TEMPLATE_BYTES = 1 << 20
INDEX_NAME = "model.safetensors.index.json"
# Bytes per element of each safetensors dtype (F4 and the like: unknown, not checked).
DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_CONFIG_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
                  "float": "F32", "half": "F16"}
_TENSOR_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
DraftHead = Literal["eagle", "eagle3"]
# The model types vLLM serves with multi-head latent attention, as its
# ``is_deepseek_mla`` lists them (vllm/transformers_utils/
# model_arch_config_convertor.py, vLLM 0.32); a type vLLM adds is counted
# as plain attention until it is added here.
MLA_MODEL_TYPES = frozenset({
    "axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_v41", "dots3_note",
    "deepseek_mtp", "k3_dspark", "glm5_next", "glm5_next_text", "glm_moe_dsa", "glm4_moe_lite",
    "glm4_moe_lite_mtp", "kimi_k2", "kimi_linear", "longcat_flash", "pangu_ultra_moe",
    "pangu_ultra_moe_mtp", "bailing_hybrid", "bailing_hybrid_mtp", "bailing_hybrid_v3_mtp", "hy_v4",
    "hy_v4_mtp",
})
# The targets whose EAGLE heads (model_type "eagle") vLLM serves with MLA too.
MLA_EAGLE_TARGETS = frozenset({"axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_mtp"})


class HfError(Exception):
    """A model dir whose files cannot be read as a model, and why."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


class HfInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the parent knows about an ``hf`` model before any engine loads it."""

    architecture: str
    model_type: str
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    hidden_size: int
    intermediate_size: int = 0
    vocab_size: int
    # The checkpoint's dtype as config.json names it ("bfloat16"), else the
    # most common float dtype of its tensors.
    dtype: str
    # Tokens each sliding-window layer attends to (0: none), and how many of
    # the layers use it (all of them unless config.json's layer_types says).
    sliding_window: int = 0
    sliding_layers: int = 0
    context_length: int = 0  # max_position_embeddings
    quantization: str | None = None  # quantization_config.quant_method
    quantization_config: dict[str, Any] | None = None
    # Bytes of the tensors as stored, and of those by dtype (shard headers summed).
    parameter_bytes: int = 0
    dtype_bytes: dict[str, int] = {}
    weight_files: list[str] = []  # names in the model dir
    chat_template: str | None = None
    # The author's sampling defaults (generation_config.json), hostile values left out.
    sampling: ModelSampling = ModelSampling()
    # An EAGLE draft head rather than a model (see :func:`draft_head`): it
    # drafts for a target of its hidden size and vocabulary, never serves alone.
    draft_head: DraftHead | None = None
    # Multi-token prediction layers the checkpoint ships beside its decoder
    # layers (see :func:`mtp_layers`): vLLM drafts with them (method "mtp").
    mtp_layers: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, ...; see
    # :func:`kv_latent_dim`): the values of the one latent vector vLLM caches
    # per token and layer, in place of a K and a V per KV head. 0: not MLA.
    kv_latent_dim: int = 0


class _Tensor(msgspec.Struct):
    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]


class _Index(msgspec.Struct):
    weight_map: dict[str, str]


def _open_regular(path: Path) -> tuple[BinaryIO, os.stat_result]:
    """``path`` opened for reading, refused unless a regular file. O_NONBLOCK:
    opening a FIFO would otherwise wait for a writer forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise HfError(path, "not a regular file")
    return os.fdopen(fd, "rb"), st


def read_bounded(path: Path, limit: int) -> bytes:
    """A regular file's bytes, refused when over ``limit``."""
    f, st = _open_regular(path)
    with f:
        if st.st_size > limit:
            raise HfError(path, f"{st.st_size} bytes, over the {limit} byte limit")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise HfError(path, f"over the {limit} byte limit")
    return data


def read_json(path: Path, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(read_bounded(path, limit))
    except msgspec.DecodeError as exc:
        raise HfError(path, f"not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise HfError(path, "not a JSON object")
    return value


def safetensors_dtype_bytes(path: Path) -> dict[str, int]:
    """Bytes per dtype of a safetensors file's tensors, from its header alone."""
    return safetensors_summary(path)[0]


def safetensors_summary(path: Path) -> tuple[dict[str, int], set[str]]:
    """Bytes per dtype of a safetensors file's tensors, and their names, from its header alone."""
    f, st = _open_regular(path)
    with f:
        head = f.read(8)
        if len(head) < 8:
            raise HfError(path, "truncated: no header length")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES:
            raise HfError(path, f"header of {n} bytes, over the {MAX_HEADER_BYTES} byte limit")
        if 8 + n > st.st_size:
            raise HfError(path, f"header of {n} bytes runs past the end of the file ({st.st_size} bytes)")
        raw = f.read(n)
    if len(raw) < n:
        raise HfError(path, "truncated header")
    try:
        entries = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    except msgspec.DecodeError as exc:
        raise HfError(path, f"header is not a JSON object ({exc})") from exc
    data_bytes = st.st_size - 8 - n
    out: dict[str, int] = {}
    for name, value in entries.items():
        if name == "__metadata__":
            continue
        try:
            tensor = msgspec.json.decode(value, type=_Tensor)
        except msgspec.DecodeError as exc:
            raise HfError(path, f"tensor {name[:80]!r}: {exc}") from exc
        out[tensor.dtype] = out.get(tensor.dtype, 0) + _tensor_bytes(path, name, tensor, data_bytes)
    return out, set(entries) - {"__metadata__"}


def draft_head(architecture: str, tensors: set[str]) -> DraftHead | None:
    """Whether these weights are an EAGLE draft head, and which kind.

    EAGLE heads are published as a config.json of the target's family and
    a few tensors: ``fc`` (the token's embedding joined with the target's
    hidden state, EAGLE-1; EAGLE-3 joins three of its layers) and one or a
    few decoder layers. EAGLE-3 heads name their architecture so
    (``LlamaForCausalLMEagle3``) or keep their layer as ``midlayer``. A full
    model never has a top-level ``fc``.
    """
    midlayer = any(t.startswith("midlayer.") for t in tensors)
    if not (midlayer or {"fc.weight", "model.fc.weight"} & tensors):
        return None
    return "eagle3" if midlayer or "eagle3" in architecture.lower() else "eagle"


def mtp_layers(declared: int, n_layer: int, tensors: set[str]) -> int:
    """The MTP layers a checkpoint has: the count its config.json declares
    (``num_nextn_predict_layers``, or ``mtp_num_hidden_layers`` for
    Qwen3.5), provided its weights hold them.

    Declaring is not enough: transformers writes ``num_nextn_predict_layers``
    1 into every GLM-4-MoE or DeepSeek-V3 config it saves, yet drops those
    layers' tensors, so such a model has nothing to draft with. The tensors
    are named as vLLM's MTP loaders look for them: the decoder layers that
    follow the last one (``model.layers.<n_layer>.``: DeepSeek-V3, GLM-4-MoE,
    ERNIE), or a part named ``mtp`` or ``mtp_*`` (Qwen3-Next and Qwen3.5
    ``mtp.``, MiMo ``model.mtp_layers.``).
    """
    if declared <= 0:
        return 0
    after = tuple(f"{p}layers.{n_layer}." for p in ("model.", "", "model.language_model."))
    for name in tensors:
        if name.startswith(after) or any(p == "mtp" or p.startswith("mtp_") for p in name.split(".")):
            return declared
    return 0


def _tensor_bytes(path: Path, name: str, tensor: _Tensor, data_bytes: int) -> int:
    begin, end = tensor.data_offsets
    if not 0 <= begin <= end <= data_bytes:
        raise HfError(path, f"tensor {name[:80]!r}: bytes {begin}..{end} outside the {data_bytes} data bytes")
    if any(d < 0 for d in tensor.shape):
        raise HfError(path, f"tensor {name[:80]!r}: negative shape {tensor.shape}")
    size = DTYPE_BYTES.get(tensor.dtype)
    if size is not None:
        numel = 1
        for d in tensor.shape:
            numel *= d
        if numel * size != end - begin:
            raise HfError(path, f"tensor {name[:80]!r}: {tensor.dtype} {tensor.shape} is not {end - begin} bytes")
    return end - begin


def inside(path: Path, root: Path) -> Path:
    """``path`` resolved, refused when it leaves ``root`` (a symlink out)."""
    real = path.resolve()
    if not real.is_relative_to(root.resolve()):
        raise HfError(path, f"resolves outside {root}")
    return real


def weight_files(model_dir: Path, names: list[str]) -> list[str]:
    """The safetensors files the model loads: the index's, else every one in the dir."""
    index = model_dir / INDEX_NAME
    if INDEX_NAME not in names:
        return sorted(n for n in names if n.endswith(".safetensors"))
    try:
        shards = msgspec.convert(read_json(index), _Index).weight_map.values()
    except msgspec.ValidationError as exc:
        raise HfError(index, f"not a shard index ({exc})") from exc
    files = sorted(set(shards))
    for name in files:
        if not name.endswith(".safetensors") or "/" in name or "\\" in name or name.startswith("."):
            raise HfError(index, f"shard {name[:80]!r} is not a safetensors file in the model's dir")
    missing = [n for n in files if n not in names]
    if missing:
        raise HfError(index, f"missing shard(s): {', '.join(missing[:3])}")
    if not files:
        raise HfError(index, "names no shards")
    return files


def _int(cfg: dict[str, Any], key: str, default: int = 0) -> int:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 40:
        raise ValueError(f"{key} is {value!r}, not a count")
    return value


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part: multimodal configs nest it."""
    for key in ("text_config", "llm_config", "language_config"):
        sub = cfg.get(key)
        if isinstance(sub, dict) and "num_hidden_layers" in sub:
            return {**cfg, **sub}
    return cfg


def _sliding(cfg: dict[str, Any], n_layer: int) -> tuple[int, int]:
    """(window, layers using it). Qwen2 names a window it does not use."""
    window = _int(cfg, "sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return 0, 0
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == n_layer:
        return window, sum(1 for t in types if t == "sliding_attention")
    return window, n_layer


def kv_latent_dim(text: dict[str, Any]) -> int:
    """The values per token and layer of an MLA model's KV cache, 0 for any
    other model: decided as vLLM's ``is_deepseek_mla`` and ``get_head_size``
    decide it, from the text config.

    An MLA model caches one latent vector per token and layer,
    ``kv_lora_rank + qk_rope_head_dim`` values (576 on DeepSeek-V3); a
    DeepSeek-V4-style config (``compress_ratios``) names it ``head_dim``. A
    model type of the list whose config has no ``kv_lora_rank`` is plain
    attention to vLLM too. A rank that is there but not a count is refused
    (ValueError, as for every field): vLLM would fail on it at load. vLLM's
    ``VLLM_MLA_DISABLE`` is a worker's environment, not the model's, and is
    not followed.
    """
    model_type = text.get("model_type")
    if model_type == "eagle":
        target = text.get("model")
        target_type = target.get("model_type") if isinstance(target, dict) else None
        if target_type not in MLA_EAGLE_TARGETS:
            return 0
    elif model_type not in MLA_MODEL_TYPES:
        return 0
    elif "compress_ratios" in text:
        return _int(text, "head_dim")
    if text.get("kv_lora_rank") is None:
        return 0
    rank = _int(text, "kv_lora_rank")
    if not rank:
        raise ValueError("kv_lora_rank is 0, not the size of a latent")
    return rank + _int(text, "qk_rope_head_dim")


def config_facts(cfg: dict[str, Any]) -> dict[str, Any]:
    """HfInfo fields from config.json; ValueError names a bad field."""
    text = _text_config(cfg)
    archs = cfg.get("architectures")
    model_type = str(text.get("model_type") or cfg.get("model_type") or "")
    arch = str(archs[0]) if isinstance(archs, list) and archs else model_type
    n_layer, hidden = _int(text, "num_hidden_layers"), _int(text, "hidden_size")
    n_head = _int(text, "num_attention_heads")
    if not (arch and n_layer and hidden and n_head):
        raise ValueError("needs architectures, num_hidden_layers, hidden_size and num_attention_heads")
    n_kv = _int(text, "num_key_value_heads", 1 if text.get("multi_query") else n_head)
    window, sliding_layers = _sliding(text, n_layer)
    quant = cfg.get("quantization_config")
    quant = quant if isinstance(quant, dict) else None
    dtype = text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
    return {
        "architecture": arch, "model_type": model_type, "n_layer": n_layer, "n_head": n_head,
        "n_head_kv": n_kv or n_head, "head_dim": _int(text, "head_dim") or hidden // n_head,
        "hidden_size": hidden, "vocab_size": _int(text, "vocab_size"),
        "intermediate_size": _int(text, "intermediate_size"),
        "dtype": dtype if isinstance(dtype, str) else "",
        "sliding_window": window, "sliding_layers": sliding_layers,
        "context_length": _int(text, "max_position_embeddings"),
        "quantization": str(quant.get("quant_method")) if quant and quant.get("quant_method") else None,
        "quantization_config": quant,
        "mtp_layers": _int(text, "num_nextn_predict_layers") or _int(text, "mtp_num_hidden_layers"),
        "kv_latent_dim": kv_latent_dim(text),
    }


def chat_template(model_dir: Path, names: list[str], root: Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template."""
    if "chat_template.jinja" in names:
        raw = read_bounded(inside(model_dir / "chat_template.jinja", root), MAX_TEMPLATE_BYTES)
        return raw.decode("utf-8", errors="replace")
    if "tokenizer_config.json" not in names:
        return None
    template = read_json(inside(model_dir / "tokenizer_config.json", root)).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def sampling_defaults(model_dir: Path, names: list[str], root: Path) -> ModelSampling:
    """generation_config.json's sampling values. A file that cannot be read
    costs only its defaults (the reason is kept), never the model."""
    if GENERATION_CONFIG not in names:
        return ModelSampling()
    try:
        config = read_json(inside(model_dir / GENERATION_CONFIG, root), MAX_GENERATION_CONFIG_BYTES)
    except (HfError, OSError) as exc:
        return unreadable(exc.reason if isinstance(exc, HfError) else str(exc))
    return generation_config_sampling(config)


def read_hf_info(model_dir: Path, root: Path | None = None) -> HfInfo:
    """The facts of the model in ``model_dir``, its files kept inside ``root``."""
    root = root or model_dir
    names = sorted(os.listdir(model_dir))
    files = weight_files(model_dir, names)
    if not files:
        raise HfError(model_dir, "no *.safetensors weights")
    cfg = read_json(inside(model_dir / "config.json", root))
    try:
        facts = config_facts(cfg)
    except ValueError as exc:
        raise HfError(model_dir / "config.json", str(exc)) from exc
    by_dtype: dict[str, int] = {}
    tensors: set[str] = set()
    for name in files:
        file_bytes, names_in_file = safetensors_summary(inside(model_dir / name, root))
        tensors |= names_in_file
        for dtype, n in file_bytes.items():
            by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    if not facts["dtype"]:
        floats = {d: n for d, n in by_dtype.items() if d in FLOAT_DTYPES}
        top = max(floats, key=floats.__getitem__, default="")
        facts["dtype"] = _TENSOR_DTYPES.get(top, "")
    facts["mtp_layers"] = mtp_layers(facts["mtp_layers"], facts["n_layer"], tensors)
    return HfInfo(**facts, parameter_bytes=sum(by_dtype.values()), dtype_bytes=by_dtype,
                  weight_files=files, chat_template=chat_template(model_dir, names, root),
                  sampling=sampling_defaults(model_dir, names, root),
                  draft_head=draft_head(facts["architecture"], tensors))


def checkpoint_dtype(info: HfInfo) -> str | None:
    """The safetensors dtype code of the config's dtype ("bfloat16" -> "BF16")."""
    return _CONFIG_DTYPES.get(info.dtype)


def is_model_dir(names: set[str] | frozenset[str]) -> bool:
    """A dir that holds a model (config.json and safetensors weights), not a PEFT adapter."""
    if "config.json" not in names or "adapter_config.json" in names:
        return False
    return INDEX_NAME in names or any(n.endswith(".safetensors") for n in names)
