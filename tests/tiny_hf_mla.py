"""A tiny random DeepSeek-V3 Hugging Face model dir, built on the fly: a
model with multi-head latent attention (MLA), whose KV cache vLLM holds as
one latent vector per token and layer (``kv_lora_rank + qk_rope_head_dim``
values) rather than a K and a V per KV head.

The latent is DeepSeek-V3's own 512 + 64 = 576 values: vLLM's CPU MLA
backend serves no other head size (its decode kernel is built for 576
alone). The rest is as small as vLLM's loader takes: two decoder layers,
the first dense and the second a mixture of experts, as DeepSeek-V3's
``first_k_dense_replace`` makes them. It reuses tests/tiny_hf.py's
byte-level BPE tokenizer and chat template. Needs the ``train`` extra
(torch, transformers, tokenizers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.tiny_hf import CHAT_TEMPLATE, _bpe_tokenizer

LAYERS = 2
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
# Values vLLM caches per token and layer: the latent and the rotary key part.
LATENT_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM
MLA_CONFIG: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 128, "kv_lora_rank": KV_LORA_RANK, "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
    "qk_nope_head_dim": 64, "v_head_dim": 64, "head_dim": QK_ROPE_HEAD_DIM,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "max_position_embeddings": 2048, "initializer_range": 0.2, "tie_word_embeddings": False,
    # transformers declares one MTP layer by default but writes none of its
    # tensors; said outright so that nothing plans to draft with it.
    "num_nextn_predict_layers": 0,
    # DeepSeek-V3's routing as its own config.json names it: transformers
    # always routes so (and saves the gate's score correction bias), vLLM
    # only when told, and otherwise refuses the bias.
    "topk_method": "noaux_tc", "scoring_func": "sigmoid",
}


def build_mla_model(out: Path, seed: int = 0, **config: Any) -> Path:
    """Write a tiny DeepSeek-V3 with its tokenizer and chat template to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    out.mkdir(parents=True, exist_ok=True)
    vocab = _bpe_tokenizer(out)
    ids = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    cfg = DeepseekV3Config(
        vocab_size=vocab, num_hidden_layers=LAYERS,
        bos_token_id=ids["<s>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<pad>"],
        **{**MLA_CONFIG, **config},
    )
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)  # type: ignore[no-untyped-call]
    model.save_pretrained(out, safe_serialization=True)
    path = out / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    tok_config.setdefault("chat_template", CHAT_TEMPLATE)
    path.write_text(json.dumps(tok_config, indent=2))
    return out


if __name__ == "__main__":
    import sys

    print(build_mla_model(Path(sys.argv[1])))
