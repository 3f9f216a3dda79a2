"""Speculative decoding for ``hf`` models, parent side, without vLLM: which
modes a vLLM worker is planned with, which draft model dirs may draft for a
target (the same vocabulary), and the draft's memory in the fit. The real
engine runs them in tests/test_vllm_serving.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.config import ModelSettings
from supervisor.errors import ApiError
from supervisor.models.demo import write_tiny_gguf
from supervisor.models.draft import plan_speculative
from supervisor.models.entry import ModelEntry
from supervisor.models.hf_fit import plan_hf_load
from supervisor.models.hf_info import HfInfo
from supervisor.models.memfit import ContextDecision, DoesNotFit
from tests.test_hf_library import CONFIG, listed, write_model

GIB = 1 << 30


class Library:
    def __init__(self, entries: dict[str, ModelEntry]) -> None:
        self.entries = entries

    def entry(self, model_id: str) -> ModelEntry | None:
        return self.entries.get(model_id)


@pytest.fixture
def lib(tmp_path: Path) -> Library:
    tokenizer = '{"model": {"vocab": {"a": 0, "b": 1}}}'
    for name, cfg in {"target": CONFIG, "small": {**CONFIG, "num_hidden_layers": 1},
                      "other-size": {**CONFIG, "vocab_size": 640},
                      "other-tokens": {**CONFIG, "num_hidden_layers": 1}}.items():
        d = write_model(tmp_path / name, cfg)
        (d / "tokenizer.json").write_text(tokenizer if name != "other-tokens" else tokenizer.replace("0", "2"))
    # A GGUF is no draft for a model vLLM runs.
    write_tiny_gguf(tmp_path / "gguf.gguf")
    return Library(listed(tmp_path))


def refusal(lib: Library, settings: ModelSettings) -> tuple[str | None, str | None]:
    with pytest.raises(ApiError) as caught:
        plan_speculative(lib.entries["target"], settings, lib)
    return caught.value.code, caught.value.param


def test_ngram_and_a_draft_dir_of_the_same_vocabulary_are_planned(lib: Library) -> None:
    ngram = plan_speculative(lib.entries["target"], ModelSettings(speculative="ngram", draft_max=6), lib)
    assert (ngram.options.mode, ngram.options.draft_max, ngram.draft) == ("ngram", 6, None)
    drafted = plan_speculative(lib.entries["target"], ModelSettings(speculative="draft", draft_model="small"), lib)
    assert (drafted.options.mode, drafted.options.draft_model) == ("draft", lib.entries["small"].path)
    assert drafted.draft_id == "small"
    # auto with a draft model set is that draft; without one nothing drafts (this model has no MTP layers).
    auto = plan_speculative(lib.entries["target"], ModelSettings(speculative="auto", draft_model="small"), lib)
    assert auto.options.mode == "draft"
    assert plan_speculative(lib.entries["target"], ModelSettings(speculative="auto"), lib).options.mode == "off"


def test_drafts_vllm_cannot_use_are_refused_naming_the_setting(lib: Library) -> None:
    assert refusal(lib, ModelSettings(speculative="mtp")) == ("mtp_unavailable", "speculative")

    def draft(model: str) -> tuple[str | None, str | None]:
        return refusal(lib, ModelSettings(speculative="draft", draft_model=model))

    assert draft("absent") == ("model_not_found", "draft_model")
    assert draft("other-size") == ("draft_vocab_mismatch", "draft_model")
    assert draft("other-tokens") == ("draft_vocab_mismatch", "draft_model")
    assert draft("target") == ("draft_unusable", "draft_model")
    assert draft("gguf") == ("draft_unusable", "draft_model")


def test_the_fit_holds_the_drafts_weights_and_kv_pages(lib: Library) -> None:
    target, small = lib.entries["target"].hf, lib.entries["small"].hf
    assert target is not None and small is not None

    def fit(free: int, draft: HfInfo | None = None) -> ContextDecision:
        return plan_hf_load(target, requested=1024, target_ctx=0, min_ctx=256, free_bytes=free,
                            memory_kind="cpu", slots=2, draft=draft)

    alone, with_draft = fit(8 * GIB), fit(8 * GIB, small)
    # 1 KiB of KV a token for the target's 2 layers, 0.5 KiB for the draft's 1
    # layer; and one page (128 tokens on the CPU) held back by vLLM's block pool.
    assert alone.kv_bytes == (1024 * 2 + 128) * 1024
    assert with_draft.kv_bytes == (1024 * 2 + 128) * (1024 + 512)
    assert with_draft.weight_bytes == alone.weight_bytes + small.parameter_bytes
    # Exactly what fits alone does not fit with the draft.
    with pytest.raises(DoesNotFit):
        fit(alone.needed_bytes, small)
