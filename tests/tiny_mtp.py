"""A loadable tiny random GLM-4.5-style (``glm4moe``) GGUF with one MTP layer.

Like :func:`supervisor.models.demo.write_tiny_gguf`: F32 random weights under
the architecture's tensor names and header keys, and the demo model's vocab.
The last block is the next-token-prediction (NextN) layer: a whole block
plus the projection that joins a token's embedding to the model's hidden
state. The engine skips it in the normal forward pass and runs it only as
the MTP drafter (``load_mtp``). The first block is dense, the rest are MoE
with a shared expert, as in the real models.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from supervisor.models.demo import CHATML_TEMPLATE, _vocab, add_tokenizer, finish_gguf

ARCH = "glm4moe"


def _header(w: gguf.GGUFWriter, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int,
            n_expert: int, n_ff_exp: int) -> None:
    w.add_name("tiny-random-mtp")
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head // 2)  # partial rotary, as in GLM
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(2)
    w.add_expert_shared_count(1)
    w.add_leading_dense_block_count(1)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_expert_weights_scale(1.0)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_uint32(f"{ARCH}.nextn_predict_layers", 1)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, scores, types = _vocab(200)
    add_tokenizer(w, tokens, scores, types, CHATML_TEMPLATE)


def write_tiny_mtp(path: Path, *, seed: int = 0, n_layer: int = 3, n_embd: int = 64, n_head: int = 4,
                   n_head_kv: int = 2, n_ff: int = 128, n_expert: int = 4, n_ff_exp: int = 32) -> Path:
    """Write the model to ``path`` atomically; its last block is the MTP layer."""
    rng = np.random.default_rng(seed)
    n_vocab = len(_vocab(200)[0])
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    _header(w, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
            n_expert=n_expert, n_ff_exp=n_ff_exp)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    n_kv = n_embd // n_head * n_head_kv
    # numpy shape is (ne1, ne0): rows first, as gguf stores it.
    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", ones(n_embd))
    w.add_tensor("output.weight", rand(n_vocab, n_embd))
    for i in range(n_layer):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones(n_embd))
        for name, rows in (("attn_q", n_embd), ("attn_k", n_kv), ("attn_v", n_kv)):
            w.add_tensor(b + name + ".weight", rand(rows, n_embd))
            w.add_tensor(b + name + ".bias", rand(rows))
        w.add_tensor(b + "attn_output.weight", rand(n_embd, n_embd))
        w.add_tensor(b + "post_attention_norm.weight", ones(n_embd))
        if i == 0:
            w.add_tensor(b + "ffn_gate.weight", rand(n_ff, n_embd))
            w.add_tensor(b + "ffn_up.weight", rand(n_ff, n_embd))
            w.add_tensor(b + "ffn_down.weight", rand(n_embd, n_ff))
        else:
            w.add_tensor(b + "ffn_gate_inp.weight", rand(n_expert, n_embd))
            w.add_tensor(b + "exp_probs_b.bias", rand(n_expert))
            w.add_tensor(b + "ffn_gate_exps.weight", rand(n_expert, n_ff_exp, n_embd))
            w.add_tensor(b + "ffn_up_exps.weight", rand(n_expert, n_ff_exp, n_embd))
            w.add_tensor(b + "ffn_down_exps.weight", rand(n_expert, n_embd, n_ff_exp))
            w.add_tensor(b + "ffn_gate_shexp.weight", rand(n_ff_exp, n_embd))
            w.add_tensor(b + "ffn_up_shexp.weight", rand(n_ff_exp, n_embd))
            w.add_tensor(b + "ffn_down_shexp.weight", rand(n_embd, n_ff_exp))
    last = f"blk.{n_layer - 1}.nextn."
    # Joins the normed token embedding and the normed hidden state.
    w.add_tensor(last + "eh_proj.weight", rand(n_embd, 2 * n_embd))
    w.add_tensor(last + "enorm.weight", ones(n_embd))
    w.add_tensor(last + "hnorm.weight", ones(n_embd))
    w.add_tensor(last + "shared_head_norm.weight", ones(n_embd))
    return finish_gguf(w, tmp, path)
