"""A tiny random-weight GGUF with a byte-level BPE vocab, GPT-2 style.

Real models mostly ship byte-level BPE vocabs: every one of the 256 bytes is
a token (spelled through GPT-2's byte-to-unicode table), merges join them
into longer pieces, and specials stand apart. LLGuidance accepts such a
vocab, where it refuses the SentencePiece-style one of the demo model
(:mod:`supervisor.models.demo`); this model is the structured-output tests'
stand-in for a real one. The weights are the demo's random ones, so the
text is adversarial gibberish: every constrained answer must be validated.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from supervisor.models.demo import CHATML_TEMPLATE, finish_gguf
from supervisor.models.demo import demo_tensors as _tensors

BPE_MODEL_NAME = "tiny-random-bpe"
# Words whose pieces become merges, left to right ("Ġ" is GPT-2's space):
# English, and the pieces JSON is written with, so outputs take several
# lengths of token for the same text, as they do with real vocabs.
_WORDS = [
    "Ġthe", "Ġand", "Ġis", "Ġof", "Ġto", "Ġin", "Ġhello", "Ġworld", "Ġmodel", "Ġtiny",
    "Ġrandom", "Ġyes", "Ġno", "Ġdata", "Ġname", "Ġtags", "Ġtrue", "Ġfalse", "Ġnull",
    "ing", "ed", "er", "tion", "true", "false", "null", "name", "tags", "type", "id",
    '{"', '":', '",', '"}', '":"', '","', '["', '"]', "],", "},", "ĠĠ", "ĠĠĠĠ", "Ċ", "ĊĠĠ",
    "00", "12", "20", "2024", "-0", "-1", ":0", "T1", "@e", ".com", "abc", "xyz",
]
# Specials after the byte tokens and merges: an end-of-text (BOS) and ChatML's markers.
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value, indexed by the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def bpe_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, GGUF token types): the 256 bytes, one token per merge, the specials."""
    tokens = byte_symbols()
    known = set(tokens)
    merges: list[str] = []
    for word in _WORDS:
        piece = word[0]
        for ch in word[1:]:
            joined = piece + ch
            if joined not in known:
                merges.append(f"{piece} {ch}")
                tokens.append(joined)
                known.add(joined)
            piece = joined
    types = [int(gguf.TokenType.NORMAL)] * len(tokens) + [int(gguf.TokenType.CONTROL)] * len(_SPECIALS)
    return [*tokens, *_SPECIALS], merges, types


def write_tiny_bpe(path: Path, *, seed: int = 0, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
                   n_head_kv: int = 2, n_ff: int = 128, n_ctx: int = 2048,
                   chat_template: str = CHATML_TEMPLATE) -> Path:
    """Write a random llama-architecture GGUF (F32) with a GPT-2 BPE vocab to ``path`` atomically,
    with ``chat_template`` (a family's, to test its call format on this vocab)."""
    tokens, merges, types = bpe_vocab()
    bos = tokens.index("<|endoftext|>")
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(BPE_MODEL_NAME)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    # ChatML's end of turn ends a generation, as in Qwen's vocabs.
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)
    tensors = _tensors(np.random.default_rng(seed), n_vocab=len(tokens), n_embd=n_embd, n_layer=n_layer,
                       n_embd_kv=n_embd // n_head * n_head_kv, n_ff=n_ff)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    return finish_gguf(w, tmp, path)
