"""Which ggml type each tensor gets when a model is quantized to a llama.cpp mix.

A llama.cpp "file type" such as Q4_K_M is not one tensor type but a recipe: a
base type, with some tensors kept as they are (norms, biases, small or
positional tables), a few sensitive ones given more bits (the output matrix,
some layers' attention-V and FFN-down), and a smaller-block type wherever the
row width does not divide into the base type's blocks. Models produced here
must match what llama.cpp's own quantizer writes, since users compare sizes
and quality against published GGUFs, so this restates llama.cpp's published
rules for the mixes we offer. Everything here is a pure function of names,
shapes and header facts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from types import MappingProxyType

import gguf

Q = gguf.GGMLQuantizationType
F = gguf.LlamaFileType


@dataclass(frozen=True)
class Mix:
    """One offered target: the file type written to the header and its base tensor type."""

    ftype: F
    base: Q

    @property
    def quantized(self) -> bool:
        return self.base not in (Q.F32, Q.F16, Q.BF16)


MIXES: Mapping[str, Mix] = MappingProxyType({
    "F16": Mix(F.MOSTLY_F16, Q.F16),
    "BF16": Mix(F.MOSTLY_BF16, Q.BF16),
    "Q8_0": Mix(F.MOSTLY_Q8_0, Q.Q8_0),
    "Q6_K": Mix(F.MOSTLY_Q6_K, Q.Q6_K),
    "Q5_K_M": Mix(F.MOSTLY_Q5_K_M, Q.Q5_K),
    "Q5_K_S": Mix(F.MOSTLY_Q5_K_S, Q.Q5_K),
    "Q5_0": Mix(F.MOSTLY_Q5_0, Q.Q5_0),
    "Q4_K_M": Mix(F.MOSTLY_Q4_K_M, Q.Q4_K),
    "Q4_K_S": Mix(F.MOSTLY_Q4_K_S, Q.Q4_K),
    "Q4_0": Mix(F.MOSTLY_Q4_0, Q.Q4_0),
    "Q3_K_M": Mix(F.MOSTLY_Q3_K_M, Q.Q3_K),
})


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as the header describes it; ``shape`` is ggml order (row width first)."""

    name: str
    shape: tuple[int, ...]
    type: Q


@dataclass(frozen=True)
class ModelFacts:
    """The header values the rules depend on."""

    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        # llama.cpp names these sizes from the layer count; only "70B" changes a rule.
        if self.arch == "llama":
            return self.n_layer == 80 and self.n_head != self.n_head_kv
        if self.arch in ("qwen2", "deci", "olmo"):
            return self.n_layer == 80
        return self.arch == "jais2" and self.n_layer == 68


class Role(Enum):
    """The broad part of the network a tensor belongs to, judged from its name."""

    OUTPUT = auto()
    TOKEN_EMBD = auto()
    ATTN_QKV = auto()
    ATTN_KV_B = auto()
    ATTN_V = auto()
    ATTN_K = auto()
    ATTN_Q = auto()
    ATTN_OUTPUT = auto()
    FFN_UP = auto()
    FFN_GATE = auto()
    FFN_DOWN = auto()
    OTHER = auto()


# Checked in this order: the first substring found decides.
_ROLE_MARKERS: tuple[tuple[str, Role], ...] = (
    ("attn_qkv.weight", Role.ATTN_QKV),
    ("attn_kv_b.weight", Role.ATTN_KV_B),
    ("attn_v.weight", Role.ATTN_V),
    ("attn_k.weight", Role.ATTN_K),
    ("attn_q.weight", Role.ATTN_Q),
    ("attn_output.weight", Role.ATTN_OUTPUT),
    ("ffn_up", Role.FFN_UP),
    ("ffn_gate", Role.FFN_GATE),
    ("ffn_down", Role.FFN_DOWN),
)
_ATTN_V_ROLES = frozenset({Role.ATTN_V, Role.ATTN_QKV, Role.ATTN_KV_B})

# Weights that stay in their stored type: gates, routing tables, tiny or
# positional matrices whose size gain is nil and whose precision matters.
_KEEP_SUBSTRINGS: tuple[str, ...] = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight",
    "indexer.k_proj.weight", "indexer.q_proj.weight",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
    "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight",
    "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight",
    "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
    "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_",
    ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)
_KEEP_NAMES = frozenset({"position_embd.weight", "token_types.weight"})
_KEEP_SUBSTRINGS_BY_ARCH: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "glm5-next": (
        "hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate",
        "indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight",
        "ssm_g_b.weight", "ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight",
        "attn_v_b.weight",
    ),
})
# This arch's query and next-token projections never go below Q8_0.
_Q8_FLOOR = MappingProxyType({"glm5-next": ("attn_q_a", "attn_q_b", "nextn.eh_proj")})

# Where a row is not a whole number of the type's blocks: the nearest type
# with 32-value blocks (F16 when even that does not fit).
_FALLBACK: Mapping[Q, Q] = MappingProxyType({
    Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.TQ1_0: Q.Q4_0, Q.TQ2_0: Q.Q4_0,
    Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0,
    Q.IQ1_S: Q.IQ4_NL, Q.IQ1_M: Q.IQ4_NL, Q.IQ2_XXS: Q.IQ4_NL, Q.IQ2_XS: Q.IQ4_NL,
    Q.IQ2_S: Q.IQ4_NL, Q.IQ3_XXS: Q.IQ4_NL, Q.IQ3_S: Q.IQ4_NL, Q.IQ4_XS: Q.IQ4_NL,
})

_LAYER = re.compile(r"blk\.(-?\d+)\.")


def block_size(qtype: Q) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][0]


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def tensor_order(name: str) -> tuple[int, str]:
    """llama.cpp's tensor order: by layer (non-layer tensors first), then by name."""
    layer = layer_of(name)
    return (-1 if layer is None else layer, name)


def role_of(name: str) -> Role:
    if name == "output.weight":
        return Role.OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return Role.TOKEN_EMBD
    for marker, role in _ROLE_MARKERS:
        if marker in name:
            return role
    return Role.OTHER


def n_dims(shape: Sequence[int]) -> int:
    """Dimensions as ggml counts them: trailing sizes of 1 do not count."""
    for i in range(len(shape) - 1, 0, -1):
        if shape[i] > 1:
            return i + 1
    return 1


def is_quantizable(name: str, shape: Sequence[int], arch: str) -> bool:
    """Whether a mix may change this tensor's type at all."""
    if n_dims(shape) < 2 or not name.endswith("weight") or name in _KEEP_NAMES:
        return False
    keep = _KEEP_SUBSTRINGS + _KEEP_SUBSTRINGS_BY_ARCH.get(arch, ())
    return not any(s in name for s in keep)


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """The first and last eighth of the layers, and every third one between."""
    eighth = n_layer // 8
    return i_layer < eighth or i_layer >= 7 * n_layer // 8 or (i_layer - eighth) % 3 == 2


def fallback_type(wanted: Q, row: int) -> Q:
    """``wanted``, or the type llama.cpp uses when ``row`` values do not fill its blocks."""
    if row % block_size(wanted) == 0:
        return wanted
    smaller = _FALLBACK.get(wanted, wanted)
    if block_size(smaller) > 32:
        raise ValueError(f"no smaller-block type is known for {wanted.name}")
    return smaller if row % block_size(smaller) == 0 else Q.F16


def _output_type(mix: Mix, row: int, arch: str) -> Q:
    # The output projection decides every token: keep it at Q6_K, or Q8_0
    # where that is the base or the row does not fit the base's blocks.
    if arch == "falcon" or row % block_size(mix.base) or mix.base == Q.Q8_0:
        return Q.Q8_0
    return Q.Q6_K


def _attn_v_type(mix: Mix, current: Q, i: int, n: int, facts: ModelFacts) -> Q:
    # V is shared by several query heads, so a few more bits cost little.
    f = mix.ftype
    chosen = current
    if f == F.MOSTLY_Q3_K_M:
        chosen = Q.Q5_K if i < 2 else Q.Q4_K
    elif f in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(i, n):
        chosen = Q.Q6_K
    elif f == F.MOSTLY_Q4_K_S and i < 4:
        chosen = Q.Q5_K
    if facts.is_70b and chosen in (Q.Q3_K, Q.Q4_K):
        chosen = Q.Q5_K
    return Q.Q8_0 if facts.n_expert == 8 else chosen


def _ffn_down_type(mix: Mix, current: Q, i: int, n: int, arch: str) -> Q:
    f, falcon = mix.ftype, arch == "falcon"
    if f == F.MOSTLY_Q3_K_M:
        if i < n // 16:
            return Q.Q5_K
        return Q.Q4_K if not falcon or use_more_bits(i, n) else Q.Q3_K
    if f == F.MOSTLY_Q4_K_M:
        if falcon:
            if i < n // 16:
                return Q.Q6_K
            return Q.Q5_K if use_more_bits(i, n) else Q.Q4_K
        return Q.Q6_K if use_more_bits(i, n) else current
    if f == F.MOSTLY_Q5_K_M:
        return Q.Q6_K if use_more_bits(i, n) else current
    if f == F.MOSTLY_Q4_K_S and not falcon and i < n // 8:
        return Q.Q5_K
    return current


def _attn_output_type(mix: Mix, current: Q, facts: ModelFacts) -> Q:
    if facts.arch == "falcon":
        return current
    if facts.n_expert == 8:
        bumped = mix.ftype in (F.MOSTLY_Q3_K_M, F.MOSTLY_Q4_K_S, F.MOSTLY_Q4_K_M)
        return Q.Q5_K if bumped else current
    return Q.Q4_K if mix.ftype == F.MOSTLY_Q3_K_M else current


def _layer_for(name: str, counter: int, facts: ModelFacts) -> int:
    # With experts, one layer holds several FFN tensors and they may not come
    # in layer order: the layer comes from the name, not from a running count.
    if facts.n_expert <= 1:
        return counter
    layer = layer_of(name)
    if layer is None or not 0 <= layer < facts.n_layer:
        raise ValueError(f"cannot tell the layer of {name} (the model has {facts.n_layer})")
    return layer


@dataclass
class _Counters:
    """How many attention-V and FFN-down tensors the mix has seen so far."""

    n_attn_v: int
    tied_embeddings: bool
    attn_v: int = 0
    ffn_down: int = 0


def _mixed_type(spec: TensorSpec, mix: Mix, facts: ModelFacts, seen: _Counters) -> Q:
    """The mix's choice before the row-width fallback; advances ``seen``."""
    for marker in _Q8_FLOOR.get(facts.arch, ()):
        if marker in spec.name:
            return Q.Q8_0
    role, row = role_of(spec.name), spec.shape[0]
    if role is Role.OUTPUT or (role is Role.TOKEN_EMBD and seen.tied_embeddings):
        return _output_type(mix, row, facts.arch)
    if role in _ATTN_V_ROLES:
        chosen = _attn_v_type(mix, mix.base, seen.attn_v, seen.n_attn_v, facts)
        seen.attn_v += 1
        return chosen
    if role is Role.ATTN_K and facts.n_expert == 8:
        return Q.Q8_0
    if role is Role.FFN_DOWN:
        layer = _layer_for(spec.name, seen.ffn_down, facts)
        seen.ffn_down += 1
        return _ffn_down_type(mix, mix.base, layer, facts.n_layer, facts.arch)
    if role is Role.ATTN_OUTPUT:
        return _attn_output_type(mix, mix.base, facts)
    return mix.base


def plan_types(tensors: Iterable[TensorSpec], mix: Mix, facts: ModelFacts) -> dict[str, Q]:
    """Each tensor's output type, by name.

    The counters behind the per-layer choices run in llama.cpp's tensor order,
    whatever order the file lists the tensors in.
    """
    ordered = sorted(tensors, key=lambda t: tensor_order(t.name))
    names = [t.name for t in ordered]
    seen = _Counters(
        n_attn_v=sum(role_of(n) in _ATTN_V_ROLES for n in names),
        tied_embeddings="output.weight" not in names,
    )
    plan: dict[str, Q] = {}
    for spec in ordered:
        if not is_quantizable(spec.name, spec.shape, facts.arch):
            plan[spec.name] = spec.type
        elif not mix.quantized:
            plan[spec.name] = mix.base
        else:
            plan[spec.name] = fallback_type(_mixed_type(spec, mix, facts, seen), spec.shape[0])
    return plan
