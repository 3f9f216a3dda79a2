"""Our quantizer against llama.cpp's: same tensor types, same bytes.

The reference outputs were made once by llama.cpp's ``llama_model_quantize``
(see tests/fixtures/quantize/make_reference.py) and are stored as digests;
the inputs are regenerated here from their seeds.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

import jobs.quantize as jq
from jobs.context import JobStopped
from jobs.events import JobIO
from jobs.params import QuantizeParams
from jobs.quantize_rules import (
    MIXES,
    ModelFacts,
    Role,
    TensorSpec,
    fallback_type,
    is_quantizable,
    plan_types,
    role_of,
    use_more_bits,
)
from tests.quantize_ref import (
    Case,
    cases,
    generated_tokens,
    load_reference,
    sha256_file,
    tensor_digests,
    write_model,
)

Q = jq.Q
REFERENCE = load_reference()
CASES = cases(REFERENCE)


class _Inputs:
    """Regenerated reference inputs, and our outputs cached by (model, source, type)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._made: dict[tuple[str, str | None, str], Path] = {}

    def model(self, name: str) -> Path:
        path = self.directory / f"{name}.gguf"
        if not path.exists():
            info = REFERENCE["models"][name]
            write_model(self.directory, name, info["args"])
            if sha256_file(path) != info["sha256"]:
                pytest.fail(f"the regenerated input {name} differs from the one the reference was made "
                            "from (numpy or gguf changed?): rerun make_reference.py")
        return path

    def output(self, model: str, source: str | None, type_name: str) -> Path:
        key = (model, source, type_name)
        if key not in self._made:
            src = self.output(model, None, source) if source else self.model(model)
            dst = self.directory / f"{model}-{source or 'F32'}-{type_name}.gguf"
            quantize_file(src, dst, type_name)
            self._made[key] = dst
        return self._made[key]


def quantize_file(src: Path, dst: Path, type_name: str, job_io: JobIO | None = None, nthread: int = 2) -> None:
    params = QuantizeParams(model=str(src), type=type_name, allow_requantize=True,  # type: ignore[arg-type]
                            nthread=nthread)
    plan = jq.inspect_model(src, type_name)
    jq.quantize(job_io or _quiet_io(), src, dst, params, plan.estimate_bytes)


def _quiet_io() -> JobIO:
    return JobIO(stdin=io.BytesIO(), stdout=io.BytesIO())


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> _Inputs:
    return _Inputs(tmp_path_factory.mktemp("quantize_ref"))


def _diff(ours: list[list[str]], ref: list[list[str]]) -> list[str]:
    mine = {name: (t, h) for name, t, h in ours}
    out = []
    for name, t, h in ref:
        got = mine.get(name)
        if got is None:
            out.append(f"{name}: missing")
        elif got[0] != t:
            out.append(f"{name}: {got[0]}, llama.cpp {t}")
        elif got[1] != h:
            out.append(f"{name}: same type {t}, different bytes")
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_llama_cpp(case: Case, inputs: _Inputs) -> None:
    out = inputs.output(case.model, case.source, case.type)
    ours = tensor_digests(out)
    assert [t[0] for t in ours] == [t[0] for t in case.tensors], "tensor order differs"
    assert not _diff(ours, case.tensors)
    # Same KV pairs in the same order, same alignment: the whole file is identical.
    assert sha256_file(out) == case.file_sha256


@pytest.mark.parametrize("type_name", ["Q4_K_M", "Q8_0"])
def test_quantized_tiny_model_loads_and_generates(type_name: str, inputs: _Inputs) -> None:
    out = inputs.output("w256", None, type_name)
    assert generated_tokens(out) == 4


def test_row_chunking_and_threads_do_not_change_the_bytes(
    inputs: _Inputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slabs of 1000 values: every tensor is split, mostly mid-way through a
    # thread's share, which must not move a single byte.
    monkeypatch.setattr(jq, "_SLAB_VALUES", 1000)
    case = next(c for c in CASES if c.id == "w256-Q4_K_M")
    dst = tmp_path / "chunked.gguf"
    quantize_file(inputs.model("w256"), dst, "Q4_K_M", nthread=3)
    assert sha256_file(dst) == case.file_sha256


class _StopAfter(JobIO):
    """A JobIO whose stop request arrives after ``n`` progress events."""

    def __init__(self, n: int) -> None:
        super().__init__(stdin=io.BytesIO(), stdout=io.BytesIO())
        self.left = n
        self.events: list[dict[str, Any]] = []

    @property
    def stop_requested(self) -> bool:
        return self.left <= 0

    def progress(self, fraction: float, **extra: Any) -> None:
        self.events.append({"progress": fraction, **extra})
        self.left -= 1


def test_stop_is_honoured_inside_a_tensor(inputs: _Inputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jq, "_SLAB_VALUES", 4096)
    stopper = _StopAfter(3)
    with pytest.raises(JobStopped):
        quantize_file(inputs.model("w256"), tmp_path / "stopped.gguf", "Q8_0", job_io=stopper)
    assert len(stopper.events) == 3
    fractions = [e["progress"] for e in stopper.events]
    assert fractions == sorted(fractions) and 0 < fractions[-1] < 0.2


def test_progress_reaches_the_end_per_tensor(inputs: _Inputs, tmp_path: Path) -> None:
    watcher = _StopAfter(10**9)
    quantize_file(inputs.model("w64"), tmp_path / "w64.gguf", "Q8_0", job_io=watcher)
    fractions = [e["progress"] for e in watcher.events]
    assert len(fractions) == len(tensor_digests(tmp_path / "w64.gguf"))
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(0.99)


def test_plan_estimate_is_the_output_size(inputs: _Inputs) -> None:
    for type_name in ("Q4_K_M", "Q8_0", "F16"):
        plan = jq.inspect_model(inputs.model("w256"), type_name)
        size = inputs.output("w256", None, type_name).stat().st_size
        assert abs(plan.estimate_bytes - size) < 4096, type_name


# -- the rules on their own ------------------------------------------------

def test_fallbacks_follow_llama_cpp() -> None:
    assert fallback_type(Q.Q4_K, 256) == Q.Q4_K
    assert fallback_type(Q.Q4_K, 64) == Q.Q5_0
    assert fallback_type(Q.Q5_K, 64) == Q.Q5_1
    assert fallback_type(Q.Q6_K, 96) == Q.Q8_0
    assert fallback_type(Q.Q3_K, 64) == Q.Q4_0
    assert fallback_type(Q.Q8_0, 48) == Q.F16
    assert fallback_type(Q.Q4_K, 48) == Q.F16


def test_more_bits_layers() -> None:
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_what_is_never_quantized() -> None:
    assert not is_quantizable("blk.0.attn_norm.weight", (4096, 1), "llama")
    assert not is_quantizable("blk.0.ffn_gate_inp.weight", (4096, 8), "llama")
    assert not is_quantizable("position_embd.weight", (768, 512), "bert")
    assert not is_quantizable("blk.0.attn_q.bias", (4096, 4096), "llama")
    assert is_quantizable("blk.0.ffn_down_exps.weight", (1408, 2048, 64), "qwen2moe")
    assert role_of("blk.3.ffn_down_exps.weight") is Role.FFN_DOWN
    assert role_of("blk.3.attn_qkv.weight") is Role.ATTN_QKV


def test_tied_embeddings_get_the_output_type() -> None:
    facts = ModelFacts("llama", n_layer=1, n_head=8, n_head_kv=8)
    specs = [TensorSpec("token_embd.weight", (256, 1000), Q.F32),
             TensorSpec("blk.0.attn_v.weight", (256, 256), Q.F32)]
    plan = plan_types(specs, MIXES["Q4_0"], facts)
    assert plan == {"token_embd.weight": Q.Q6_K, "blk.0.attn_v.weight": Q.Q4_0}


def test_moe_and_70b_bumps() -> None:
    moe = ModelFacts("llama", n_layer=32, n_head=32, n_head_kv=8, n_expert=8)
    specs = [TensorSpec("blk.0.attn_v.weight", (4096, 1024), Q.F16),
             TensorSpec("blk.0.attn_k.weight", (4096, 1024), Q.F16),
             TensorSpec("blk.5.ffn_down_exps.weight", (14336, 4096, 8), Q.F16)]
    plan = plan_types(specs, MIXES["Q4_K_M"], moe)
    assert plan["blk.0.attn_v.weight"] == Q.Q8_0 and plan["blk.0.attn_k.weight"] == Q.Q8_0
    assert plan["blk.5.ffn_down_exps.weight"] == Q.Q4_K  # layer 5 of 32 gets no extra bits
    big = ModelFacts("llama", n_layer=80, n_head=64, n_head_kv=8)
    specs = [TensorSpec(f"blk.{i}.attn_v.weight", (8192, 1024), Q.F16) for i in range(80)]
    assert set(plan_types(specs, MIXES["Q4_K_S"], big).values()) == {Q.Q5_K}
