"""A tiny random GLM-4-MoE Hugging Face model dir with one MTP layer, which
vLLM drafts with (``method="mtp"``), built on the fly: nothing is downloaded.
(tests/tiny_mtp.py writes a GGUF of the same family for llama.cpp.)

GLM-4.5's checkpoints keep their multi-token prediction layer as the decoder
layer after the last one (``model.layers.<n>.``), with its own norms over
the token's embedding and the last hidden state (``enorm``, ``hnorm``), the
projection joining them (``eh_proj``) and a head (``shared_head``).
transformers builds no such layer (it drops those tensors on load), so the
model is built with one layer more, and that layer gets the MTP tensors
before the config is saved with the layer count of the model proper.

The shape is the smallest vLLM's CPU attention serves (head_dim 64), as in
tests/tiny_hf.py, whose byte-level BPE tokenizer it reuses. Needs the
``train`` extra (torch, transformers, tokenizers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.tiny_hf import CHAT_TEMPLATE, _bpe_tokenizer

HIDDEN = 256
# Decoder layers of the model proper: the first dense, the second a
# mixture of experts, as GLM-4-MoE's first_k_dense_replace makes them.
LAYERS = 2
GLM_CONFIG: dict[str, Any] = {
    "hidden_size": HIDDEN, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 2048, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    # Larger than the usual 0.02, so logits differ enough to compare.
    "initializer_range": 0.2, "tie_word_embeddings": False,
}


def build_mtp_model(out: Path, seed: int = 0, **config: Any) -> Path:
    """Write a GLM-4-MoE of two decoder layers and one MTP layer, with its
    tokenizer and chat template, to ``out``."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Glm4MoeConfig

    out.mkdir(parents=True, exist_ok=True)
    vocab = _bpe_tokenizer(out)
    ids = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    cfg = Glm4MoeConfig(
        vocab_size=vocab, num_hidden_layers=LAYERS + 1,
        bos_token_id=ids["<s>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"],
        **{**GLM_CONFIG, **config},
    )
    # What vLLM reads to build the drafter (transformers' default, said outright).
    cfg.num_nextn_predict_layers = 1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)  # type: ignore[no-untyped-call]
    # Saved first, so the experts are written one tensor each, as published
    # checkpoints hold them and vLLM's loader reads them.
    model.save_pretrained(out, safe_serialization=True)
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update(_mtp_extras(tensors, seed))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.num_hidden_layers = LAYERS
    cfg.architectures = ["Glm4MoeForCausalLM"]
    cfg.save_pretrained(out)
    path = out / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    tok_config.setdefault("chat_template", CHAT_TEMPLATE)
    path.write_text(json.dumps(tok_config, indent=2))
    return out


def _mtp_extras(tensors: dict[str, Any], seed: int) -> dict[str, Any]:
    """The MTP layer's tensors beside its decoder layer's: the norms, the
    projection of the joined embedding and hidden state, and its head (a
    copy of the model's LM head, as GLM-4.5's is trained from)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    prefix = f"model.layers.{LAYERS}."
    ones = torch.ones(HIDDEN, dtype=torch.bfloat16)
    return {
        prefix + "enorm.weight": ones.clone(),
        prefix + "hnorm.weight": ones.clone(),
        prefix + "eh_proj.weight": (torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * 0.05).to(torch.bfloat16),
        prefix + "shared_head.norm.weight": ones.clone(),
        prefix + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
    }
