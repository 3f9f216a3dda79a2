"""A fine-tune of each family the export covers, through to a GGUF that
answers: the job trains a LoRA adapter on every attention and MLP projection
of the family (Phi-3's fused ones included), merges it, exports the merge,
and the engine computes what HF computes with the merged weights, which in
turn differ from the base's (so the training reached the file). The adapter
exported alone as a GGUF LoRA file adds up to the merge on the base's GGUF.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

pytest.importorskip("transformers", reason="needs the train extra")

from jobs.finetune_params import FinetuneParams
from jobs.hf_convert import convert
from jobs.kinds import validate_params
from jobs.params import ResolveContext
from tests.jobsupport import running_lab, wait_finished
from tests.test_export import PROMPT_IDS, engine_logprobs, engine_run, log_softmax
from tests.test_export_families import _F32_TOL, FAMILIES, build_family, hf_logits
from tests.tiny_hf import build_tiny_model, write_chat_dataset

pytestmark = pytest.mark.timeout(240)

_SPLIT = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
# What a user of each family expects the default targets to adapt. The MoE's
# experts are not separate linear layers in transformers, so its MLP part is
# the shared attention only.
_ADAPTED: dict[str, set[str]] = {
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "qwen3moe": {"q_proj", "k_proj", "v_proj", "o_proj"},
}


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Job processes inherit it: spinning OpenMP threads slow a tiny model down on a busy machine.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tok") / "llama", "llama", "bpe")


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # A Unix socket path must stay under ~100 bytes; tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="gv", dir="/tmp"))
    yield path
    shutil.rmtree(path)


def _tensors(path: Path) -> dict[str, np.ndarray[Any, Any]]:
    return {t.name: np.array(t.data, dtype=np.float32) for t in gguf.GGUFReader(path).tensors}


def _adapted_modules(adapter_dir: Path) -> set[str]:
    """The module names the adapter file holds LoRA weights for."""
    from safetensors import safe_open

    with safe_open(str(adapter_dir / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    return {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names if ".lora_A" in n}


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_a_finetune_of_each_family_exports_and_answers(tmp_path: Path, tokenizer_dir: Path, sock_dir: Path,
                                                             family: str) -> None:
    async with running_lab(tmp_path) as lab:
        base = build_family(lab.roots.models / f"tiny-{family}", family, tokenizer_dir)
        write_chat_dataset(lab.roots.datasets / "qa.train.jsonl")
        raw: dict[str, Any] = {
            "model": f"tiny-{family}", "train": "qa.train.jsonl", "max_steps": 6, "learning_rate": 2e-2,
            "batch_size": 4, "gradient_accumulation_steps": 1, "cpu_threads": 1, "lora_alpha": 32,
            # Not named for the family: the engine takes a model named like
            # Phi-3 for Phi-3's own tokenizer and looks up tokens this one lacks.
            "export": {"outtype": "F32", "output_name": f"tuned-{list(FAMILIES).index(family)}"},
            "export_adapter": True,
        }
        params = validate_params("finetune", raw, ResolveContext(lab.roots))
        assert isinstance(params, FinetuneParams)
        job, _ = await lab.runner.submit("finetune", params)
        done = await wait_finished(lab.store, job.id, timeout=220)
        assert done.status == "succeeded", done.error
        log = " ".join(e.data.get("message", "") for e in await lab.store.events_after(job.id, 0, 10_000)
                       if e.type == "log")
    result = done.result or {}
    assert _adapted_modules(Path(result["adapter_path"])) == _ADAPTED.get(family, _SPLIT)
    assert "target modules not in this model" not in log  # the defaults a family lacks are no news
    exported = lab.roots.models / f"{result['export']['model']}.gguf"
    assert exported.name == f"tuned-{list(FAMILIES).index(family)}.gguf" and exported.is_file()

    merged = Path(result["merged_path"])
    tuned, before = log_softmax(hf_logits(merged, PROMPT_IDS)), log_softmax(hf_logits(base, PROMPT_IDS))
    assert float(np.abs(tuned - before).max()) > 10 * _F32_TOL[family], "the fine-tune changed nothing"
    got = engine_logprobs(engine_run(exported, sock_dir, PROMPT_IDS), PROMPT_IDS)
    diff = float(np.abs(got - tuned).max())
    assert diff < _F32_TOL[family], f"{family}: the GGUF answers {diff} away from the fine-tuned model"
    assert json.loads((merged / "config.json").read_text())["architectures"] == \
        json.loads((base / "config.json").read_text())["architectures"]

    # The adapter as a GGUF LoRA file, for serving on the base without a merge:
    # the base's GGUF weights plus scale * B @ A are the merged GGUF's weights.
    convert(base, tmp_path / "base.gguf", "F32", "base")
    lora_file = Path(result["adapter_export"]["path"])
    fields = {k: v.contents() for k, v in gguf.GGUFReader(str(lora_file)).fields.items()}
    scale = fields["adapter.lora.alpha"] / 16  # lora_alpha 32 over the default rank 16
    weights, tuned_w, lora = _tensors(tmp_path / "base.gguf"), _tensors(exported), _tensors(lora_file)
    adapted = sorted(n.removesuffix(".lora_a") for n in lora if n.endswith(".lora_a"))
    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    assert len(adapted) == layers * len(_ADAPTED.get(family, _SPLIT))
    for w in adapted:
        applied = weights[w] + scale * lora[w + ".lora_b"] @ lora[w + ".lora_a"]
        np.testing.assert_allclose(applied, tuned_w[w], atol=1e-4, err_msg=w)
