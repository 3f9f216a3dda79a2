"""PEFT LoRA adapters for tests, built on the tiny Hugging Face models of tests/tiny_hf.py.

``random_adapter`` gives an untrained adapter whose B matrices are random
(PEFT starts them at zero, which would change nothing); ``finetune`` runs
the real finetune job in a lab, with both exports.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from jobs.kinds import validate_params
from jobs.params import ResolveContext
from tests.jobsupport import running_lab, wait_finished
from tests.tiny_hf import copy_model, write_chat_dataset

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_adapter(base: Path, out: Path, *, seed: int, r: int = 4, alpha: int = 8,
                   **config: Any) -> Path:
    """A PEFT adapter on ``base`` with random B matrices, saved as safetensors in ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS,
                                            task_type="CAUSAL_LM", **config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3)
    peft.save_pretrained(str(out), safe_serialization=True)
    return out


def finetune(base_dir: Path, hf_model: Path, **over: Any) -> dict[str, Any]:
    """Run a finetune job (merged export F32, adapter export) in a lab under ``base_dir``."""

    async def run() -> dict[str, Any]:
        async with running_lab(base_dir) as lab:
            copy_model(hf_model, lab.roots.models)
            write_chat_dataset(lab.roots.datasets / "qa.train.jsonl", repeats=8)
            raw: dict[str, Any] = {
                "model": "tiny-hf", "train": "qa.train.jsonl", "max_steps": 30, "learning_rate": 1e-2,
                "batch_size": 4, "gradient_accumulation_steps": 1, "save_steps": 1000, "cpu_threads": 1,
                "output_name": "ft", "export": {"outtype": "F32", "output_name": "tiny-ft"},
                "export_adapter": True, **over,
            }
            params = validate_params("finetune", raw, ResolveContext(lab.roots))
            job, _ = await lab.runner.submit("finetune", params)
            done = await wait_finished(lab.store, job.id, timeout=240)
            assert done.status == "succeeded", done
            assert done.result is not None
            return done.result

    return asyncio.run(run())


def engine_refused_copy(src: Path, out: Path) -> Path:
    """``src`` with one key the engine's adapter loader refuses and the
    library does not read (aLoRA invocation tokens as a string, where it
    takes a uint32 array): a stand-in for any fault only the engine finds."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    alpha = reader.get_field(gguf.Keys.Adapter.LORA_ALPHA)
    base = reader.get_field("general.base_model.0.name")
    assert arch is not None and alpha is not None
    writer = gguf.GGUFWriter(out, str(arch.contents()))
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha.contents()))
    if base is not None:
        writer.add_string("general.base_model.0.name", str(base.contents()))
    writer.add_string("adapter.alora.invocation_tokens", "not tokens")
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def truncated_copy(src: Path, out: Path, cut: int = 3000) -> Path:
    """``src`` without its last ``cut`` bytes: the header reads, the data runs short."""
    out.write_bytes(src.read_bytes()[:-cut])
    return out


def retyped_copy(src: Path, out: Path) -> Path:
    """``src`` with its first ``lora_b`` tensor's type set to Q8_0 in the
    index: its rows (the rank, 4 values) are no whole 32-value block, which
    the engine refuses; every size and offset is as before."""
    import struct

    import gguf

    reader = gguf.GGUFReader(src)
    tensor = next(t for t in reader.tensors if t.name.endswith(".lora_b"))
    data = bytearray(src.read_bytes())
    name = tensor.name.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, int(gguf.GGMLQuantizationType.Q8_0))
    out.write_bytes(bytes(data))
    return out
