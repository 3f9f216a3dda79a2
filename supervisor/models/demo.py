"""Write tiny random-weight GGUF models (llama architecture).

Used for the embedded default model on first start and by the tests. The
weights are random, so the text is gibberish: the model exists only to show
every endpoint working without a download.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

DEMO_MODEL_NAME = "tiny-random-demo"
RMS_EPS = 1e-5


@dataclass(frozen=True)
class DemoShape:
    """The shape of the demo written on first start and of its Hugging Face
    twin (supervisor/models/demo_hf.py). Heads of 64: vLLM's CPU attention,
    which serves the twin, refuses heads of 16 (write_tiny_gguf's default)."""

    seed: int = 0
    n_embd: int = 128
    n_layer: int = 2
    n_head: int = 2
    n_head_kv: int = 1
    n_ff: int = 256
    n_ctx: int = 2048
    extra_tokens: int = 200


DEMO_SHAPE = DemoShape()

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Word pieces after the 256 byte tokens; "▁" marks a leading space (SentencePiece).
_PIECES = [
    "▁the", "▁a", "▁is", "▁of", "▁and", "▁to", "▁in", "▁it", "▁you", "▁that",
    "▁hello", "▁world", "▁model", "▁tiny", "▁random", "▁demo", "▁yes", "▁no",
    "▁lab", "▁gpu", "▁job", "▁data", "▁train", "▁loss", "▁fine", "▁tune",
    "er", "ing", "ed", "es", "ly", "▁", ".", ",", "!", "?", ":", "{", "}", "\"",
]
_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def demo_vocab(extra_tokens: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, GGUF token types): specials, the 256 byte tokens, word pieces."""
    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    for tok in _SPECIALS:
        tokens.append(tok)
        scores.append(0.0)
        types.append(gguf.TokenType.UNKNOWN if tok == "<unk>" else gguf.TokenType.CONTROL)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(gguf.TokenType.BYTE)
    for i, piece in enumerate(_PIECES):
        tokens.append(piece)
        scores.append(-1.0 - i * 0.01)
        types.append(gguf.TokenType.NORMAL)
    for i in range(extra_tokens):
        tokens.append(f"▁w{i}")
        scores.append(-10.0 - i * 0.01)
        types.append(gguf.TokenType.NORMAL)
    return tokens, scores, types


# The name the test helpers import it by.
_vocab = demo_vocab


def with_specials(vocab: tuple[list[str], list[float], list[int]],
                  specials: tuple[str, ...]) -> tuple[list[str], list[float], list[int]]:
    """``vocab`` with ``specials`` appended as control tokens."""
    tokens, scores, types = vocab
    return ([*tokens, *specials], [*scores, *[0.0] * len(specials)],
            [*types, *[gguf.TokenType.CONTROL] * len(specials)])


def write_tiny_gguf(
    path: Path,
    *,
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx: int = 2048,
    extra_tokens: int = 200,
    chat_template: str | None = CHATML_TEMPLATE,
    name: str = DEMO_MODEL_NAME,
    specials: tuple[str, ...] = (),
    more_keys: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """Write a random llama-architecture GGUF (F32) to ``path`` atomically;
    ``specials`` are control tokens added to the vocab (a family's turn markers),
    ``more_keys`` adds header keys of its own (e.g. ``general.sampling.*``)."""
    tokens, scores, types = with_specials(demo_vocab(extra_tokens), specials)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(name)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer(w, tokens, scores, types, chat_template)
    if more_keys is not None:
        more_keys(w)
    tensors = demo_tensors(np.random.default_rng(seed), n_vocab=len(tokens), n_embd=n_embd,
                           n_layer=n_layer, n_embd_kv=n_embd // n_head * n_head_kv, n_ff=n_ff)
    for tensor_name, array in tensors.items():
        w.add_tensor(tensor_name, array)
    return finish_gguf(w, tmp, path)


def write_demo_gguf(path: Path) -> Path:
    """The demo model of the first start (:data:`DEMO_SHAPE`)."""
    return write_tiny_gguf(path, **asdict(DEMO_SHAPE))


def finish_gguf(w: gguf.GGUFWriter, tmp: Path, path: Path) -> Path:
    """Write out everything added to ``w`` (opened on ``tmp``) and move it
    to ``path`` in one rename: nobody sees a half-written model."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def add_tokenizer(w: gguf.GGUFWriter, tokens: list[str], scores: list[float], types: list[int],
                  chat_template: str | None) -> None:
    """The demo vocabulary (:func:`demo_vocab`) as a llama SPM tokenizer, with its template."""
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def demo_tensors(rng: np.random.Generator, *, n_vocab: int, n_embd: int, n_layer: int,
                 n_embd_kv: int, n_ff: int) -> dict[str, np.ndarray]:
    """The demo's random weights by GGUF tensor name, in llama.cpp's layout.

    Drawn in one fixed order, so a seed gives the same model every time; the
    Hugging Face twin (:mod:`supervisor.models.demo_hf`) is made from these.
    """
    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    # numpy shape is (ne1, ne0): rows first, as gguf stores it.
    out = {
        "token_embd.weight": rand(n_vocab, n_embd),
        "output_norm.weight": np.ones(n_embd, dtype=np.float32),
        "output.weight": rand(n_vocab, n_embd),
    }
    for i in range(n_layer):
        out[f"blk.{i}.attn_norm.weight"] = np.ones(n_embd, dtype=np.float32)
        out[f"blk.{i}.attn_q.weight"] = rand(n_embd, n_embd)
        out[f"blk.{i}.attn_k.weight"] = rand(n_embd_kv, n_embd)
        out[f"blk.{i}.attn_v.weight"] = rand(n_embd_kv, n_embd)
        out[f"blk.{i}.attn_output.weight"] = rand(n_embd, n_embd)
        out[f"blk.{i}.ffn_norm.weight"] = np.ones(n_embd, dtype=np.float32)
        out[f"blk.{i}.ffn_gate.weight"] = rand(n_ff, n_embd)
        out[f"blk.{i}.ffn_up.weight"] = rand(n_ff, n_embd)
        out[f"blk.{i}.ffn_down.weight"] = rand(n_embd, n_ff)
    return out
