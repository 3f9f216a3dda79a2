"""HF -> GGUF export: the GGUF's next-token distributions in llama.cpp
against the HF model's (torch), and its tokenizer against HF's.

Each architecture is a tiny random model with a large init so logits differ
clearly; the GGUF is loaded by the engine (xllamacpp) in a subprocess (the
test process never loads llama.cpp next to torch).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

pytest.importorskip("transformers", reason="needs the train extra")

from jobs.context import JobError
from jobs.errors import ParamError
from jobs.hf_convert import OutType, convert
from jobs.kinds import validate_params
from jobs.params import ResolveContext
from tests.jobsupport import make_roots, running_lab, wait_finished
from tests.tiny_hf import build_tiny_model, copy_model

pytestmark = pytest.mark.timeout(180)
PROMPT_IDS = [5, 17, 42, 99, 7, 23, 11, 64, 150, 201]
# For each prefix ids[:k]: one generated token with the probabilities of the
# whole vocabulary (n_probs = n_vocab), taken before sampling, i.e. the
# softmax of the raw logits at position k-1. Then the text's tokens.
_ENGINE_SCRIPT = """
import json, sys
from pathlib import Path
import xllamacpp
from worker.unix_http import UnixJSONClient

path, sock_dir, ids, text = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
sock = sock_dir / "e.sock"
sock.unlink(missing_ok=True)
p = xllamacpp.CommonParams()
p.model.path = path
p.n_ctx, p.n_parallel, p.n_gpu_layers, p.warmup, p.fit_params = 256, 1, 0, False, False
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = 1
p.no_op_offload = True
# llama.cpp's defaults, an F16 KV cache and flash attention (F16 inside),
# round an F32 model's activations; without them an F32 GGUF matches torch
# to float32 precision, so the F32 check can be tight.
p.cache_type_k = p.cache_type_v = xllamacpp.ggml_type.GGML_TYPE_F32
p.flash_attn_type = xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
p.verbosity = 1
p.hostnames = [str(sock)]
server = xllamacpp.Server(p)
client = UnixJSONClient(sock)
n_vocab = client.request("GET", "/v1/models")["data"][0]["meta"]["n_vocab"]
# The engine drops a token's probabilities when its text is an incomplete
# UTF-8 sequence (a byte token), so the sampled token is forced to plain
# ASCII; the bias applies in sampling, after the probabilities are taken.
force = client.tokenize("a", False, False)[-1]
prefixes = []
for k in range(1, len(ids) + 1):
    out = server.handle_completions({
        "prompt": ids[:k], "max_tokens": 1, "temperature": 0, "cache_prompt": False,
        "n_probs": n_vocab, "post_sampling_probs": False, "logit_bias": [[force, 1e6]],
    })
    assert "error" not in out, out
    top = out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    prefixes.append({"prompt_tokens": out["usage"]["prompt_tokens"],
                     "top": [[t["id"], t["logprob"]] for t in top]})
tokens = client.tokenize(text, add_special=False, parse_special=True)
print(json.dumps({"n_vocab": n_vocab, "prefixes": prefixes, "tokens": tokens}))
"""


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # A Unix socket path must stay under ~100 bytes; tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="gv", dir="/tmp"))
    yield path
    shutil.rmtree(path)


def engine_run(path: Path, sock_dir: Path, ids: list[int], text: str = "") -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, str(path), str(sock_dir), json.dumps(ids), text],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout))


def engine_logprobs(result: dict[str, Any], ids: list[int]) -> np.ndarray[Any, Any]:
    """[position, token] log-probabilities from the engine's per-prefix lists."""
    n_vocab = int(result["n_vocab"])
    got = np.full((len(ids), n_vocab), np.nan)
    assert len(result["prefixes"]) == len(ids)
    for k, prefix in enumerate(result["prefixes"], start=1):
        # The id list was evaluated exactly as given: no BOS put in front.
        assert prefix["prompt_tokens"] == k
        top = prefix["top"]
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True), "top list not ordered by probability"
        assert sorted(i for i, _ in top) == list(range(n_vocab)), "not the whole vocabulary"
        for token, lp in top:
            got[k - 1, token] = lp
    return got


def log_softmax(logits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    out: np.ndarray[Any, Any] = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return out


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


# Tolerances on log-probabilities. F32: the engine reproduced torch to 1e-5
# here (float32 rounding), while a 10x wrong norm epsilon moved them by 1.2e-3
# and a wrong rope base by 0.8; 2e-4 is between, with room for other SIMD
# paths. F16: rounding the weights to 11 significant bits moved them by at
# most 0.013 for these models; 0.04 leaves 3x. |log p - log q| < tol bounds
# each probability to within a factor e**tol of torch's, however small.
@pytest.mark.parametrize(("arch", "outtype", "tol"), [
    ("llama", "F32", 2e-4), ("llama", "F16", 0.04), ("qwen2", "F32", 2e-4), ("mistral", "F32", 2e-4),
])
def test_gguf_next_token_probs_match_hf(models: dict[str, Path], tmp_path: Path, sock_dir: Path,
                                        arch: str, outtype: OutType, tol: float) -> None:
    src = models[arch]
    out = tmp_path / f"{arch}.gguf"
    info = convert(src, out, outtype, arch)
    assert info.tensors == (27 if arch == "qwen2" else 21)  # qwen2 adds q/k/v biases
    logits = hf_logits(src, PROMPT_IDS)
    assert np.abs(logits).max() > 2.0  # logits that mean something
    result = engine_run(out, sock_dir, PROMPT_IDS)
    assert result["n_vocab"] == logits.shape[-1]
    # Every token's probability after every prefix, the engine's against
    # softmax(HF logits) at the prefix's last position.
    ref, got = log_softmax(logits), engine_logprobs(result, PROMPT_IDS)
    diff = float(np.abs(got - ref).max())
    assert diff < tol, f"{arch} {outtype}: max |log-prob diff| {diff}"
    # The same most likely next token wherever HF's lead over its runner-up
    # is more than the tolerance can move (a smaller lead is a tie here).
    runner_up, best = np.sort(ref, axis=-1)[:, -2:].T
    decided = best - runner_up > 2 * tol
    assert decided.sum() >= len(PROMPT_IDS) // 2  # not a vacuous check
    assert (got.argmax(-1) == ref.argmax(-1))[decided].all(), f"{arch} {outtype}: top-1 differs"


def test_gguf_metadata_and_tokenizers(models: dict[str, Path], tmp_path: Path, sock_dir: Path) -> None:
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
        # The engine's /tokenize, as a worker serves it: no BOS, specials parsed.
        got = engine_run(out, sock_dir, [], text)["tokens"]
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
        with pytest.raises(ParamError) as exc:  # the output exists now
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
        with pytest.raises(ParamError) as exc:
            validate_params("export", raw, ctx)
        assert exc.value.param == param, raw
