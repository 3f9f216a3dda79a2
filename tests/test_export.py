"""HF -> GGUF export: logits of the GGUF (llama.cpp) against the HF model (torch).

Each architecture is a tiny random model with a large init so logits differ
clearly; the GGUF is loaded by llama.cpp in a subprocess (the test process
never loads llama.cpp next to torch).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

pytest.importorskip("transformers", reason="needs the train extra")

from jobs.context import JobError
from jobs.hf_convert import OutType, convert
from jobs.params import ResolveContext, validate_params
from supervisor.errors import BadRequest
from tests.jobsupport import make_roots, running_lab, wait_finished
from tests.tiny_hf import build_tiny_model, copy_model

pytestmark = pytest.mark.timeout(180)
PROMPT_IDS = [5, 17, 42, 99, 7, 23, 11, 64, 150, 201]
_LLAMA_SCRIPT = """
import json, sys
import llama_cpp
path, ids, text = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = llama_cpp.Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False, n_threads=1)
llm.eval(ids)
tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
print(json.dumps({"logits": llm.scores[: len(ids)].tolist(), "tokens": tokens}))
"""


def llama_cpp_run(path: Path, ids: list[int], text: str = "") -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _LLAMA_SCRIPT, str(path), json.dumps(ids), text],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout))


def hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits: np.ndarray[Any, Any] = model(torch.tensor([ids])).logits[0].numpy()
    return logits


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hfx")
    return {
        "llama": build_tiny_model(base / "llama", "llama", "bpe"),
        "qwen2": build_tiny_model(base / "qwen2", "qwen2", "bpe", dtype="bfloat16"),
        "mistral": build_tiny_model(base / "mistral", "mistral", "spm"),
    }


@pytest.mark.parametrize(("arch", "outtype", "tol"), [
    ("llama", "F32", 0.03), ("llama", "F16", 0.06), ("qwen2", "F32", 0.03), ("mistral", "F32", 0.03),
])
def test_gguf_logits_match_hf(models: dict[str, Path], tmp_path: Path, arch: str,
                              outtype: OutType, tol: float) -> None:
    src = models[arch]
    out = tmp_path / f"{arch}.gguf"
    info = convert(src, out, outtype, arch)
    assert info.tensors == (27 if arch == "qwen2" else 21)  # qwen2 adds q/k/v biases
    ref = hf_logits(src, PROMPT_IDS)
    got = np.asarray(llama_cpp_run(out, PROMPT_IDS)["logits"])
    assert np.abs(ref).max() > 2.0  # logits that mean something
    diff = float(np.abs(got - ref).max())
    assert diff < tol, f"{arch} {outtype}: max |logit diff| {diff}"
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_gguf_metadata_and_tokenizers(models: dict[str, Path], tmp_path: Path) -> None:
    texts = {
        "llama": "<|im_start|>user\nWhat colour is the sky?<|im_end|>",
        # SentencePiece puts its space prefix before a leading special token,
        # llama.cpp does not: compare plain text (with byte fallback) there.
        "mistral": "What colour is the sky?\nZebra ñ!",
    }
    for arch, expect_model in (("llama", "gpt2"), ("mistral", "llama")):
        text = texts[arch]
        out = tmp_path / f"{arch}.gguf"
        convert(models[arch], out, "F16", arch)
        reader = gguf.GGUFReader(str(out))

        def value(key: str, reader: gguf.GGUFReader = reader) -> Any:
            return reader.fields[key].contents()

        assert value("tokenizer.ggml.model") == expect_model
        assert value("general.architecture") == "llama"
        assert value("llama.attention.head_count_kv") == 2
        assert "<|im_start|>" in value("tokenizer.chat_template")
        assert value("general.file_type") == int(gguf.LlamaFileType.MOSTLY_F16)
        got = llama_cpp_run(out, [1], text)["tokens"]
        assert got == _hf_tokens(models[arch], text, arch), arch
        cfg = json.loads((models[arch] / "config.json").read_text())
        assert value("tokenizer.ggml.eos_token_id") == cfg["eos_token_id"]
        assert value("tokenizer.ggml.bos_token_id") == cfg["bos_token_id"]


def _hf_tokens(model_dir: Path, text: str, arch: str) -> list[int]:
    if arch == "mistral":
        import sentencepiece as spm

        proc = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
        return list(proc.encode(text))
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids)


def test_unknown_architecture_is_refused_by_name(models: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "gpt2ish"
    copy_model(models["llama"], tmp_path, "gpt2ish")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(JobError, match="GPT2LMHeadModel"):
        convert(src, tmp_path / "x.gguf", "F16", "x")
    assert not (tmp_path / "x.gguf").exists()


async def test_export_job_quantizes_into_models_dir(models: dict[str, Path], tmp_path: Path) -> None:
    async with running_lab(tmp_path) as lab:
        copy_model(models["llama"], lab.roots.models, "tiny-hf")
        ctx = ResolveContext(lab.roots)
        params = validate_params("export", {"model": "tiny-hf", "quantize": "Q8_0"}, ctx)
        job, _ = await lab.runner.submit("export", params)
        done = await wait_finished(lab.store, job.id, timeout=120)
        assert done.status == "succeeded", done.error
        result = done.result or {}
        assert result["model"] == "tiny-hf-Q8_0"
        assert sorted(p.name for p in lab.roots.models.iterdir()) == ["tiny-hf", "tiny-hf-Q8_0.gguf"]
        reader = gguf.GGUFReader(str(lab.roots.models / "tiny-hf-Q8_0.gguf"))
        assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)
        assert result["converted"]["seconds"] >= 0 and result["quantized"]["type"] == "Q8_0"
        with pytest.raises(BadRequest) as exc:  # the output exists now
            validate_params("export", {"model": "tiny-hf", "quantize": "Q8_0"}, ctx)
        assert exc.value.param == "params.output_name" and exc.value.code == "output_exists"


def test_export_params_validation(tmp_path: Path) -> None:
    roots = make_roots(tmp_path)
    ctx = ResolveContext(roots)
    for raw, param in [
        ({"model": "nope"}, "params.model"),
        ({"model": "../../etc"}, "params.model"),
        ({"model": "x", "outtype": "Q4"}, "params.outtype"),
        ({"model": "x", "quantize": "Q9"}, "params.quantize"),
    ]:
        with pytest.raises(BadRequest) as exc:
            validate_params("export", raw, ctx)
        assert exc.value.param == param, raw
