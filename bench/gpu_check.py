"""GPU check: a finetune job on CUDA through the job runner, and (where the
engine's GPU build is installed) a model served on the GPU.

Reports, as one JSON object and a few lines of text:
- the GPUs (nvidia-smi), torch's CUDA, the engine build's GPU devices;
- finetune: the device the lease gave the job, the job's CUDA_VISIBLE_DEVICES
  (read from the running process), its peak VRAM (nvidia-smi, per process)
  against a rough estimate, training tokens/s;
- serving: the placement shown in /api/models, the VRAM the worker took
  (free memory before and after the load) against the memory fit's
  estimate, and tokens/s at 1, 4 and 16 concurrent streams.

``--cpu-dry-run`` runs the same steps on the CPU (the lease's ``cpu``
device), so the script is exercised where there is no GPU. Run by
bench/gpu_check.sh; in the repository: ``python -m bench.gpu_check --cpu-dry-run``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import psutil

from jobs.kinds import validate_params
from jobs.params import ResolveContext, Roots
from supervisor.db import Database
from supervisor.lab.gpu_setup import build_lease
from supervisor.lab.runner import JobRunner, RunnerSettings
from supervisor.lab.store import JOBS_MIGRATIONS, JobStore
from supervisor.models.demo import write_tiny_gguf
from supervisor.models.devices import DeviceReadError, SmiSource

MIB = 1 << 20
_LISTEN = re.compile(r"gpuvisor listening on http://[^:]+:(\d+)")


def _tiny_hf() -> ModuleType:
    """The tiny-model builder: beside this file in the bundle, in tests/ in the repository."""
    here = Path(__file__).resolve().parent
    for path in (here / "tiny_hf.py", here.parent / "tests" / "tiny_hf.py"):
        if path.is_file():
            spec = importlib.util.spec_from_file_location("gpu_check_tiny_hf", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise SystemExit("tiny_hf.py not found beside gpu_check.py (build the bundle with make gpu-check-bundle)")


def gpus() -> list[dict[str, Any]]:
    try:
        return [{"index": r.index, "name": r.name, "free_mib": r.free_bytes // MIB,
                 "total_mib": r.total_bytes // MIB} for r in SmiSource().read()]
    except DeviceReadError as exc:
        return [{"error": str(exc)}]


def process_vram_mib() -> dict[int, int]:
    """MiB each process uses on the GPUs (nvidia-smi's compute apps); {} without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used: dict[int, int] = {}
    for line in out.splitlines():
        pid, _, mem = line.partition(",")
        if pid.strip().isdigit() and mem.strip().isdigit():
            used[int(pid)] = used.get(int(pid), 0) + int(mem)
    return used


def engine_gpus() -> list[str]:
    done = subprocess.run([sys.executable, "-m", "worker.probe"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return []
    return [str(g) for g in json.loads(done.stdout)["gpu_devices"]]


def finetune_estimate_mib(hidden: int, layers: int, vocab: int, batch: int, seq: int, bytes_per: int) -> int:
    """A rough VRAM estimate of the finetune: weights, LoRA (r=16, q/k/v/o) with
    grads and Adam states, activations kept for backward, and the CUDA context."""
    weights = (layers * (4 * hidden * hidden + 3 * hidden * 4 * hidden) + 2 * vocab * hidden) * bytes_per
    lora = layers * 4 * 2 * 16 * hidden * (4 + 4 + 8)
    activations = batch * seq * layers * hidden * 34 * bytes_per + batch * seq * vocab * 4 * 2
    return (weights + lora + activations) // MIB + 500


async def finetune_check(work: Path, cpu: bool, steps: int, hidden: int, layers: int) -> dict[str, Any]:
    roots = Roots(work / "models", work / "datasets", work / "outputs")
    for d in roots.all():
        d.mkdir(parents=True, exist_ok=True)
    tiny = _tiny_hf()
    tiny.build_tiny_model(roots.models / "check-hf", hidden_size=hidden, intermediate_size=4 * hidden,
                          num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                          num_key_value_heads=max(1, hidden // 64), max_position_embeddings=1024)
    tiny.write_chat_dataset(roots.datasets / "check.jsonl", repeats=64)
    lease = await build_lease(["cpu"] if cpu else ())
    db = Database(work / "state" / "jobs.db", JOBS_MIGRATIONS)
    (work / "state").mkdir(exist_ok=True)
    await db.open()
    store = JobStore(db)
    runner = JobRunner(store, lease, RunnerSettings(state_dir=work / "state", roots=roots, python=sys.executable))
    await runner.start()
    try:
        batch, seq = 8, 256
        params = validate_params("finetune", {
            "model": "check-hf", "train": "check.jsonl", "max_steps": steps, "batch_size": batch,
            "gradient_accumulation_steps": 1, "max_seq_len": seq, "save_steps": 100_000, "merge": False,
        }, ResolveContext(roots))
        job, _ = await runner.submit("finetune", params)
        seen: dict[str, Any] = {"peak_vram_mib": 0}
        while not (current := await store.get(job.id)).finished:
            _watch(current.pid, lease.snapshot(), seen)
            await asyncio.sleep(0.2)
    finally:
        await runner.stop()
        await db.close()
    if current.status != "succeeded" or current.result is None:
        raise SystemExit(f"finetune job {current.status}: {current.error}")
    vocab = json.loads((roots.models / "check-hf" / "config.json").read_text())["vocab_size"]
    estimate = finetune_estimate_mib(hidden, layers, vocab, batch, seq, 2 if not cpu else 4)
    return {"devices": seen.get("devices"), "cuda_visible_devices": seen.get("cuda_visible_devices"),
            "peak_vram_mib": seen["peak_vram_mib"], "estimate_vram_mib": None if cpu else estimate,
            "tokens_per_s": current.result["tokens_per_s"], "steps": current.result["steps"]}


def _watch(pid: int | None, lease_state: dict[str, Any], seen: dict[str, Any]) -> None:
    held = [d["id"] for d in lease_state["devices"] if d["holder"] is not None]
    if held:
        seen["devices"] = held
    if pid is None:
        return
    try:
        group = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        seen.setdefault("cuda_visible_devices", group[0].environ().get("CUDA_VISIBLE_DEVICES", "<unset>"))
    except psutil.Error:
        return  # it just ended
    used = process_vram_mib()
    seen["peak_vram_mib"] = max(seen["peak_vram_mib"], sum(used.get(p.pid, 0) for p in group))


def start_server(work: Path, streams: int) -> tuple[subprocess.Popen[bytes], str]:
    log_path = work / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUVISOR_")}
    env.update(GPUVISOR_PARALLEL=str(streams), GPUVISOR_N_CTX="1024", GPUVISOR_WRITE_DEMO_MODEL="false",
               GPUVISOR_QUEUE_LIMIT="256")
    with log_path.open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "supervisor", "serve", "--host", "127.0.0.1",
                                 "--port", "0", "--state-dir", str(work / "srv"), "--models-dir",
                                 str(work / "gguf")], stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = _LISTEN.search(log_path.read_text(errors="replace"))
        if found:
            return proc, f"http://127.0.0.1:{found.group(1)}"
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the server did not start:\n{log_path.read_text(errors='replace')[-3000:]}")


async def _stream_tokens(http: aiohttp.ClientSession, base: str, max_tokens: int) -> int:
    body = {"model": "check", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise SystemExit(f"chat failed ({resp.status}): {data}")
        return int(data["usage"]["completion_tokens"])


async def serve_check(work: Path, model: Path | None, max_tokens: int) -> dict[str, Any]:
    (work / "gguf").mkdir(parents=True, exist_ok=True)
    target = work / "gguf" / "check.gguf"
    if model is not None:
        target.symlink_to(model.resolve())
    else:
        write_tiny_gguf(target, n_embd=512, n_layer=8, n_head=8, n_head_kv=4, n_ff=1408, n_ctx=4096)
    before = SmiSource().read()
    proc, base = start_server(work, 16)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
            async with http.post(f"{base}/api/models/check/load", json={}) as resp:
                if resp.status >= 400:
                    raise SystemExit(f"load failed ({resp.status}): {await resp.text()}")
            shown = await _wait_ready(http, base)
            after = SmiSource().read()
            used = {r.index: (r.free_bytes - a.free_bytes) // MIB
                    for r in before for a in after if a.index == r.index}
            await _stream_tokens(http, base, 8)  # warm-up: the first request's setup is not measured
            rates = {}
            for n in (1, 4, 16):
                start = time.monotonic()
                tokens = await asyncio.gather(*(_stream_tokens(http, base, max_tokens) for _ in range(n)))
                rates[str(n)] = round(sum(tokens) / (time.monotonic() - start), 1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    fit = shown.get("fit") or {}
    worker = shown.get("worker") or {}
    return {"placement": worker.get("placement"), "vram_used_mib_per_gpu": used,
            "estimate_mib": (fit.get("needed_bytes") or 0) // MIB, "n_ctx": fit.get("n_ctx"),
            "tokens_per_s_by_streams": rates}


async def _wait_ready(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    for _ in range(1200):
        async with http.get(f"{base}/api/models/check") as resp:
            shown: dict[str, Any] = await resp.json()
        if shown.get("state") == "ready":
            return shown
        if shown.get("state") == "failed":
            raise SystemExit(f"the model failed to load: {shown.get('reason')}")
        await asyncio.sleep(0.25)
    raise SystemExit("the model did not become ready in 5 minutes")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    report: dict[str, Any] = {"gpus": gpus(), "torch_cuda": torch.cuda.is_available(),
                              "engine_gpus": engine_gpus(), "cpu_dry_run": args.cpu_dry_run}
    if not args.cpu_dry_run and not report["torch_cuda"]:
        raise SystemExit("torch sees no CUDA device: use --cpu-dry-run, or install a CUDA build of torch")
    with tempfile.TemporaryDirectory(prefix="gvcheck") as tmp:
        work = Path(tmp)
        report["finetune"] = await finetune_check(work / "ft", args.cpu_dry_run, args.steps, args.hidden, args.layers)
        if report["engine_gpus"] or args.cpu_dry_run:
            report["serving"] = await serve_check(work / "srv", args.model, args.max_tokens)
        else:
            report["serving"] = "skipped: the installed engine is its CPU build (no CUDA build at hand)"
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-dry-run", action="store_true", help="run every step on the CPU")
    ap.add_argument("--steps", type=int, default=30, help="finetune optimizer steps")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size of the finetuned tiny model")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--model", type=Path, help="a GGUF to serve instead of a generated tiny one")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per stream")
    ap.add_argument("--out", type=Path, help="also write the JSON report here")
    args = ap.parse_args()
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
