"""A tiny random BLIP-2 built on the fly for the vLLM image tests.

BLIP-2 is the one vision family vLLM's CPU build serves here without
torchvision (docs/vllm.md, Images): its image processor resizes and
normalises with PIL and numpy. The model is an OPT text model of 2 layers
(head dim 64, as vLLM's CPU attention needs), a BLIP vision tower of 2
layers on 56-pixel images in 14-pixel patches and a one-layer Q-Former with
8 query tokens, randomly initialised. The tokenizer is a byte-level BPE
trained on a short text (tests/tiny_hf.py) with ``<image>`` a special token:
vLLM inserts one per query token ahead of the prompt. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QUERY_TOKENS = 8
IMAGE_SIZE = 56
# BLIP's own image processing (CLIP's mean and deviation), at this size.
PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "BlipImageProcessor", "do_convert_rgb": True, "do_resize": True,
    "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "resample": 3, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def build_tiny_blip2(out: Path, seed: int = 0) -> Path:
    """Write the model, its tokenizer and its processor to ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        PreTrainedTokenizerFast,
    )

    from tests.tiny_hf import corpus_text

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "</s>", "<image>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<image>"],
    )
    vocab = fast.get_vocab()
    text_config = {
        "model_type": "opt", "vocab_size": len(fast), "hidden_size": 256, "ffn_dim": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512,
        "word_embed_proj_dim": 256, "pad_token_id": vocab["<pad>"], "bos_token_id": vocab["</s>"],
        "eos_token_id": vocab["</s>"], "init_std": 0.2,
    }
    vision_config = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "image_size": IMAGE_SIZE, "patch_size": 14,
    }
    qformer_config = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "encoder_hidden_size": 64, "vocab_size": 64, "max_position_embeddings": 64,
    }
    config = Blip2Config(vision_config=vision_config, qformer_config=qformer_config, text_config=text_config,
                         num_query_tokens=QUERY_TOKENS, image_token_index=vocab["<image>"])
    torch.manual_seed(seed)
    model = Blip2ForConditionalGeneration(config)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    # Written as JSON: transformers' image processor classes need PIL or
    # torchvision to be built, which the test environment lacks; vLLM's
    # environment loads these with its PIL backend.
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Blip2Processor", "num_query_tokens": QUERY_TOKENS}, indent=2))
    return out
