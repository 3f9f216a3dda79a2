"""A tiny random EAGLE draft head for a tiny Hugging Face target
(tests/tiny_hf.py's build_vllm_model), written as EAGLE's published heads
are: the target's config.json with one layer, and the head's tensors under
their own names (``fc.weight`` joins the token's embedding and the target's
last hidden state; one decoder layer without its input norm). It has no
embedding or LM head of its own: vLLM shares the target's.

An EAGLE-3 head (build_eagle3_head) is written as the published ones are:
architecture ``LlamaForCausalLMEagle3``, its one layer named ``midlayer``
and taking the token's embedding and the joined hidden state side by side
(twice the width into attention), ``fc`` joining three of the target's
hidden states, and a final norm and LM head of its own."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def build_eagle_head(target: Path, out: Path, seed: int = 0) -> Path:
    """Write an EAGLE-1 head for ``target`` to ``out`` (its tokenizer files
    copied, so the library can tell that the two share a vocabulary)."""
    import torch
    from safetensors.torch import save_file

    cfg, rand, dtype = _head_dir(target, out, {}, seed)
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = hidden // heads
    layer = "layers.0."
    tensors = {
        "fc.weight": rand(hidden, 2 * hidden),
        layer + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
        layer + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
        layer + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
        layer + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        layer + "mlp.gate_proj.weight": rand(inter, hidden),
        layer + "mlp.up_proj.weight": rand(inter, hidden),
        layer + "mlp.down_proj.weight": rand(hidden, inter),
        layer + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_eagle3_head(target: Path, out: Path, seed: int = 0) -> Path:
    """Write an EAGLE-3 head for ``target`` to ``out``. The target's hidden
    states it joins are its embedding's and those after each of its two
    layers (``eagle_aux_hidden_state_layer_ids``), which every published
    head names too; vLLM's default picks layers a 2-layer target lacks."""
    import torch
    from safetensors.torch import save_file

    vocab = int(json.loads((target / "config.json").read_text())["vocab_size"])
    settings = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": vocab,
                "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    cfg, rand, dtype = _head_dir(target, out, settings, seed)
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = hidden // heads

    def ones() -> torch.Tensor:
        return torch.ones(hidden, dtype=dtype)

    layer = "midlayer."
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        layer + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        layer + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        layer + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        layer + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        layer + "mlp.gate_proj.weight": rand(inter, hidden),
        layer + "mlp.up_proj.weight": rand(inter, hidden),
        layer + "mlp.down_proj.weight": rand(hidden, inter),
        layer + "input_layernorm.weight": ones(),
        layer + "hidden_norm.weight": ones(),
        layer + "post_attention_layernorm.weight": ones(),
        "norm.weight": ones(),
        "lm_head.weight": rand(vocab, hidden),
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _head_dir(target: Path, out: Path, settings: dict[str, Any], seed: int
              ) -> tuple[dict[str, Any], Callable[..., Any], Any]:
    """Start a one-layer head dir for ``target``: its config.json (the
    target's, with ``settings`` over it), the target's tokenizer files (so
    the library can tell that the two share a vocabulary). The target's
    config, small random tensors of its dtype from ``seed``, and the dtype."""
    import torch

    cfg: dict[str, Any] = json.loads((target / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1, **settings}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (target / name).is_file():
            shutil.copy(target / name, out / name)
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"))

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(dtype)

    return cfg, rand, dtype
