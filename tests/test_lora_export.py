"""PEFT adapter -> GGUF LoRA adapter: the written tensors against PEFT's own
merge, the export job on an adapter dir, and how the library links adapters
to the base models they fit (or refuses them, with the reason)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import gguf
import msgspec
import numpy as np
import pytest

pytest.importorskip("peft", reason="needs the train extra")

from jobs.context import JobError
from jobs.errors import ParamError
from jobs.hf_convert import convert
from jobs.kinds import validate_params
from jobs.lora_export import convert_adapter
from jobs.params import ResolveContext
from supervisor.config import ModelSettings
from supervisor.models.library import ModelEntry, ModelLibrary
from supervisor.models.placement import plan_load
from tests.jobsupport import make_roots, running_lab, wait_finished
from tests.lora_support import random_adapter
from tests.tiny_hf import build_tiny_model, copy_model

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def one_torch_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hf") / "tiny-hf")


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data, dtype=np.float32) for t in gguf.GGUFReader(path).tensors}


def _merged_dir(base: Path, adapter: Path, out: Path) -> Path:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    model.merge_and_unload().save_pretrained(out, safe_serialization=True)
    for f in base.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("rslora", [False, True])
def test_adapter_applied_to_the_base_gives_the_merged_weights(tmp_path: Path, tiny_hf: Path,
                                                              rslora: bool) -> None:
    adapter = random_adapter(tiny_hf, tmp_path / "adapter", seed=3, r=4, alpha=8, use_rslora=rslora)
    convert(tiny_hf, tmp_path / "base.gguf", "F32", "tiny-hf")
    convert(_merged_dir(tiny_hf, adapter, tmp_path / "merged"), tmp_path / "merged.gguf", "F32", "m")
    info = convert_adapter(adapter, tiny_hf, tmp_path / "a.gguf", "F32", "a")

    reader = gguf.GGUFReader(tmp_path / "a.gguf")
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora"
    assert fields["general.architecture"] == "llama"
    assert fields["general.base_model.0.name"] == "tiny-hf" == info.base_name
    # The engine scales by alpha / rank: PEFT's alpha / r, or alpha / sqrt(r) for rsLoRA.
    want_scale = 8 / 2 if rslora else 8 / 4
    assert fields["adapter.lora.alpha"] / 4 == pytest.approx(want_scale)

    base, merged, lora = _tensors(tmp_path / "base.gguf"), _tensors(tmp_path / "merged.gguf"), _tensors(tmp_path / "a.gguf")
    weights = sorted(n.removesuffix(".lora_a") for n in lora if n.endswith(".lora_a"))
    assert len(weights) == 2 * 7 and "blk.1.attn_q.weight" in weights
    for w in weights:
        applied = base[w] + want_scale * lora[w + ".lora_b"] @ lora[w + ".lora_a"]
        # Q and K included: their rotary permutation is carried by lora_b.
        np.testing.assert_allclose(applied, merged[w], atol=2e-5, err_msg=w)
        assert not np.allclose(base[w], merged[w]), f"{w}: the adapter changed nothing"


def test_lora_variants_the_engine_cannot_run_are_refused(tmp_path: Path, tiny_hf: Path) -> None:
    adapter = random_adapter(tiny_hf, tmp_path / "adapter", seed=1)
    cfg_path = adapter / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key, value in (("use_dora", True), ("alpha_pattern", {"q_proj": 4})):
        cfg_path.write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(JobError):
            convert_adapter(adapter, tiny_hf, tmp_path / "a.gguf", "F16", "a")


async def test_export_job_converts_an_adapter_dir_and_the_library_links_it(tmp_path: Path,
                                                                          tiny_hf: Path) -> None:
    roots = make_roots(tmp_path)
    base = copy_model(tiny_hf, roots.models)
    random_adapter(base, roots.outputs / "run1" / "adapter", seed=2)
    convert(base, roots.models / "tiny-hf.gguf", "F16", "tiny-hf")
    ctx = ResolveContext(roots)
    with pytest.raises(ParamError) as bad:
        validate_params("export", {"model": str(roots.outputs / "run1" / "adapter"), "quantize": "Q8_0"}, ctx)
    assert bad.value.param == "params.quantize"
    async with running_lab(tmp_path) as lab:
        params = validate_params("export", {"model": str(roots.outputs / "run1" / "adapter")}, ctx)
        job, _ = await lab.runner.submit("export", params)
        done = await wait_finished(lab.store, job.id, timeout=120)
    assert done.status == "succeeded", done
    assert done.result is not None and done.result["adapter"]["adapter"] == "run1-lora"
    # Written under a hidden name and renamed: nothing else is left behind.
    assert sorted(p.name for p in roots.models.glob("*.gguf")) == ["run1-lora.gguf", "tiny-hf.gguf"]
    assert not [p for p in roots.models.iterdir() if p.name.startswith(".")]
    with pytest.raises(ParamError) as exists:
        validate_params("export", {"model": str(roots.outputs / "run1" / "adapter")}, ctx)
    assert exists.value.param == "params.output_name" and exists.value.code == "output_exists"

    lib = ModelLibrary([roots.models], settle_s=0)
    await asyncio.to_thread(lib.rescan)
    assert [e.id for e in lib.list()] == ["tiny-hf"]  # the adapter is no model of its own
    [adapter] = lib.adapters()
    assert adapter.usable and adapter.info is not None and adapter.info.rank == 4
    assert [(lk.base, lk.id, lk.fits) for lk in adapter.links] == [("tiny-hf", "tiny-hf:run1-lora", True)]
    base_entry = lib.get("tiny-hf")
    assert base_entry is not None and [a.id for a in base_entry.adapters] == ["run1-lora"]
    assert lib.pair("tiny-hf:run1-lora") is not None

    # The memory fit holds the adapters' bytes back beside the weights.
    def reserve(entry: ModelEntry) -> int:
        d = plan_load(entry, ModelSettings(), explicit_ctx=False, target_ctx=256, min_ctx=128,
                      free_bytes=1 << 33, memory_kind="ram")
        assert d is not None
        return d.reserve_bytes

    bare = msgspec.structs.replace(base_entry, adapters=[])
    assert reserve(base_entry) - reserve(bare) == adapter.size_bytes > 0


def test_library_refuses_an_adapter_that_does_not_fit_its_base(tmp_path: Path, tiny_hf: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    convert(tiny_hf, models / "tiny-hf.gguf", "F16", "tiny-hf")
    # A model of the same name and architecture but a narrower feed-forward.
    other = build_tiny_model(tmp_path / "other" / "tiny-hf", intermediate_size=96)
    convert_adapter(random_adapter(other, tmp_path / "bad", seed=4), other, models / "bad-lora.gguf", "F16", "bad")
    # An adapter for a base the library does not have.
    lonely = build_tiny_model(tmp_path / "x" / "elsewhere")
    convert_adapter(random_adapter(lonely, tmp_path / "l", seed=5), lonely, models / "lonely.gguf", "F16", "l")

    lib = ModelLibrary([models], settle_s=0)
    lib.rescan()
    adapters = {a.id: a for a in lib.adapters()}
    bad = adapters["bad-lora"]
    assert not bad.usable and [(lk.base, lk.fits) for lk in bad.links] == [("tiny-hf", False)]
    reason = bad.links[0].reason or ""
    assert "ffn" in reason and "96" in reason and "128" in reason
    assert lib.pair("tiny-hf:bad-lora") is not None
    lonely_entry = adapters["lonely"]
    assert not lonely_entry.usable and not lonely_entry.links and "elsewhere" in (lonely_entry.reason or "")
    base = lib.get("tiny-hf")
    assert base is not None and base.adapters == []  # nothing refused reaches a worker
