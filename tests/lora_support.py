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
