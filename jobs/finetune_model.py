"""The model a fine-tune trains: the base on its device (or in 4 bits), the
memory savers, and the LoRA adapter on top.

Memory savers, both decided here:
- gradient checkpointing (``gradient_checkpointing``, on by default): each
  decoder layer keeps only its input for the backward pass and recomputes
  the rest, so activations cost one layer's worth instead of all layers'.
  It costs about a third more compute. The non-reentrant form is used:
  it needs no input that requires a gradient (the base is frozen) and works
  with a LoRA-only set of trainable parameters.
- a 4-bit base (``load_in_4bit``, QLoRA): bitsandbytes' NF4 weights with
  double quantization and the compute in bf16/fp16. bitsandbytes' 4-bit
  layers run on CUDA only, so a job that sees no CUDA device fails with
  that reason before anything is loaded (the parent refuses the submission
  already where it can tell: :meth:`FinetuneParams.devices`).

Merging a 4-bit run loads the base again unquantized on the CPU and merges
the saved adapter there: the merged model (and its GGUF export) has the
base's own precision, never 4-bit weights rounded back up.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.context import JobError
from jobs.events import JobIO
from jobs.finetune_data import CHATML
from jobs.finetune_params import BNB_INSTALL_HINT, DEFAULT_TARGETS, FinetuneParams

if TYPE_CHECKING:
    import torch


def default_device() -> torch.device:
    """The device of a single-process run: the first visible GPU, else the CPU."""
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def train_dtype(params: FinetuneParams, device: torch.device) -> torch.dtype:
    import torch

    if params.dtype != "auto":
        return getattr(torch, params.dtype)  # type: ignore[no-any-return]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if device.type == "cuda" and params.load_in_4bit:
        return torch.float16  # 4-bit compute needs a half type; bf16 is not supported here
    return torch.float32


def check_4bit(device: torch.device) -> None:
    """Why a 4-bit base cannot load here, as a JobError (nothing when it can)."""
    if device.type != "cuda":
        raise JobError(
            "load_in_4bit (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit layers run on CUDA only, "
            "and this job sees no CUDA device (torch.cuda.is_available() is false); "
            "train without load_in_4bit, or on a GPU"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise JobError(f"load_in_4bit (QLoRA) needs bitsandbytes, which is not installed: {BNB_INSTALL_HINT}")


def load_tokenizer(io: JobIO, model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.is_fast:
        raise JobError("finetune needs a fast (tokenizers) tokenizer to locate assistant tokens")
    if tokenizer.chat_template is None:
        io.log("the model has no chat template: using ChatML")
        tokenizer.chat_template = CHATML
    return tokenizer


def _load_base(params: FinetuneParams, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    if not params.load_in_4bit:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model.to(device)  # type: ignore[arg-type]  # transformers' stubs misname the parameter
        return model
    check_4bit(device)
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(  # type: ignore[no-untyped-call]
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, quantization_config=quant, device_map={"": device.index or 0})
    # Norms and embeddings in fp32 for stable training on the 4-bit base;
    # checkpointing is switched on (or not) by _checkpointing below.
    prepared = prepare_model_for_kbit_training(  # type: ignore[no-untyped-call]
        model, use_gradient_checkpointing=False)
    return prepared


def _checkpointing(io: JobIO, params: FinetuneParams, model: Any) -> bool:
    if not params.gradient_checkpointing:
        io.log("gradient checkpointing: off (gradient_checkpointing=false): every layer's activations are kept")
        return False
    if not getattr(model, "supports_gradient_checkpointing", False):
        io.log(f"gradient checkpointing: {type(model).__name__} does not support it, so it is off")
        return False
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # a KV cache is of no use in training, and conflicts with recomputing
    io.log("gradient checkpointing: on (each layer's activations are recomputed in the backward pass: "
           "less memory, about a third more compute; gradient_checkpointing=false turns it off)")
    return True


def load_model(io: JobIO, params: FinetuneParams, model_dir: Path, device: torch.device) -> tuple[Any, bool]:
    """The LoRA-wrapped model on ``device``, and whether checkpointing is on."""
    from peft import LoraConfig, get_peft_model

    model = _load_base(params, model_dir, device, train_dtype(params, device))
    checkpointing = _checkpointing(io, params, model)
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t for t in params.target_modules if t in present]
    if not targets:
        raise JobError(f"none of target_modules {params.target_modules} exist in this model")
    skipped = set(params.target_modules) - present
    if skipped and tuple(params.target_modules) != DEFAULT_TARGETS:
        io.log(f"target modules not in this model, skipped: {sorted(skipped)}")
    io.log(f"adapting: {', '.join(targets)}")
    lora = LoraConfig(r=params.lora_r, lora_alpha=params.lora_alpha, lora_dropout=params.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")
    return get_peft_model(model, lora), checkpointing


def merged_model(io: JobIO, model: Any, params: FinetuneParams, model_dir: Path, adapter: Path) -> Any:
    """The base with the adapter merged in, in the base's own dtype."""
    if params.load_in_4bit:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        io.log("merging on the CPU into the unquantized base (the 4-bit weights are not merged)")
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
        return PeftModel.from_pretrained(base, adapter).merge_and_unload()
    merged = model.merge_and_unload()
    dtype = getattr(merged.config, "dtype", None)
    if dtype is not None and dtype != next(merged.parameters()).dtype:
        merged = merged.to(dtype)  # back to the base model's own dtype
    return merged
