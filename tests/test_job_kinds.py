"""The dataset and quantize kinds end to end, through the runner, with real
job processes; plus param validation in the parent."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jobs.errors import ParamError
from jobs.kinds import params_dict, validate_params
from jobs.params import DatasetParams, QuantizeParams, ResolveContext, Roots
from supervisor.models.demo import write_tiny_gguf
from tests.jobsupport import make_roots, running_lab, wait_finished
from tests.quantize_ref import generated_tokens

ROWS = [
    {"instruction": "Say hi", "output": "hi"},
    {"instruction": "Add", "input": "1+1", "output": "2"},
    {"instruction": "Say hi", "output": "hi"},  # exact duplicate
    "this is not an object",
    {"instruction": "No answer"},
    {"instruction": "Capital?", "output": "Paris", "system": "Be brief."},
    {"instruction": "Empty", "output": ""},
]


def _write_input(path: Path) -> None:
    lines = [json.dumps(r) for r in ROWS]
    lines.insert(4, "{broken json")
    path.write_text("\n".join(lines) + "\n")


async def test_dataset_job_end_to_end_with_bad_rows(tmp_path: Path) -> None:
    async with running_lab(tmp_path) as lab:
        _write_input(lab.roots.datasets / "raw.jsonl")
        model = write_tiny_gguf(lab.roots.models / "tiny.gguf")
        ctx = ResolveContext(lab.roots)
        params = validate_params(
            "dataset", {"input": "raw.jsonl", "eval_ratio": 0.34, "seed": 7, "model": "tiny"}, ctx
        )
        assert isinstance(params, DatasetParams) and params.model == str(model.resolve())
        job, _ = await lab.runner.submit("dataset", params)
        done = await wait_finished(lab.store, job.id)
        assert done.status == "succeeded", done.error
        r = done.result
        assert r is not None
        assert r["format"] == "alpaca"
        assert r["rows"]["read"] == 8 and r["rows"]["bad"] == 4
        assert r["rows"]["duplicates"] == 1 and r["rows"]["kept"] == 3
        assert r["rows"]["train"] + r["rows"]["eval"] == 3 and r["rows"]["eval"] == 1
        assert [b["line"] for b in r["bad_rows"]] == [4, 5, 6, 8]
        assert "invalid JSON" in r["bad_rows"][1]["error"]
        assert r["stats"]["roles"] == {"user": 3, "assistant": 3, "system": 1}
        assert r["stats"]["tokens"]["total"] > 0 and r["stats"]["chars"]["max"] > 0
        train = [json.loads(x) for x in Path(r["train_path"]).read_text().splitlines()]
        assert len(train) == 2 and all(m["role"] for row in train for m in row["messages"])
        assert Path(r["eval_path"]).parent == lab.roots.datasets


@pytest.mark.parametrize(
    ("name", "content", "fmt", "kept"),
    [
        ("a.csv", "instruction,input,output\nhi,,hello\nq,x,\n", "alpaca", 1),
        ("b.json", json.dumps([{"conversations": [{"from": "human", "value": "hi"},
                                                  {"from": "gpt", "value": "yo"}]}]), "sharegpt", 1),
        ("c.txt", "line one\n\nline two\n", "text", 2),
        ("d.jsonl", json.dumps({"messages": [{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "b"}]}) + "\n"
         + json.dumps({"messages": [{"role": "bogus", "content": "a"}]}) + "\n", "messages", 1),
    ],
)
def test_dataset_formats(tmp_path: Path, name: str, content: str, fmt: str, kept: int) -> None:
    roots = make_roots(tmp_path)
    (roots.datasets / name).write_text(content)
    params = validate_params("dataset", {"input": name, "eval_ratio": 0.0}, ResolveContext(roots))
    events = run_job_process("dataset", params_dict(params), roots)
    assert events[-1]["type"] == "done", events[-3:]
    result = events[-1]["data"]["result"]
    assert result["format"] == fmt and result["rows"]["kept"] == kept


def test_dataset_from_parquet_in_batches(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    roots = make_roots(tmp_path)
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(2500)] + [{"instruction": "no answer"}]
    # Small row groups: the job reads the file batch by batch across them.
    pq.write_table(pa.Table.from_pylist(rows), roots.datasets / "p.parquet", row_group_size=1000)
    params = validate_params("dataset", {"input": "p.parquet", "eval_ratio": 0.0}, ResolveContext(roots))
    events = run_job_process("dataset", params_dict(params), roots)
    assert events[-1]["type"] == "done", events[-3:]
    result = events[-1]["data"]["result"]
    assert result["format"] == "alpaca" and result["rows"]["kept"] == 2500
    assert result["bad_rows"][0]["item"] == 2501
    first = json.loads(Path(result["train_path"]).read_text().splitlines()[0])
    assert [m["role"] for m in first["messages"]] == ["user", "assistant"]


def test_params_validation_and_roots(tmp_path: Path) -> None:
    roots = make_roots(tmp_path / "r")
    ctx = ResolveContext(roots)
    (roots.datasets / "x.jsonl").write_text("{}\n")
    outside = tmp_path / "secret.jsonl"
    outside.write_text("{}\n")
    with pytest.raises(ParamError) as e:
        validate_params("dataset", {"input": str(outside)}, ctx)
    assert e.value.param == "params.input"
    with pytest.raises(ParamError) as e:
        validate_params("dataset", {"input": "../secret.jsonl"}, ctx)
    assert e.value.param == "params.input"
    with pytest.raises(ParamError) as e:
        validate_params("dataset", {"input": "x.jsonl", "eval_ratio": 2}, ctx)
    assert e.value.param == "params.eval_ratio"
    with pytest.raises(ParamError) as e:
        validate_params("dataset", {"input": "x.jsonl", "bogus": 1}, ctx)
    assert e.value.param == "params.bogus"
    with pytest.raises(ParamError) as e:
        validate_params("dataset", {"input": "x.jsonl", "output_name": "../evil"}, ctx)
    assert e.value.param == "params.output_name"
    with pytest.raises(ParamError) as e:
        validate_params("nope", {}, ctx)
    assert e.value.param == "kind"
    with pytest.raises(ParamError) as e:
        validate_params("quantize", {"model": "missing", "type": "Q8_0"}, ctx)
    assert e.value.param == "params.model"
    with pytest.raises(ParamError) as e:
        validate_params("quantize", {"model": "x", "type": "Q9"}, ctx)
    assert e.value.param == "params.type"


def test_dataset_memory_stays_flat_as_the_input_grows(tmp_path: Path) -> None:
    roots = make_roots(tmp_path)
    sizes = {"small.jsonl": 1000, "large.jsonl": 21000}
    for name, rows in sizes.items():
        with (roots.datasets / name).open("w") as f:
            for i in range(rows):
                f.write(json.dumps({"instruction": f"question {i} " + "q" * 1500,
                                    "output": f"answer {i} " + "a" * 1500}) + "\n")
    peaks = {}
    for name, rows in sizes.items():
        params = validate_params("dataset", {"input": name, "eval_ratio": 0.1, "seed": 3}, ResolveContext(roots))
        events, peaks[name] = run_job_measured("dataset", params_dict(params), roots)
        assert events[-1]["type"] == "done", events[-3:]
        result = events[-1]["data"]["result"]
        assert result["rows"]["kept"] == rows
        written = [Path(result[k]).read_bytes().count(b"\n") for k in ("train_path", "eval_path")]
        assert sum(written) == rows and written[1] == round(rows * 0.1)
    assert sorted(p.name for p in roots.datasets.iterdir() if p.name.startswith(".")) == [], "no spill file left"
    # 60 MB more input: with every row held in memory the job grew by more than that.
    grown = peaks["large.jsonl"] - peaks["small.jsonl"]
    more_input = (roots.datasets / "large.jsonl").stat().st_size - (roots.datasets / "small.jsonl").stat().st_size
    assert grown < more_input * 0.25, f"peak RSS grew {grown >> 20} MiB for {more_input >> 20} MiB more input"


def run_job_process(kind: str, params: dict[str, object], roots: Roots) -> list[dict[str, Any]]:
    """Run ``python -m jobs <kind>`` directly, holding stdin open like the runner."""
    return run_job_measured(kind, params, roots)[0]


def run_job_measured(kind: str, params: dict[str, object], roots: Roots) -> tuple[list[dict[str, Any]], int]:
    """``run_job_process``, and the job's peak RSS in bytes."""
    ctx = {"job_id": "job_t", "models_dir": str(roots.models),
           "datasets_dir": str(roots.datasets), "outputs_dir": str(roots.outputs)}
    proc = subprocess.Popen([sys.executable, "-m", "jobs", kind], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"params": params, "context": ctx}).encode() + b"\n")
    proc.stdin.flush()
    events = []
    for line in proc.stdout:
        if line.strip():
            events.append(json.loads(line))
            if events[-1]["type"] in ("done", "failed"):
                break
    proc.stdin.close()
    # wait4 reports this one child's own peak RSS (KiB on Linux).
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return events, usage.ru_maxrss * 1024


async def test_quantize_job_output_loads_and_generates(tmp_path: Path) -> None:
    async with running_lab(tmp_path) as lab:
        write_tiny_gguf(lab.roots.models / "tiny.gguf")
        ctx = ResolveContext(lab.roots)
        params = validate_params("quantize", {"model": "tiny", "type": "Q8_0"}, ctx)
        assert isinstance(params, QuantizeParams) and params.output_name == "tiny-Q8_0.gguf"
        job, _ = await lab.runner.submit("quantize", params)
        done = await wait_finished(lab.store, job.id, timeout=60)
        assert done.status == "succeeded", done.error
        assert done.result is not None
        out = Path(done.result["output_path"])
        assert out == lab.roots.models / "tiny-Q8_0.gguf" and done.result["bytes"] == out.stat().st_size
        assert out.stat().st_size < (lab.roots.models / "tiny.gguf").stat().st_size
        assert not list(lab.roots.models.glob(".*partial"))
        assert await asyncio.to_thread(generated_tokens, out) > 0

        # Already quantized: refused unless allow_requantize.
        again = validate_params("quantize", {"model": "tiny-Q8_0", "type": "Q4_0"}, ctx)
        job2, _ = await lab.runner.submit("quantize", again)
        done2 = await wait_finished(lab.store, job2.id, timeout=60)
        assert done2.status == "failed" and "already quantized" in (done2.error or "")


async def test_quantize_refusals(tmp_path: Path) -> None:
    async with running_lab(tmp_path) as lab:
        write_tiny_gguf(lab.roots.models / "tiny.gguf")  # n_embd=64: too small for K blocks
        (lab.roots.models / "fake.gguf").write_bytes(b"NOPE" + b"\0" * 100)
        ctx = ResolveContext(lab.roots)
        for raw, needle in [
            ({"model": "tiny", "type": "Q4_K_M"}, "multiple of 256"),
            ({"model": "fake.gguf", "type": "Q8_0"}, "not a GGUF file"),
        ]:
            job, _ = await lab.runner.submit("quantize", validate_params("quantize", raw, ctx))
            done = await wait_finished(lab.store, job.id, timeout=60)
            assert done.status == "failed" and needle in (done.error or ""), done.error
        assert not list(lab.roots.models.glob("*Q4_K_M*"))
