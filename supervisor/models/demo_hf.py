"""The demo model in Hugging Face form, for the offline fine-tune loop.

``tiny-random-demo-hf`` is ``tiny-random-demo`` (supervisor/models/demo.py)
as a Hugging Face model dir: the same random weights and the same
vocabulary, so a LoRA adapter trained on it fits the GGUF demo and runs
there (the library links a base recorded as ``<name>-hf`` to ``<name>``,
supervisor/models/adapters.py). Written without torch, transformers or
tokenizers, which the parent never imports:

- ``model.safetensors`` by hand: an 8-byte little-endian header length, the
  JSON header, then each tensor's raw little-endian bytes;
- ``config.json`` for ``LlamaForCausalLM``;
- ``tokenizer.json``: the demo's SentencePiece vocabulary as tokenizers
  reads Llama's (a BPE model with byte fallback, a leading ``▁`` and ``▁``
  for spaces), made to split text as llama.cpp's SentencePiece tokenizer
  does (see :func:`reachable_pieces`);
- ``tokenizer_config.json`` with the demo's ChatML template.

Llama's Q and K weights are stored apart for the two layouts of rotary
embedding: the GGUF holds them interleaved (llama.cpp), the HF dir in split
halves (transformers), as ``jobs.hf_convert`` converts them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import TokenType

from supervisor.models.demo import (
    CHATML_TEMPLATE,
    DEMO_MODEL_NAME,
    DEMO_SHAPE,
    RMS_EPS,
    DemoShape,
    demo_tensors,
    demo_vocab,
)

DEMO_HF_NAME = f"{DEMO_MODEL_NAME}-hf"
BOS, EOS, UNK = "<s>", "</s>", "<unk>"
_SPACE = "▁"
_HF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's interleaved rotary rows -> HF's split halves (per head);
    the inverse of ``jobs.hf_convert.permute_rotary``."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(gguf_tensors: dict[str, np.ndarray], n_head: int, n_head_kv: int) -> dict[str, np.ndarray]:
    """GGUF-named llama weights under their transformers names and layout."""
    out = {}
    for name, array in gguf_tensors.items():
        parts = name.split(".")  # blk.<i>.<what>.weight, or <what>.weight
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{_HF_NAMES[parts[2]]}.weight"
            if parts[2] == "attn_q":
                array = unpermute_rotary(array, n_head)
            elif parts[2] == "attn_k":
                array = unpermute_rotary(array, n_head_kv)
        else:
            hf = f"{_HF_NAMES[parts[0]]}.weight"
        out[hf] = np.ascontiguousarray(array, dtype="<f4")
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format: u64 LE header size, JSON header, raw bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the format asks
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in tensors.values():
            f.write(array.tobytes())


def _config(n_vocab: int, shape: DemoShape) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": n_vocab, "hidden_size": shape.n_embd, "intermediate_size": shape.n_ff,
        "num_hidden_layers": shape.n_layer, "num_attention_heads": shape.n_head,
        "num_key_value_heads": shape.n_head_kv, "head_dim": shape.n_embd // shape.n_head,
        "max_position_embeddings": shape.n_ctx, "rms_norm_eps": RMS_EPS,
        # llama.cpp's default, which the GGUF demo does not override.
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
        "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32",
    }


def reachable_pieces(tokens: list[str], types: list[int]) -> list[str]:
    """The longer pieces llama.cpp's SentencePiece tokenizer can make.

    It starts from the text's characters, in the vocab or not, and joins
    neighbours whose text is a piece. The demo vocab has few single letters,
    so only some pieces are ever made ("er" from "e" and "r", but not
    "▁the", for no "▁t", "th" or "he" is a piece). A BPE model can merge only
    tokens of its vocab, so tokenizer.json instead cuts the text into these
    pieces and single characters, and looks each cut up whole: a piece is its
    token, a character its token or its bytes. None of the demo's reachable
    pieces can overlap another (checked against the engine in
    tests/test_demo_hf.py), so cutting left to right, longest first, is
    joining best score first as llama.cpp does.
    """
    pieces = [t for t, kind in zip(tokens, types) if kind == TokenType.NORMAL and len(t) > 1]
    made: set[str] = set()
    grew = True
    while grew:
        grew = False
        for piece in pieces:
            if piece not in made and any(
                    all(len(half) == 1 or half in made for half in (piece[:i], piece[i:]))
                    for i in range(1, len(piece))):
                made.add(piece)
                grew = True
    return sorted(made, key=lambda p: (-len(p), tokens.index(p)))


def _added_token(tid: int, content: str) -> dict[str, Any]:
    return {"id": tid, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def tokenizer_json(tokens: list[str], types: list[int]) -> dict[str, Any]:
    """The demo vocab as a tokenizers BPE model with byte fallback, as Llama's."""
    specials = [i for i, t in enumerate(types) if t in (TokenType.CONTROL, TokenType.UNKNOWN)]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added_token(i, tokens[i]) for i in specials],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": _SPACE},
            {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE},
        ]},
        "pre_tokenizer": {
            "type": "Split", "behavior": "Isolated", "invert": False,
            "pattern": {"Regex": "|".join([*map(re.escape, reachable_pieces(tokens, types)), r"[\s\S]"])},
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            # No BOS between a pair: gguf's reader (jobs.hf_vocab) warns about a separator.
            "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [tokens.index(BOS)], "tokens": [BOS]}},
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": _SPACE}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": UNK, "continuing_subword_prefix": None,
            # Each cut is looked up whole (ignore_merges); there is nothing to merge.
            "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": True,
            "vocab": {tok: i for i, tok in enumerate(tokens)}, "merges": [],
        },
    }


def _tokenizer_config(tokens: list[str], types: list[int], n_ctx: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": n_ctx, "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {k: v for k, v in _added_token(i, tokens[i]).items() if k != "id"}
            for i, t in enumerate(types) if t in (TokenType.CONTROL, TokenType.UNKNOWN)
        },
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tiny_hf(path: Path, shape: DemoShape = DEMO_SHAPE) -> Path:
    """Write the HF demo dir at ``path`` in one rename (a half-written dir is
    never seen): ``write_tiny_gguf(**asdict(shape))`` in Hugging Face form."""
    tokens, _scores, types = demo_vocab(shape.extra_tokens)
    weights = demo_tensors(np.random.default_rng(shape.seed), n_vocab=len(tokens), n_embd=shape.n_embd,
                           n_layer=shape.n_layer, n_embd_kv=shape.n_embd // shape.n_head * shape.n_head_kv,
                           n_ff=shape.n_ff)
    # Hidden while written: the library skips hidden names.
    tmp = path.with_name(f".{path.name}.tmp")
    if tmp.exists():  # left by a start that died while writing
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_safetensors(tmp / "model.safetensors", hf_tensors(weights, shape.n_head, shape.n_head_kv))
    _write_json(tmp / "config.json", _config(len(tokens), shape))
    _write_json(tmp / "generation_config.json", {
        "bos_token_id": 1, "eos_token_id": [2, tokens.index("<|im_end|>")]})
    _write_json(tmp / "tokenizer.json", tokenizer_json(tokens, types))
    _write_json(tmp / "tokenizer_config.json", _tokenizer_config(tokens, types, shape.n_ctx))
    os.replace(tmp, path)
    return path
