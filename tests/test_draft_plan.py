"""Speculative settings without a server: validation naming the setting, the
older ``draft_ngram`` spelling, ``auto``, the vocabulary check on real GGUF
headers, and the draft model's share of the memory fit."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from supervisor.config import ConfigError, ModelSettings, load_config
from supervisor.errors import BadRequest, ModelNotFound
from supervisor.models.demo import write_tiny_gguf
from supervisor.models.draft import VocabMismatch, draft_bytes, plan_speculative
from supervisor.models.gguf_info import read_gguf_info
from supervisor.models.library import ModelEntry
from supervisor.models.memfit import DoesNotFit
from supervisor.models.placement import plan_load
from supervisor.models.vocab import vocab_difference
from tests.tiny_mtp import write_tiny_mtp
from worker.protocol import SpeculativeOptions


class Library:
    def __init__(self, *entries: ModelEntry) -> None:
        self.entries = {e.id: e for e in entries}

    def entry(self, model_id: str) -> ModelEntry | None:
        return self.entries.get(model_id)


def entry_of(path: Path) -> ModelEntry:
    return ModelEntry(id=path.stem, path=str(path), files=[str(path)], size_bytes=path.stat().st_size,
                      source="dir", root=str(path.parent), mtime=0.0, info=read_gguf_info(path))


@pytest.fixture
def lib(tmp_path: Path) -> Library:
    return Library(entry_of(write_tiny_gguf(tmp_path / "target.gguf", n_layer=4)),
                   entry_of(write_tiny_gguf(tmp_path / "draft.gguf", n_layer=1, seed=3)),
                   entry_of(write_tiny_gguf(tmp_path / "wide.gguf", n_layer=1, extra_tokens=400)))


def settings(**kw: object) -> ModelSettings:
    return msgspec.convert(kw, ModelSettings)


def test_draft_ngram_is_the_older_spelling_of_ngram() -> None:
    s = settings(draft_ngram=4)
    assert (s.speculative_mode(), s.draft_lengths()) == ("ngram", (0, 4))
    assert settings(draft_ngram=0).speculative_mode() == "off"
    # A layer that chooses drafting replaces the layer below's choice whole.
    base = settings(draft_ngram=4)
    over = settings(speculative="draft", draft_model="d").over(base)
    assert over.speculative_mode() == "draft" and over.speculative_problem() is None
    assert settings(draft_ngram=0).over(settings(speculative="draft", draft_model="d")).speculative_mode() == "off"
    # Below a layer, draft_ngram = N is speculative = "ngram" with draft_max = N: a draft_max above it wins.
    longer = settings(draft_max=6).over(base)
    assert (longer.speculative_mode(), longer.draft_lengths(), longer.speculative_problem()) == ("ngram", (0, 6), None)


def test_config_names_the_setting(tmp_path: Path) -> None:
    def config(toml: str) -> None:
        path = tmp_path / "c.toml"
        path.write_text(toml)
        load_config({"config": str(path), "state_dir": str(tmp_path)}, environ={})

    with pytest.raises(ConfigError, match="draft_model"):
        config('[model_defaults.m]\nspeculative = "draft"\n')
    with pytest.raises(ConfigError, match="draft_max"):
        config("[model_defaults.m]\ndraft_max = 100\n")
    with pytest.raises(ConfigError, match="speculative"):
        config('[model_defaults.m]\nspeculative = "fast"\n')
    config('[model_defaults.m]\nspeculative = "draft"\ndraft_model = "d"\ndraft_max = 8\n')


def test_modes_resolve(lib: Library) -> None:
    target = lib.entries["target"]
    assert plan_speculative(target, settings(speculative="auto"), lib).options.mode == "off"
    plan = plan_speculative(target, settings(speculative="auto", draft_model="draft", draft_max=5), lib)
    assert plan.options == SpeculativeOptions("draft", lib.entries["draft"].path, 0, 5)
    assert plan.draft_id == "draft"
    assert target.info is not None
    mtp_target = msgspec.structs.replace(
        target, info=msgspec.structs.replace(target.info, nextn_predict_layers=1))
    assert plan_speculative(mtp_target, settings(speculative="auto"), lib).options.mode == "mtp"
    assert plan_speculative(mtp_target, settings(speculative="mtp"), lib).options.mode == "mtp"
    # An embedding worker generates nothing: it never drafts.
    assert plan_speculative(target, settings(draft_ngram=4), lib, embedding=True).options.mode == "off"


@pytest.mark.parametrize(("kw", "error", "param"), [
    ({"speculative": "mtp"}, BadRequest, "speculative"),
    ({"speculative": "draft", "draft_model": "missing"}, ModelNotFound, "draft_model"),
    ({"speculative": "draft", "draft_model": "wide"}, VocabMismatch, "draft_model"),
    ({"speculative": "ngram", "draft_min": 4, "draft_max": 2}, BadRequest, "draft_min"),
    ({"speculative": "ngram", "draft_ngram": 3, "draft_max": 2}, BadRequest, "draft_ngram"),
])
def test_refusals_name_the_setting(lib: Library, kw: dict[str, object], error: type[Exception],
                                   param: str) -> None:
    with pytest.raises(error) as caught:
        plan_speculative(lib.entries["target"], settings(**kw), lib)
    assert isinstance(caught.value, BadRequest | ModelNotFound) and caught.value.param == param


def test_the_draft_counts_in_the_memory_fit(lib: Library) -> None:
    target = lib.entries["target"]
    plan = plan_speculative(target, settings(speculative="draft", draft_model="draft"), lib)
    extra = draft_bytes(target, plan, n_ctx=1024, slots=2)
    assert extra > lib.entries["draft"].size_bytes
    s = settings(n_ctx=1024)

    def fit(free: int, with_draft: bool) -> int:
        decision = plan_load(target, s, explicit_ctx=True, target_ctx=1024, min_ctx=256, free_bytes=free,
                             memory_kind="ram", slots=2, draft=plan if with_draft else None)
        assert decision is not None
        return decision.needed_bytes

    alone = fit(1 << 40, False)
    # Just enough for the model alone is too little with its draft beside it.
    fit(alone, False)
    with pytest.raises(DoesNotFit):
        fit(alone, True)
    assert fit(alone + extra, True) >= alone


def test_mtp_layers_count_in_the_memory_fit(tmp_path: Path, lib: Library) -> None:
    target = entry_of(write_tiny_mtp(tmp_path / "mtp.gguf"))
    plan = plan_speculative(target, settings(speculative="auto"), lib)
    assert plan.options.mode == "mtp" and plan.draft is None
    # The NextN layer's KV cache, which the model's own estimate leaves out, and its context's buffer.
    assert draft_bytes(target, plan, n_ctx=1024, slots=1) > 0
    ngram = plan_speculative(target, settings(speculative="ngram"), lib)
    assert draft_bytes(target, ngram, n_ctx=1024, slots=1) == 0


def test_token_texts_are_compared_in_long_vocabularies(tmp_path: Path) -> None:
    # More tokens than the header reader decodes; one text differs, nothing else.
    target = write_tiny_gguf(tmp_path / "t.gguf", n_layer=1, extra_tokens=9000)
    same = write_tiny_gguf(tmp_path / "s.gguf", n_layer=1, seed=5, extra_tokens=9000)
    other = tmp_path / "o.gguf"
    other.write_bytes(same.read_bytes().replace("▁w8999".encode(), "▁x8999".encode(), 1))
    assert vocab_difference(target, same) is None
    why = vocab_difference(target, other)
    assert why is not None and "x8999" in why
