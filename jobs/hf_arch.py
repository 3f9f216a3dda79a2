"""The model families the GGUF export knows: hyperparameters and metadata.

Tensor names are not listed here: gguf's ``TensorNameMap`` for the family's
``MODEL_ARCH`` maps them (see :mod:`jobs.hf_convert`). What differs between
families, and what llama.cpp's loader for that architecture expects, is here:

- Rotary layout. llama.cpp's ``llama`` and ``granite`` apply rotary to
  interleaved pairs, so Q/K rows are permuted from HF's split halves; the
  other families here run NeoX rotary, HF's layout, and are left as is.
- Gemma's norms scale by ``1 + weight`` (HF), llama.cpp's by ``weight``:
  1 is added to every norm weight.
- Family metadata (softcapping, sliding window, multipliers, experts).
- Facts llama.cpp does not read from a file but fixes for the architecture
  (Gemma's attention scale and sliding-window pattern, Qwen 3 MoE's
  normalised top-k weights): a model that differs is refused by name rather
  than exported to a GGUF that computes something else.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from jobs.context import JobError

# Family metadata writer: checks the config, writes keys, returns notes.
FamilyMeta = Callable[[gguf.GGUFWriter, dict[str, Any], "HParams"], list[str]]


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
    n_rot: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> HParams:
        try:
            n_head = _count(cfg, "num_attention_heads", _MAX_HEADS)
            n_embd = _count(cfg, "hidden_size", _MAX_WIDTH)
            n_head_kv = _count(cfg, "num_key_value_heads", n_head, default=n_head)
            if n_head % n_head_kv:
                raise JobError(f"config.json: num_attention_heads {n_head} is not a multiple of "
                               f"num_key_value_heads {n_head_kv}")
            if cfg.get("head_dim") is None and n_embd % n_head:
                raise JobError(f"config.json: hidden_size {n_embd} is not a multiple of "
                               f"num_attention_heads {n_head} (and there is no head_dim)")
            head_dim = _count(cfg, "head_dim", _MAX_WIDTH, default=n_embd // n_head)
            rope = _global_rope(cfg)
            theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
            scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
            partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
            if not 0.0 < partial <= 1.0:
                raise JobError(f"config.json: partial_rotary_factor {partial} is not within (0, 1]")
            return cls(
                n_vocab=_count(cfg, "vocab_size", _MAX_VOCAB),
                n_ctx=_count(cfg, "max_position_embeddings", _MAX_CTX, default=4096),
                n_embd=n_embd,
                n_layer=_count(cfg, "num_hidden_layers", MAX_LAYERS),
                n_ff=_count(cfg, "intermediate_size", _MAX_WIDTH),
                n_head=n_head,
                n_head_kv=n_head_kv,
                head_dim=head_dim,
                n_rot=int(head_dim * partial),
                rms_eps=_positive_float(cfg, "rms_norm_eps", 1e-6),
                rope_theta=_positive_float({"rope_theta": theta}, "rope_theta", 10000.0),
                rope_scaling=scaling,
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise JobError(f"config.json lacks or mangles a hyperparameter: {exc}") from exc


# Bounds on the counts in a config.json: a crafted one (``vocab_size: 2e9``,
# ``num_hidden_layers: 1e9``) would otherwise size loops and tables by them
# before any tensor is read. The engine takes at most 512 layers; the rest
# are far above any real model's.
MAX_LAYERS = 512
_MAX_HEADS = 4096
_MAX_WIDTH = 1 << 20
_MAX_CTX = 1 << 24
_MAX_VOCAB = 1 << 24


def _count(cfg: dict[str, Any], key: str, most: int, default: int | None = None) -> int:
    """A positive whole number of config.json, at most ``most``; JobError naming ``key``."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise JobError(f"config.json lacks {key}")
        return default
    # JSON's 2e9 is a float; a whole one is taken, a bool never.
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value != int(value)):
        raise JobError(f"config.json: {key} is {value!r}, not a whole number")
    if not 1 <= value <= most:
        raise JobError(f"config.json: {key} is {int(value)}, outside 1..{most}")
    return int(value)


def _positive_float(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) < math.inf:
        raise JobError(f"config.json: {key} is {value!r}, not a positive finite number")
    return float(value)


def _global_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters of the full-attention layers.

    transformers keeps them per layer type where the types differ (Gemma 3:
    ``{"full_attention": {...}, "sliding_attention": {...}}``)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise JobError("config.json: rope_parameters is not an object")
    full = rope.get("full_attention")
    return full if isinstance(full, dict) else rope


@dataclass(frozen=True)
class ArchSpec:
    arch: gguf.MODEL_ARCH
    permute_qk: bool
    activation: str = "silu"
    norm_plus_one: bool = False
    meta: FamilyMeta | None = None
    # SentencePiece vocabularies: llama.cpp puts a space before the text
    # unless told not to; Gemma's tokenizers do not (as llama.cpp's converter writes).
    space_prefix: bool = True

    @property
    def has_output(self) -> bool:
        """Whether the architecture has an ``output`` tensor of its own (Gemma 2 has not: tied)."""
        return gguf.MODEL_TENSOR.OUTPUT in gguf.MODEL_TENSORS[self.arch]


# ------------------------------------------------------------------ family metadata


def _gemma_attention_scale(cfg: dict[str, Any], hp: HParams, big_layers: int) -> None:
    """llama.cpp scales Gemma's attention by 1/sqrt(head_dim), except for
    the 27B (recognised by its layer count), by 1/sqrt(n_embd / n_head)."""
    want = hp.n_embd / hp.n_head if hp.n_layer == big_layers else hp.head_dim
    got = float(cfg.get("query_pre_attn_scalar", want))
    if not math.isclose(got, want):
        raise JobError(
            f"query_pre_attn_scalar {got:g} is not what llama.cpp uses for this model "
            f"({want:g}); the GGUF would attend differently"
        )


def _layer_pattern(cfg: dict[str, Any], hp: HParams, every: int) -> None:
    """llama.cpp fixes the sliding layers: all but every ``every``-th one."""
    want = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(hp.n_layer)]
    got = cfg.get("layer_types") or want
    if list(got) != want:
        raise JobError(
            f"layer_types {got} differ from llama.cpp's fixed pattern for this family "
            f"(one full-attention layer in {every})"
        )


def _gemma2(writer: gguf.GGUFWriter, cfg: dict[str, Any], hp: HParams) -> list[str]:
    _gemma_attention_scale(cfg, hp, big_layers=46)
    _layer_pattern(cfg, hp, every=2)
    for key, add in (("attn_logit_softcapping", writer.add_attn_logit_softcapping),
                     ("final_logit_softcapping", writer.add_final_logit_softcapping)):
        if cfg.get(key) is None:
            # The engine caps anyway, by its defaults (50, 30) when the key is absent.
            raise JobError(f"{key} is not set, but llama.cpp's gemma2 always caps the logits")
        add(float(cfg[key]))
    writer.add_sliding_window(int(cfg.get("sliding_window") or 4096))
    return []


def _gemma3(writer: gguf.GGUFWriter, cfg: dict[str, Any], hp: HParams) -> list[str]:
    if cfg.get("attn_logit_softcapping") is not None:
        raise JobError("attention logit softcapping is not part of llama.cpp's gemma3")
    _gemma_attention_scale(cfg, hp, big_layers=62)
    _layer_pattern(cfg, hp, every=6)
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    if local_theta != 10000.0 or local.get("rope_type", "default") != "default":
        raise JobError("llama.cpp's gemma3 fixes the sliding layers' rope to base 10000, unscaled; "
                       f"this model has {local or local_theta}")
    if cfg.get("final_logit_softcapping") is not None:
        writer.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    writer.add_sliding_window(int(cfg.get("sliding_window") or 4096))
    return []


def _phi3(writer: gguf.GGUFWriter, cfg: dict[str, Any], hp: HParams) -> list[str]:
    window = cfg.get("sliding_window")
    if window:
        # llama.cpp's phi3 ignores a sliding window; writing one only logs a warning there.
        return [f"the sliding window ({window}) is not applied by llama.cpp's phi3: "
                "contexts beyond it differ from the HF model"]
    return []


def _granite(writer: gguf.GGUFWriter, cfg: dict[str, Any], hp: HParams) -> list[str]:
    writer.add_embedding_scale(float(cfg.get("embedding_multiplier", 1.0)))
    writer.add_residual_scale(float(cfg.get("residual_multiplier", 1.0)))
    writer.add_attention_scale(float(cfg.get("attention_multiplier", 1.0 / math.sqrt(hp.head_dim))))
    writer.add_logit_scale(float(cfg.get("logits_scaling", 1.0)))
    return []


def _qwen3moe(writer: gguf.GGUFWriter, cfg: dict[str, Any], hp: HParams) -> list[str]:
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise JobError("dense layers between the expert layers (mlp_only_layers, decoder_sparse_step) "
                       "are not part of llama.cpp's qwen3moe")
    if not cfg.get("norm_topk_prob", False):
        raise JobError("norm_topk_prob is false, but llama.cpp's qwen3moe always normalises "
                       "the chosen experts' weights")
    try:
        writer.add_expert_count(int(cfg.get("num_experts") or cfg["num_local_experts"]))
        writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        writer.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise JobError(f"config.json lacks or mangles an expert setting: {exc}") from exc
    return []


A = gguf.MODEL_ARCH
ARCHS: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(A.LLAMA, True),
    "MistralForCausalLM": ArchSpec(A.LLAMA, True),
    "Qwen2ForCausalLM": ArchSpec(A.QWEN2, False),
    "Qwen3ForCausalLM": ArchSpec(A.QWEN3, False),
    "Qwen3MoeForCausalLM": ArchSpec(A.QWEN3MOE, False, meta=_qwen3moe),
    "Gemma2ForCausalLM": ArchSpec(A.GEMMA2, False, "gelu_pytorch_tanh", True, _gemma2, space_prefix=False),
    "Gemma3ForCausalLM": ArchSpec(A.GEMMA3, False, "gelu_pytorch_tanh", True, _gemma3, space_prefix=False),
    "Phi3ForCausalLM": ArchSpec(A.PHI3, False, meta=_phi3),
    "Olmo2ForCausalLM": ArchSpec(A.OLMO2, False),
    "GraniteForCausalLM": ArchSpec(A.GRANITE, True, meta=_granite),
}


def model_arch(cfg: dict[str, Any]) -> tuple[str, ArchSpec]:
    archs = cfg.get("architectures") or []
    name = str(archs[0]) if archs else f"(model_type {cfg.get('model_type')!r})"
    spec = ARCHS.get(name)
    if spec is None:
        raise JobError(
            f"cannot convert architecture {name} to GGUF; supported: {', '.join(sorted(ARCHS))}"
        )
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or spec.activation
    if act != spec.activation:
        raise JobError(f"{name} with activation {act!r}: llama.cpp runs this family with {spec.activation}")
    return name, spec


# ------------------------------------------------------------------ metadata


def add_rope(writer: gguf.GGUFWriter, hp: HParams) -> np.ndarray[Any, Any] | None:
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


def add_hparams(writer: gguf.GGUFWriter, hp: HParams, name: str, file_type: gguf.LlamaFileType) -> None:
    writer.add_name(name)
    writer.add_context_length(hp.n_ctx)
    writer.add_embedding_length(hp.n_embd)
    writer.add_block_count(hp.n_layer)
    writer.add_feed_forward_length(hp.n_ff)
    writer.add_head_count(hp.n_head)
    writer.add_head_count_kv(hp.n_head_kv)
    writer.add_rope_dimension_count(hp.n_rot)
    if hp.head_dim != hp.n_embd // hp.n_head:
        writer.add_key_length(hp.head_dim)
        writer.add_value_length(hp.head_dim)
    writer.add_rope_freq_base(hp.rope_theta)
    writer.add_layer_norm_rms_eps(hp.rms_eps)
    writer.add_vocab_size(hp.n_vocab)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
