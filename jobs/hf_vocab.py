"""The tokenizer of a Hugging Face model dir, as GGUF vocabulary metadata.

Two tokenizer families of the Llama family are understood:

- SentencePiece (``tokenizer.model``; Llama 2, Mistral): GGUF model
  ``llama``, pieces with their scores and types (needs ``sentencepiece``).
- byte-level BPE (``tokenizer.json``; Llama 3, Qwen2, GPT-2 style): GGUF
  model ``gpt2``, byte-level token strings, merges, and the pre-tokenizer
  name llama.cpp knows for the split regex.
- SentencePiece-style BPE in ``tokenizer.json`` alone (byte fallback,
  ``▁`` for spaces, no byte-level step; Llama 2's tokenizer.json, the
  ``tiny-random-demo-hf`` demo): GGUF model ``llama``, as llama.cpp's
  converter reads such a file.

Special token ids, the add-BOS/EOS flags, merges and the chat template come
from gguf's own ``SpecialVocab`` reader, as in llama.cpp's converter. Anything
else is refused with an error that names what was found.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from jobs.context import JobError

T = gguf.TokenType

# The split regexes of the byte-level BPE tokenizers llama.cpp implements,
# keyed by its pre-tokenizer name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}

# Rows a model may have beyond its tokenizer's tokens (embeddings padded to
# a round size: hundreds in real models), and ids it may leave unused: at
# most this many or a quarter of the tokens. A crafted vocab_size or token
# id (2e9) would otherwise size the padding loops by itself.
_SPARE_MIN = 4096


def _spare(present: int) -> int:
    return max(_SPARE_MIN, present // 4)


def _token_id(value: Any, where: str) -> int:
    """A token id as a file gives it; JobError naming ``where`` for anything but a whole number >= 0."""
    tid = -1
    if isinstance(value, int) and not isinstance(value, bool):
        tid = value
    elif isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 12:
        tid = int(value)
    if tid < 0:
        raise JobError(f"{where}: token id {value!r} is not a whole number >= 0")
    return tid


def _id_span(ids: set[int], where: str) -> int:
    """How many ids the vocabulary spans (highest + 1), bounded by how many it names."""
    size = max(ids, default=-1) + 1
    if size > len(ids) + _spare(len(ids)):
        raise JobError(f"{where}: token id {size - 1} leaves {size - len(ids)} of the first {size} ids "
                       f"unnamed, for {len(ids)} tokens; the file is not a usable tokenizer")
    return size


@dataclass
class Vocab:
    model: str  # GGUF tokenizer model: "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    pre: str | None = None
    notes: list[str] = field(default_factory=list)

    def pad_to(self, n_vocab: int) -> None:
        """Models often have more embedding rows than tokenizer entries."""
        if len(self.tokens) > n_vocab:
            raise JobError(
                f"the tokenizer has {len(self.tokens)} tokens but the model only {n_vocab} embeddings"
            )
        extra = n_vocab - len(self.tokens)
        if extra > _spare(len(self.tokens)):
            raise JobError(f"config.json: vocab_size {n_vocab} is {extra} more than the tokenizer's "
                           f"{len(self.tokens)} tokens (a model pads by at most {_spare(len(self.tokens))})")
        if extra:
            self.notes.append(f"padded the vocabulary with {extra} unused tokens")
        for i in range(len(self.tokens), n_vocab):
            self.tokens.append(f"[PAD{i}]")
            self.types.append(int(T.UNUSED))
            if self.scores is not None:
                self.scores.append(-1000.0)

    def add_to(self, writer: gguf.GGUFWriter, model_dir: Path) -> None:
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        special = gguf.SpecialVocab(model_dir, load_merges=self.model == "gpt2", n_vocab=len(self.tokens))
        if self.model == "gpt2" and not special.merges:
            raise JobError("the BPE tokenizer has no merges; cannot convert it")
        special.add_to_gguf(writer, quiet=True)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise JobError(f"cannot read {path.name}: {exc}") from exc
    if not isinstance(data, dict):
        raise JobError(f"{path.name} is not a JSON object")
    return data


def _added_tokens(model_dir: Path) -> dict[int, tuple[str, bool]]:
    """Added tokens by id: (content, special), from every place HF keeps them."""
    out: dict[int, tuple[str, bool]] = {}
    try:
        if (model_dir / "tokenizer.json").is_file():
            for tok in _read_json(model_dir / "tokenizer.json").get("added_tokens", []):
                out[_token_id(tok["id"], "tokenizer.json added_tokens")] = (
                    str(tok["content"]), bool(tok.get("special", False)))
        if (model_dir / "tokenizer_config.json").is_file():
            decoder = _read_json(model_dir / "tokenizer_config.json").get("added_tokens_decoder", {})
            for tid, tok in decoder.items():
                out[_token_id(tid, "tokenizer_config.json added_tokens_decoder")] = (
                    str(tok["content"]), bool(tok.get("special", False)))
        if (model_dir / "added_tokens.json").is_file():
            for content, tid in _read_json(model_dir / "added_tokens.json").items():
                out.setdefault(_token_id(tid, "added_tokens.json"), (str(content), False))
    except (KeyError, TypeError, AttributeError) as exc:
        raise JobError(f"an added token lacks or mangles its id or content: {exc!r}") from exc
    return out


def _sentencepiece(model_dir: Path) -> Vocab:
    try:
        import sentencepiece as spm
    except ImportError as exc:
        raise JobError("this model uses a SentencePiece tokenizer: install sentencepiece") from exc
    proc = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    tokens, scores, types = [], [], []
    for i in range(proc.vocab_size()):
        tokens.append(proc.id_to_piece(i))
        scores.append(float(proc.get_score(i)))
        types.append(int(_spm_type(proc, i)))
    for tid, (content, special) in _added_tokens(model_dir).items():
        kind = int(T.CONTROL if special else T.USER_DEFINED)
        if tid < len(tokens):  # ids are >= 0 (_token_id)
            tokens[tid], types[tid] = content, kind
            continue
        if tid != len(tokens):
            raise JobError(f"added token {content!r} has id {tid}, leaving a gap in the vocabulary")
        tokens.append(content)
        scores.append(-1000.0)
        types.append(kind)
    return Vocab("llama", tokens, types, scores)


def _spm_type(proc: Any, i: int) -> gguf.TokenType:
    if proc.is_unknown(i):
        return T.UNKNOWN
    if proc.is_control(i):
        return T.CONTROL
    if proc.is_unused(i):
        return T.UNUSED
    if proc.is_byte(i):
        return T.BYTE
    return T.NORMAL


def _split_patterns(pre: Any) -> tuple[list[str], bool]:
    """(regexes of Split steps, whether a ByteLevel step is present)."""
    if not isinstance(pre, dict):
        return [], False
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    patterns, byte_level = [], False
    for step in steps:
        if step.get("type") == "ByteLevel":
            byte_level = True
            if step.get("use_regex", True):
                patterns.append("gpt-2")
        elif step.get("type") == "Split":
            pattern = step.get("pattern", {})
            patterns.append(str(pattern.get("Regex", pattern.get("String", ""))))
    return patterns, byte_level


def _pre_name(pre: Any) -> str:
    patterns, byte_level = _split_patterns(pre)
    if not byte_level:
        raise JobError("the BPE tokenizer is not byte-level; only byte-level BPE converts to GGUF here")
    if patterns == ["gpt-2"]:
        return "gpt-2"
    for pattern in patterns:
        if pattern in PRE_TOKENIZERS:
            return PRE_TOKENIZERS[pattern]
    raise JobError(
        f"unknown BPE pre-tokenizer (split regex {patterns[:1]}); known: gpt-2, "
        f"{', '.join(PRE_TOKENIZERS.values())}"
    )


_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def _spm_bpe(model_dir: Path, model: dict[str, Any]) -> Vocab:
    """SentencePiece-style BPE: llama.cpp merges the best-scoring pair that
    makes a token, so a piece scores by the rank of the first merge making
    it (-(rank + 1)); pieces no merge makes score 0."""
    vocab = _vocab_ids(model)
    rank: dict[str, int] = {}
    for i, merge in enumerate(model.get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(str(left) + str(right), i)
    added = _added_tokens(model_dir)
    by_id = {i: t for t, i in vocab.items()}
    tokens, types, scores = [], [], []
    for i in range(_id_span({*by_id, *added}, "tokenizer.json")):
        text = added[i][0] if i in added else by_id.get(i, f"[PAD{i}]")
        if text == model.get("unk_token"):
            kind = T.UNKNOWN
        elif i in added:
            kind = T.CONTROL if added[i][1] else T.USER_DEFINED
        elif i not in by_id:
            kind = T.UNUSED
        else:
            kind = T.BYTE if _BYTE_TOKEN.match(text) else T.NORMAL
        tokens.append(text)
        types.append(int(kind))
        scores.append(-float(rank[text] + 1) if text in rank else 0.0)
    return Vocab("llama", tokens, types, scores)


def _vocab_ids(model: dict[str, Any]) -> dict[str, int]:
    """tokenizer.json's ``model.vocab``: token -> id, each id checked."""
    vocab = model.get("vocab", {})
    if not isinstance(vocab, dict):
        raise JobError("tokenizer.json: model.vocab is not an object")
    return {str(t): _token_id(i, "tokenizer.json model.vocab") for t, i in vocab.items()}


def _byte_level_bpe(model_dir: Path) -> Vocab:
    data = _read_json(model_dir / "tokenizer.json")
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise JobError(f"tokenizer model {model.get('type')!r} is not supported (BPE or SentencePiece)")
    if model.get("byte_fallback") and not _split_patterns(data.get("pre_tokenizer"))[1]:
        return _spm_bpe(model_dir, model)
    pre = _pre_name(data.get("pre_tokenizer"))
    by_id = {i: t for t, i in _vocab_ids(model).items()}
    added = _added_tokens(model_dir)
    size = _id_span({*by_id, *added}, "tokenizer.json")
    tokens, types = [], []
    for i in range(size):
        if i in added:
            content, special = added[i]
            tokens.append(content)
            types.append(int(T.CONTROL if special else T.USER_DEFINED))
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(int(T.NORMAL))
        else:
            tokens.append(f"[PAD{i}]")
            types.append(int(T.UNUSED))
    return Vocab("gpt2", tokens, types, pre=pre)


def load_vocab(model_dir: Path, n_vocab: int) -> Vocab:
    """The GGUF vocabulary of ``model_dir``, padded to the model's ``n_vocab``."""
    if (model_dir / "tokenizer.model").is_file():
        vocab = _sentencepiece(model_dir)
    elif (model_dir / "tokenizer.json").is_file():
        vocab = _byte_level_bpe(model_dir)
    else:
        raise JobError("the model dir has no tokenizer (tokenizer.model or tokenizer.json)")
    vocab.pad_to(n_vocab)
    return vocab
