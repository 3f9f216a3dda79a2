"""Tiny Hugging Face models and chat datasets built on the fly for tests.

Nothing is downloaded: the tokenizer is trained on a short text with
``tokenizers`` (byte-level BPE) or ``sentencepiece`` (SentencePiece BPE with
byte fallback), the model is randomly initialised and saved as safetensors.
Needs the ``train`` extra (torch, transformers, tokenizers, sentencepiece).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

Arch = Literal["llama", "mistral", "qwen2"]
TokenizerKind = Literal["bpe", "spm"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]

QA = [
    ("What colour is the sky?", "The sky is blue."),
    ("What is two plus two?", "Two plus two is four."),
    ("Name a fruit.", "An apple is a fruit."),
    ("Where do fish live?", "Fish live in water."),
]


def corpus_text() -> str:
    lines = [f"user {q} assistant {a}" for q, a in QA]
    lines += ["The quick brown fox jumps over the lazy dog.", "Hello world, hello lab."]
    return "\n".join(lines * 4)


def write_chat_dataset(path: Path, repeats: int = 4, system: bool = True) -> Path:
    """Canonical chat JSONL, as the ``dataset`` job writes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(repeats):
            for q, a in QA:
                msgs: list[dict[str, str]] = []
                if system:
                    msgs.append({"role": "system", "content": "Answer briefly."})
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def _bpe_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "</s>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(fast)


def _spm_tokenizer(out: Path) -> int:
    import sentencepiece as spm

    text = out / "corpus.txt"
    text.write_text(corpus_text())
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(out / "tokenizer"), vocab_size=300, model_type="bpe",
        byte_fallback=True, user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
        # As Llama's own: no normalization, whitespace kept (llama.cpp does neither).
        normalization_rule_name="identity", remove_extra_whitespaces=False,
    )
    text.unlink()
    (out / "tokenizer.vocab").unlink()
    config = {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            "3": {"content": "<|im_start|>", "special": True},
            "4": {"content": "<|im_end|>", "special": True},
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    proc = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    return int(proc.vocab_size())


def _config(arch: Arch, vocab: int, **extra: Any) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        # Larger than the usual 0.02, so logits differ enough to compare.
        "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
    }
    common.update(extra)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    return LlamaConfig(**common)


def build_tiny_model(
    out: Path, arch: Arch = "llama", tokenizer: TokenizerKind = "bpe",
    dtype: str = "float32", seed: int = 0, **config: Any,
) -> Path:
    """Write a tiny causal LM with its tokenizer and chat template to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = _bpe_tokenizer(out) if tokenizer == "bpe" else _spm_tokenizer(out)
    cfg = _config(arch, vocab, **config)
    if tokenizer == "bpe":
        ids = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = ids["<s>"], ids["<|im_end|>"], ids["<pad>"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    return out


# What vLLM's CPU attention accepts: it refused head_dim 16 ("Unsupported CPU
# attention configuration"); 64 serves.
VLLM_CONFIG: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
}


def build_vllm_model(out: Path, arch: Arch = "llama", dtype: str = "bfloat16", seed: int = 0,
                     **config: Any) -> Path:
    """A tiny random model vLLM serves (head_dim 64), its chat template in
    tokenizer_config.json as well as where transformers puts it."""
    build_tiny_model(out, arch, "bpe", dtype, seed, **{**VLLM_CONFIG, **config})
    path = out / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    tok_config.setdefault("chat_template", CHAT_TEMPLATE)
    path.write_text(json.dumps(tok_config, indent=2))
    return out


def copy_model(src: Path, models_dir: Path, name: str = "tiny-hf") -> Path:
    """A copy inside ``models_dir`` (a symlink would resolve outside the roots)."""
    import shutil

    dst = models_dir / name
    shutil.copytree(src, dst)
    return dst


def put_in_hub_cache(src: Path, cache: Path, repo_id: str, commit: str = "c" * 40) -> Path:
    """``src``'s files as a Hub cache snapshot of ``repo_id`` (blobs, a
    snapshot of relative symlinks, ``refs/main``), laid out as
    huggingface_hub downloads them; the snapshot dir."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for i, f in enumerate(sorted(p for p in src.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"{i:064x}"
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(f"../../blobs/{blob.name}")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
