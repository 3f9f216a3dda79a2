"""Loadable tiny random-weight GGUF models of architectures beyond llama.

Like :func:`supervisor.models.demo.write_tiny_gguf`: F32 random weights under
the architecture's real tensor names and header keys, and the demo model's
SentencePiece-style vocab, so that llama.cpp loads them and builds a context.
The output is gibberish; the models exist to measure what the engine
allocates (KV cache, compute buffer) for an architecture's layout.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from supervisor.models.demo import CHATML_TEMPLATE, _vocab, add_tokenizer, finish_gguf, with_specials


def write_tiny_gemma3(
    path: Path,
    *,
    seed: int = 0,
    n_embd: int = 128,
    n_layer: int = 6,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 64,
    n_ff: int = 256,
    n_ctx: int = 8192,
    sliding_window: int = 256,
    extra_tokens: int = 200,
    chat_template: str | None = CHATML_TEMPLATE,
    specials: tuple[str, ...] = (),
) -> Path:
    """Write a random Gemma 3 GGUF (F32) to ``path`` atomically; ``specials``
    are control tokens added to the vocab (e.g. Gemma's turn markers).

    Gemma 3 runs five sliding-window layers to one global layer; llama.cpp
    applies that pattern by itself, so the header carries only the window.
    ``head_dim`` is set apart from ``n_embd / n_head`` as in the real models,
    where it is wider than the embedding share of a head.
    """
    rng = np.random.default_rng(seed)
    tokens, scores, types = with_specials(_vocab(extra_tokens), specials)
    n_vocab = len(tokens)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "gemma3")
    w.add_name("tiny-random-gemma3")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(sliding_window)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer(w, tokens, scores, types, chat_template)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    n_q, n_kv = n_head * head_dim, n_head_kv * head_dim
    # numpy shape is (ne1, ne0): rows first, as gguf stores it. The output
    # head is tied to the token embeddings (no output.weight), as in Gemma.
    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", ones(n_embd))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones(n_embd))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(n_q, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(n_kv, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(n_kv, n_embd))
        w.add_tensor(f"blk.{i}.attn_q_norm.weight", ones(head_dim))
        w.add_tensor(f"blk.{i}.attn_k_norm.weight", ones(head_dim))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(n_embd, n_q))
        w.add_tensor(f"blk.{i}.post_attention_norm.weight", ones(n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones(n_embd))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(n_embd, n_ff))
        w.add_tensor(f"blk.{i}.post_ffw_norm.weight", ones(n_embd))
    return finish_gguf(w, tmp, path)
