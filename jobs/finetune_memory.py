"""How much memory a fine-tune takes per device: estimated from the model's
files before anything loads, and measured while it trains.

The estimate reads ``config.json`` and the safetensors headers (tensor
names and shapes; no weights are read, no torch is imported), so the
parent can show it before a submit as well as the job log it. Per device,
since every data-parallel rank holds a whole replica:

- weights: every tensor at the training dtype; with ``load_in_4bit`` the
  decoder's linear weights at NF4 with double quantization (about 4.1 bits)
  and the rest in fp32, as peft's k-bit preparation casts them;
- adapter: the LoRA matrices of the target modules (rank ``r`` times the
  module's in + out features) in fp32, with their gradients and AdamW's
  two moments (16 bytes a parameter; 4 more for the all-reduce buffer when
  several ranks train);
- activations kept for the backward pass, per token of the largest
  micro-batch: about ``10 * hidden + 4 * intermediate`` values per layer
  (norm inputs and outputs, q/k/v, attention output, the gated MLP's four),
  or, with gradient checkpointing, one hidden vector per layer plus one
  layer recomputed in full;
- logits: one value per token and vocabulary entry at the training dtype,
  plus the fp32 copy, log-softmax and gradient of the loss.

It leaves out the CUDA context and allocator slack (the measured
``torch.cuda.max_memory_allocated`` leaves them out too) and, on the CPU,
the Python runtime and libraries (the log gives the RSS peak before loading
beside the one after training, for that reason).
"""

from __future__ import annotations

import json
import resource
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.finetune_params import FinetuneParams
from jobs.sizes import size_text

if TYPE_CHECKING:
    import torch

_MAX_HEADER = 100 << 20
# NF4 weights with double-quantized absmax: 4 bits + about 0.127 bits a weight.
_NF4_BYTES = (4 + 0.127) / 8


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    adapter_bytes: int
    activations_bytes: int
    logits_bytes: int
    tokens_per_micro_batch: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.adapter_bytes + self.activations_bytes + self.logits_bytes

    def describe(self) -> str:
        return (f"{size_text(self.total_bytes)} (weights {size_text(self.weights_bytes)}, "
                f"adapter with gradients and optimizer {size_text(self.adapter_bytes)}, "
                f"activations {size_text(self.activations_bytes)}, logits {size_text(self.logits_bytes)}; "
                f"{self.tokens_per_micro_batch} tokens a micro-batch)")

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes}


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def tensor_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Name -> shape of every tensor in the model's safetensors files."""
    shapes: dict[str, list[int]] = {}
    for path in _safetensors_files(model_dir):
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER:
                raise ValueError(f"{path.name}: safetensors header of {n} bytes")
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__" and isinstance(meta, dict):
                shapes[name] = [int(d) for d in meta.get("shape", [])]
    return shapes


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _text_config(model_dir: Path) -> dict[str, Any]:
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) else dict(cfg)


def _is_layer_linear(name: str, shape: list[int]) -> bool:
    return len(shape) == 2 and ".layers." in f".{name}" and name.endswith(".weight")


def estimate_memory(model_dir: Path, params: FinetuneParams, dtype_bytes: int, seq_len: int | None = None,
                    world: int = 1) -> MemoryEstimate | None:
    """The per-device estimate; None where the model has no safetensors to read.

    ``seq_len``: the longest micro-batch's length, where known (the job
    knows its data); unset, ``max_seq_len`` (the most a batch can be)."""
    shapes = tensor_shapes(model_dir)
    if not shapes:
        return None
    cfg = _text_config(model_dir)
    hidden = int(cfg.get("hidden_size") or 0)
    layers = int(cfg.get("num_hidden_layers") or 0)
    inter = int(cfg.get("intermediate_size") or 4 * hidden)
    vocab = int(cfg.get("vocab_size") or 0)
    weights = 0.0
    lora = 0
    targets = set(params.target_modules)
    for name, shape in shapes.items():
        n = _numel(shape)
        quantized = params.load_in_4bit and _is_layer_linear(name, shape)
        weights += n * (_NF4_BYTES if quantized else (4 if params.load_in_4bit else dtype_bytes))
        if len(shape) == 2 and name.endswith(".weight") and name.rsplit(".", 2)[-2] in targets:
            lora += params.lora_r * (shape[0] + shape[1])
    adapter = lora * (16 + (4 if world > 1 else 0))
    tokens = params.batch_size * min(seq_len or params.max_seq_len, params.max_seq_len)
    per_layer = 10 * hidden + 4 * inter
    kept = layers * hidden + per_layer if params.gradient_checkpointing else layers * per_layer
    activations = tokens * (kept + 2 * hidden) * dtype_bytes
    logits = tokens * vocab * (dtype_bytes + 12)
    return MemoryEstimate(int(weights), adapter, activations, logits, tokens)


def _rss_peak_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class PeakMemory:
    """The memory peak of this process on its device, from construction on."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.method = "torch.cuda.max_memory_allocated"
        else:
            self.method = "RSS peak"
        self.before = self._read()

    def _read(self) -> int:
        import torch

        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return _rss_peak_bytes()

    def report(self, estimate: MemoryEstimate | None) -> tuple[str, dict[str, Any]]:
        """A log line and the result's ``memory`` entry."""
        peak = self._read()
        text = f"memory on {self.device}: peak {size_text(peak)} ({self.method}"
        if self.device.type != "cuda":
            text += f"; {size_text(self.before)} before the model was loaded"
        text += ")"
        if estimate is not None:
            text += f", estimate {size_text(estimate.total_bytes)}"
            if self.device.type != "cuda":
                whole = size_text(self.before + estimate.total_bytes)
                text += f" (+ the {size_text(self.before)} before loading: {whole})"
        entry: dict[str, Any] = {"device": str(self.device), "peak_bytes": peak, "measured_by": self.method,
                                 "before_load_bytes": self.before,
                                 "estimate_bytes": estimate.total_bytes if estimate is not None else None}
        return text, entry
