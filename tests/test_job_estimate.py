"""``POST /api/jobs/estimate``: a fine-tune's memory per device before submit,
on a simulated 2-GPU box (real loopback server, real SQLite, the real
lease) and on a machine without a GPU. The model is a config.json and a
safetensors file written here, so every expected number is worked out by
hand from its shapes."""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from jobs.params import Roots
from supervisor.api.jobs import JobSettings, add_routes
from supervisor.appkeys import CONFIG, JOB_SETTINGS, LEASE
from supervisor.config import Config
from supervisor.lab.lease import GpuLease, cpu_device
from supervisor.models.devices import GpuReading
from tests.jobsupport import make_roots
from tests.test_gpu_routes import gpu_lab
from tests.test_jobs_routes import render_errors

HIDDEN, INTER, LAYERS, VOCAB = 64, 128, 2, 320
PROJ = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, HIDDEN), "v_proj": (HIDDEN, HIDDEN),
        "o_proj": (HIDDEN, HIDDEN), "gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN),
        "down_proj": (HIDDEN, INTER)}


def shapes() -> dict[str, list[int]]:
    out = {"model.embed_tokens.weight": [VOCAB, HIDDEN], "model.norm.weight": [HIDDEN],
           "lm_head.weight": [VOCAB, HIDDEN]}
    for i in range(LAYERS):
        for name, shape in PROJ.items():
            group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out[f"model.layers.{i}.{group}.{name}.weight"] = list(shape)
        out[f"model.layers.{i}.input_layernorm.weight"] = [HIDDEN]
    return out


def write_model(path: Path) -> Path:
    """A Llama-shaped model's config.json and its one safetensors file (zeros)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "vocab_size": VOCAB}))
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes().items():
        n = 2 * _numel(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return path


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def expected(batch: int, seq: int, rank: int, checkpointing: bool, dtype_bytes: int, world: int) -> dict[str, int]:
    """The estimate by hand: see jobs/finetune_memory.py for what each term counts."""
    params = sum(_numel(s) for s in shapes().values())
    lora = LAYERS * sum(rank * (a + b) for a, b in PROJ.values())
    tokens = batch * seq
    per_layer = 10 * HIDDEN + 4 * INTER
    kept = LAYERS * HIDDEN + per_layer if checkpointing else LAYERS * per_layer
    out = {"weights_bytes": params * dtype_bytes, "adapter_bytes": lora * (20 if world > 1 else 16),
           "activations_bytes": tokens * (kept + 2 * HIDDEN) * dtype_bytes,
           "logits_bytes": tokens * VOCAB * (dtype_bytes + 12), "tokens_per_micro_batch": tokens}
    out["total_bytes"] = sum(v for k, v in out.items() if k != "tokens_per_micro_batch")
    return out


async def post(http: aiohttp.ClientSession, base: str, body: Any) -> tuple[int, Any]:
    async with http.post(f"{base}/api/jobs/estimate", json=body) as resp:
        return resp.status, await resp.json()


def finetune(**params: Any) -> dict[str, Any]:
    return {"kind": "finetune", "params": {"model": "tiny", **params}}


async def test_two_gpus_estimate_per_gpu_and_fit(tmp_path: Path) -> None:
    async with gpu_lab(tmp_path) as (runner, base), aiohttp.ClientSession() as http:
        write_model(tmp_path / "models" / "tiny")
        status, body = await post(http, base, finetune(gpus=2, batch_size=2, max_seq_len=256))
        assert status == 200, body
        assert body["world_size"] == 2 and body["dtype_bytes"] == 2
        assert body["estimate"] == expected(2, 256, 16, True, 2, world=2)
        gpus = {d["id"]: d for d in body["devices"]}
        assert set(gpus) == {"cuda:0", "cuda:1"}
        assert gpus["cuda:1"]["free_bytes"] == 9000 << 20 and gpus["cuda:1"]["total_bytes"] == 24576 << 20
        assert body["fits"] is True and all(d["fits"] for d in gpus.values())

        # A larger batch costs activations and logits, linearly; the weights stay.
        _, bigger = await post(http, base, finetune(gpus=2, batch_size=8, max_seq_len=256))
        assert bigger["estimate"] == expected(8, 256, 16, True, 2, world=2)
        assert bigger["estimate"]["activations_bytes"] == 4 * body["estimate"]["activations_bytes"]
        assert bigger["estimate"]["weights_bytes"] == body["estimate"]["weights_bytes"]

        # What checkpointing saves: the alternative is the estimate with it off.
        off = body["alternatives"]["gradient_checkpointing"]
        assert off["value"] is False
        _, unchecked = await post(http, base, finetune(gpus=2, batch_size=2, max_seq_len=256,
                                                       gradient_checkpointing=False))
        assert off["estimate"] == unchecked["estimate"] == expected(2, 256, 16, False, 2, world=2)
        assert off["estimate"]["activations_bytes"] > body["estimate"]["activations_bytes"]
        four_bit = body["alternatives"]["load_in_4bit"]
        assert four_bit["value"] is True
        assert four_bit["estimate"]["weights_bytes"] < body["estimate"]["weights_bytes"]

        # One GPU named: only it is set against the estimate, with no all-reduce buffer.
        _, one = await post(http, base, finetune(gpu_ids=["1"], lora_r=64, max_seq_len=256))
        assert [d["id"] for d in one["devices"]] == ["cuda:1"]
        assert one["estimate"] == expected(2, 256, 64, True, 2, world=1)

        # Far too big for 9000 MiB free: said per GPU, and overall.
        _, huge = await post(http, base, finetune(gpu_ids=["1"], batch_size=4096, max_seq_len=65536))
        assert huge["fits"] is False and huge["devices"][0]["fits"] is False
        assert "does not fit in the free memory of cuda:1" in huge["message"]

        # An estimate queues nothing.
        assert (await runner.store.list_jobs(status=[], kind=None, limit=10, cursor=None, owner=None)).jobs == []


async def test_bad_params_are_a_400_naming_the_field(tmp_path: Path) -> None:
    async with gpu_lab(tmp_path) as (_runner, base), aiohttp.ClientSession() as http:
        write_model(tmp_path / "models" / "tiny")
        cases: list[tuple[Any, str]] = [
            ({"kind": "quantize", "params": {"model": "x", "type": "Q4_0"}}, "kind"),
            (finetune(batch_size=0), "params.batch_size"),
            (finetune(no_such_field=1), "params.no_such_field"),
            (finetune(gpus=3), "params.gpus"),
            (finetune(gpu_ids=["cuda:7"]), "params.gpu_ids"),
            (finetune(train="missing.jsonl"), "params.train"),
            ({"kind": "finetune", "params": {"model": "../../etc"}}, "params.model"),
            ({"kind": "finetune", "params": {"model": "nothing-here"}}, "params.model"),
        ]
        for body, param in cases:
            status, answer = await post(http, base, body)
            assert status == 400, (body, answer)
            assert answer["error"]["param"] == param, (body, answer)
        status, answer = await post(http, base, [1, 2])
        assert status == 400 and answer["error"]["type"] == "invalid_request_error"


@asynccontextmanager
async def cpu_server(roots: Roots, state: Path) -> AsyncIterator[str]:
    app = web.Application(middlewares=[render_errors])
    app[CONFIG] = Config(state_dir=str(state))
    app[LEASE] = GpuLease([cpu_device()])
    app[JOB_SETTINGS] = JobSettings(roots)
    add_routes(app)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_without_a_gpu_ram_and_float32(tmp_path: Path) -> None:
    roots = make_roots(tmp_path)
    write_model(roots.models / "tiny")
    (roots.models / "no-weights").mkdir()
    (roots.models / "no-weights" / "config.json").write_text("{}")
    async with cpu_server(roots, tmp_path / "state") as base, aiohttp.ClientSession() as http:
        status, body = await post(http, base, finetune(max_seq_len=128))
        assert status == 200, body
        assert body["dtype"] == "float32" and body["estimate"] == expected(2, 128, 16, True, 4, world=1)
        (cpu,) = body["devices"]
        assert cpu["id"] == "cpu" and cpu["free_bytes"] > 0 and cpu["fits"] is True
        # The 4-bit base is CUDA only: the alternative says so.
        assert "needs a CUDA GPU" in body["alternatives"]["load_in_4bit"]["note"]
        status, refused = await post(http, base, finetune(load_in_4bit=True))
        assert status == 400 and refused["error"]["param"] == "params.load_in_4bit"

        status, none = await post(http, base, {"kind": "finetune", "params": {"model": "no-weights"}})
        assert status == 200 and none["estimate"] is None and none["fits"] is None
        assert "not in safetensors files" in none["reason"]

        # A damaged header (claims 2^40 bytes): said, in bounded time, not a 500.
        damaged = write_model(roots.models / "damaged")
        (damaged / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
        status, bad = await post(http, base, {"kind": "finetune", "params": {"model": "damaged"}})
        assert status == 200 and bad["estimate"] is None
        assert "cannot be read for an estimate" in bad["reason"] and "safetensors header" in bad["reason"]

        # A repo id not in the local Hub cache: no estimate yet, and why.
        status, repo = await post(http, base, {"kind": "finetune", "params": {"model": "acme/not-pulled"}})
        assert status == 200 and repo["estimate"] is None
        assert "not in the Hugging Face cache" in repo["reason"]


def _node_gpu(node: str, index: int, free_mib: int) -> GpuReading:
    return GpuReading(index=index, uuid=f"GPU-{node}-{index}", name="Sim", free_bytes=free_mib << 20,
                      total_bytes=24576 << 20, node=node)


async def test_a_nodes_devices_are_judged_by_that_nodes_readings(tmp_path: Path) -> None:
    async with gpu_lab(tmp_path) as (runner, base), aiohttp.ClientSession() as http:
        write_model(tmp_path / "models" / "tiny")
        # This machine's GPUs show 20000 and 9000 MiB free; node-b's the other way round and
        # with less, so a reading taken here by index would give other numbers.
        runner.lease.set_node("node-b", [_node_gpu("node-b", 0, 3000), _node_gpu("node-b", 1, 22000)])
        runner.lease.set_node("node-c", [], ram=(32768 << 20, 65536 << 20))

        status, named = await post(http, base, finetune(gpu_ids=["node-b/cuda:1"], max_seq_len=256))
        assert status == 200, named
        (gpu,) = named["devices"]
        assert gpu["id"] == "node-b/cuda:1" and gpu["free_bytes"] == 22000 << 20
        assert named["node"] == "node-b" and named["fits"] is True and named["dtype_bytes"] == 2

        # A count on a node: its GPUs, each with its own reading.
        status, count = await post(http, base, {**finetune(gpus=2, max_seq_len=256), "node": "node-b"})
        assert status == 200, count
        free = {d["id"]: d["free_bytes"] for d in count["devices"]}
        assert free == {"node-b/cuda:0": 3000 << 20, "node-b/cuda:1": 22000 << 20}
        assert count["world_size"] == 2 and count["node"] == "node-b"

        # Too big for node-b's 3000 MiB GPU (its headroom counted), not for its other one.
        big = {"batch_size": 128, "max_seq_len": 4096}
        need = expected(128, 4096, 16, True, 2, world=1)["total_bytes"] + (512 << 20)
        assert 3000 << 20 < need < 22000 << 20
        _, short = await post(http, base, {**finetune(gpus=1, **big), "node": "node-b"})
        assert short["devices"][0]["id"] == "node-b/cuda:0" and short["fits"] is False
        assert "does not fit in the free memory of node-b/cuda:0" in short["message"]
        _, roomy = await post(http, base, finetune(gpu_ids=["node-b/cuda:1"], **big))
        assert roomy["fits"] is True

        # A node without a GPU: its RAM, float32, and the 4-bit base refused as on a CPU.
        status, ram = await post(http, base, {**finetune(max_seq_len=128), "node": "node-c"})
        assert status == 200, ram
        (cpu,) = ram["devices"]
        assert cpu["id"] == "node-c/cpu" and cpu["free_bytes"] == 32768 << 20 and cpu["total_bytes"] == 65536 << 20
        assert ram["dtype"] == "float32" and ram["fits"] is True
        assert "needs a CUDA GPU" in ram["alternatives"]["load_in_4bit"]["note"]


async def test_an_unknown_node_or_one_too_small_is_a_400_naming_it(tmp_path: Path) -> None:
    async with gpu_lab(tmp_path) as (runner, base), aiohttp.ClientSession() as http:
        write_model(tmp_path / "models" / "tiny")
        runner.lease.set_node("node-b", [_node_gpu("node-b", 0, 3000)])
        status, answer = await post(http, base, {**finetune(), "node": "node-x"})
        assert status == 400, answer
        error = answer["error"]
        assert error["param"] == "node" and error["code"] == "node_not_found"
        assert "node-x" in error["message"] and "node-b" in error["message"]
        status, answer = await post(http, base, {**finetune(gpus=2), "node": "node-b"})
        assert status == 400 and answer["error"]["param"] == "params.gpus"
        assert "node node-b has 1" in answer["error"]["message"]
        status, answer = await post(http, base, {**finetune(gpu_ids=["cuda:0"]), "node": "node-b"})
        assert status == 400 and answer["error"]["param"] == "params.gpu_ids"
