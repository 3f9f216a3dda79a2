"""HF -> GGUF export of the families beyond Llama: each a tiny random model
of that architecture (transformers), exported, loaded by the engine, its
next-token distributions against HF's log-softmax on the same prompt.

Every family's config sets what its GGUF metadata must carry so that a
converter that dropped it would fail: a short sliding window (4 of a 10-token
prompt), softcapping, Granite's multipliers away from 1, partial rotary,
a head size apart from hidden / heads, experts routed top-2 of 4.
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

from jobs.context import JobError
from jobs.hf_convert import ARCHS, OutType, convert
from jobs.kinds import validate_params
from jobs.params import ResolveContext
from tests.jobsupport import running_lab, wait_finished
from tests.test_export import PROMPT_IDS, engine_logprobs, engine_run, log_softmax
from tests.tiny_hf import build_tiny_model, copy_model

pytestmark = pytest.mark.timeout(180)

_COMMON: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    # Larger than the usual 0.02, so logits differ enough to compare.
    "initializer_range": 0.2,
}
# family -> (config class, the family's own settings, GGUF architecture)
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "qwen3": ("Qwen3Config", {"head_dim": 32}, "qwen3"),
    "qwen3moe": ("Qwen3MoeConfig", {
        "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    }, "qwen3moe"),
    "gemma2": ("Gemma2Config", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4, "tie_word_embeddings": True,
        "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
    }, "gemma2"),
    "gemma3": ("Gemma3TextConfig", {
        # Six layers: five sliding (local rope), one global with linear rope scaling.
        "num_hidden_layers": 6, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 4,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    }, "gemma3"),
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5, "sliding_window": None}, "phi3"),
    "olmo2": ("Olmo2Config", {}, "olmo2"),
    "granite": ("GraniteConfig", {
        "embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
        "logits_scaling": 2.0,
    }, "granite"),
}


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # A Unix socket path must stay under ~100 bytes; tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="gv", dir="/tmp"))
    yield path
    shutil.rmtree(path)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' byte-level BPE tokenizer (with a Llama model we do not use)."""
    return build_tiny_model(tmp_path_factory.mktemp("tok") / "llama", "llama", "bpe")


def build_family(out: Path, family: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, out / f.name)
    base = json.loads((tokenizer_dir / "config.json").read_text())
    ids = {k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    cls_name, extra, _ = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**_COMMON, **ids, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    model.save_pretrained(out, safe_serialization=True)
    return out


def hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    # Eager attention: the reference for softcapping and sliding windows.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits: np.ndarray[Any, Any] = model(torch.tensor([ids])).logits[0].numpy()
    return logits


# Tolerances on log-probabilities, as in test_export: F32 to float32 rounding
# with room for SIMD paths; F16 to weights rounded to 11 significant bits.
# Gemma's GELU is a float16 lookup table in the engine's CPU kernels: gemma2
# came to 1.1e-3 and gemma3 to 2.3e-3 of HF (1.5e-5 and 8e-4 with HF's GELU
# rounded through float16 likewise), while a wrong global rope base moved
# gemma3 by 1.8e-2, its rope scaling dropped by 0.47, a sliding window one
# too wide by 3.5 and no softcapping (gemma2) by 0.38; 5e-3 is between.
_GELU_TOL = 5e-3
_F32_TOL = {f: _GELU_TOL if f.startswith("gemma") else 2e-4 for f in FAMILIES}


@pytest.mark.parametrize(("family", "outtype", "tol"), [
    *((f, "F32", _F32_TOL[f]) for f in FAMILIES), ("qwen3moe", "F16", 0.04), ("gemma3", "F16", 0.04),
])
def test_family_next_token_probs_match_hf(tokenizer_dir: Path, tmp_path: Path, sock_dir: Path,
                                          family: str, outtype: OutType, tol: float) -> None:
    src = build_family(tmp_path / family, family, tokenizer_dir)
    out = tmp_path / f"{family}.gguf"
    # Not the family's name: the engine takes a model named like Phi-3 for
    # Phi-3's own tokenizer and looks up tokens this one lacks.
    info = convert(src, out, outtype, "tiny")
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.architecture"].contents() == FAMILIES[family][2]
    logits = hf_logits(src, PROMPT_IDS)
    assert np.abs(logits).max() > 1.0, "logits that mean something"
    result = engine_run(out, sock_dir, PROMPT_IDS)
    assert result["n_vocab"] == logits.shape[-1]
    ref, got = log_softmax(logits), engine_logprobs(result, PROMPT_IDS)
    diff = float(np.abs(got - ref).max())
    assert diff < tol, f"{family} {outtype}: max |log-prob diff| {diff} ({info.tensors} tensors)"
    runner_up, best = np.sort(ref, axis=-1)[:, -2:].T
    decided = best - runner_up > 2 * tol
    assert decided.sum() >= len(PROMPT_IDS) // 2  # not a vacuous check
    assert (got.argmax(-1) == ref.argmax(-1))[decided].all(), f"{family} {outtype}: top-1 differs"


def test_experts_are_stacked_per_layer(tokenizer_dir: Path, tmp_path: Path) -> None:
    src = build_family(tmp_path / "moe", "qwen3moe", tokenizer_dir)
    convert(src, tmp_path / "moe.gguf", "F16", "moe")
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "moe.gguf")).tensors}
    # numpy order: (expert, out, in); the router stays F32 in an F16 file.
    assert tuple(tensors["blk.1.ffn_down_exps.weight"].data.shape) == (4, 64, 32)
    assert tuple(tensors["blk.0.ffn_gate_exps.weight"].data.shape) == (4, 32, 64)
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert not any(".experts." in name or "exps.0" in name for name in tensors)


def test_gemma_sentencepiece_vocab_has_no_space_prefix(tmp_path: Path) -> None:
    # Gemma's tokenizers put no space before the text; llama.cpp's
    # SentencePiece tokenizer does unless the GGUF says otherwise.
    spm = build_tiny_model(tmp_path / "spm", "mistral", "spm")
    src = build_family(tmp_path / "g2", "gemma2", spm)
    convert(src, tmp_path / "g2.gguf", "F16", "g2")
    fields = gguf.GGUFReader(str(tmp_path / "g2.gguf")).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is False
    convert(spm, tmp_path / "m.gguf", "F16", "m")
    assert "tokenizer.ggml.add_space_prefix" not in gguf.GGUFReader(str(tmp_path / "m.gguf")).fields


def _edit_config(model_dir: Path, **changes: Any) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(("family", "changes", "says"), [
    # llama.cpp fixes these for the architecture; a GGUF would silently differ.
    ("gemma2", {"query_pre_attn_scalar": 256}, "query_pre_attn_scalar 256"),
    ("gemma3", {"layer_types": ["full_attention"] * 6}, "layer_types"),
    ("gemma2", {"final_logit_softcapping": None}, "final_logit_softcapping is not set"),
    ("qwen3moe", {"norm_topk_prob": False}, "norm_topk_prob"),
    ("olmo2", {"hidden_act": "gelu"}, "activation 'gelu'"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
])
def test_what_the_engine_cannot_run_is_refused(tokenizer_dir: Path, tmp_path: Path, family: str,
                                               changes: dict[str, Any], says: str) -> None:
    src = build_family(tmp_path / family, family, tokenizer_dir)
    _edit_config(src, **changes)
    with pytest.raises(JobError, match=says):
        convert(src, tmp_path / "x.gguf", "F32", "x")
    assert not (tmp_path / "x.gguf").exists()


def test_untied_head_is_refused_where_the_engine_ties_it(tokenizer_dir: Path, tmp_path: Path) -> None:
    src = build_family(tmp_path / "g2", "gemma2", tokenizer_dir)
    from safetensors.numpy import load_file, save_file

    weights = load_file(src / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] * 2
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(JobError, match="output head of its own"):
        convert(src, tmp_path / "x.gguf", "F32", "x")
    # The same head as the embeddings is the tied head: it exports.
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    assert convert(src, tmp_path / "y.gguf", "F32", "y").tensors > 0


async def test_export_job_names_an_unsupported_architecture(tokenizer_dir: Path, tmp_path: Path) -> None:
    async with running_lab(tmp_path) as lab:
        src = copy_model(tokenizer_dir, lab.roots.models, "gpt2ish")
        _edit_config(src, architectures=["GPT2LMHeadModel"], model_type="gpt2")
        params = validate_params("export", {"model": "gpt2ish"}, ResolveContext(lab.roots))
        job, _ = await lab.runner.submit("export", params)
        done = await wait_finished(lab.store, job.id, timeout=60)
        assert done.status == "failed"
        error = json.dumps(done.error)
        assert "GPT2LMHeadModel" in error
        for name in ARCHS:
            assert name in error, name
        assert sorted(p.name for p in lab.roots.models.iterdir()) == ["gpt2ish"]
