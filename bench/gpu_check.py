"""GPU check: a finetune job on CUDA through the job runner, and (where the
engine's GPU build is installed) a model served on the GPU.

Reports, as one JSON object and a few lines of text:
- the GPUs (nvidia-smi), torch's CUDA, the engine build's GPU devices;
- finetune: on every GPU of the machine (``--ft-gpus``; data-parallel, one
  rank per GPU, when there are two or more; with one GPU it runs on that
  one and says so): the devices the lease gave the job, the job's
  CUDA_VISIBLE_DEVICES (read from the running process), each GPU's peak
  memory use while it ran (nvidia-smi's memory.used, per GPU) and its
  processes' peak VRAM, each rank's torch.cuda.max_memory_allocated against
  the job's own estimate, training tokens/s;
- serving (``serving``, a GGUF on llama.cpp): the placement shown in
  /api/models, the VRAM the worker took (free memory before and after the
  load) against the memory fit's estimate, and tokens/s at 1, 4 and 16
  concurrent streams;
- serving on vLLM (``serving_vllm``, a tiny random Hugging Face model of the
  same shape, where a Python with vLLM is at hand: ``--vllm-python``): the
  same readings at 1, 16 and 64 concurrent streams, the worker given 64
  sequences and the exact KV budget our fit sizes (never vLLM's 90 % of the
  GPU), and that budget next to the KV cache vLLM reports in its log.

``--cpu-dry-run`` runs the same steps on the CPU, so the script is
exercised where there is no GPU: the fine-tune books ``--ft-gpus`` (default
2) configured devices that this torch cannot use, so it runs that many CPU
ranks over gloo. Run by
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
from supervisor.config import default_vllm_python
from supervisor.db import Database
from supervisor.lab.gpu_setup import build_lease
from supervisor.lab.runner import JobRunner, RunnerSettings
from supervisor.lab.store import JOBS_MIGRATIONS, JobStore
from supervisor.models.demo import write_tiny_gguf
from supervisor.models.devices import DeviceReadError, SmiSource

MIB = 1 << 20
_LISTEN = re.compile(r"gpuvisor listening on http://[^:]+:(\d+)")
# vLLM's own figure for the KV budget it was given ("GPU KV cache size: N tokens"; "CPU ..." on the CPU build).
_VLLM_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


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


def gpu_used_mib() -> dict[int, int]:
    """MiB in use on each GPU now (nvidia-smi's memory.used); {} without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used: dict[int, int] = {}
    for line in out.splitlines():
        index, _, mem = line.partition(",")
        if index.strip().isdigit() and mem.strip().isdigit():
            used[int(index)] = int(mem)
    return used


def _ft_devices(cpu: bool, want: int) -> tuple[list[str], str]:
    """The lease's devices for the fine-tune, and what the check says of them."""
    if cpu:
        n = want or 2
        return [f"cuda:{i}" for i in range(n)], f"CPU dry run: {n} simulated devices, {n} CPU ranks over gloo"
    found = [g for g in gpus() if "index" in g]
    n = min(want or len(found), len(found))
    if n >= 2:
        return [], f"{len(found)} GPUs: the fine-tune runs data-parallel on {n} of them, one rank per GPU"
    return [], "one GPU: the fine-tune runs on one (data-parallel needs two or more)"


async def finetune_check(work: Path, cpu: bool, steps: int, hidden: int, layers: int,
                         want_gpus: int) -> dict[str, Any]:
    roots = Roots(work / "models", work / "datasets", work / "outputs")
    for d in roots.all():
        d.mkdir(parents=True, exist_ok=True)
    tiny = _tiny_hf()
    tiny.build_tiny_model(roots.models / "check-hf", hidden_size=hidden, intermediate_size=4 * hidden,
                          num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                          num_key_value_heads=max(1, hidden // 64), max_position_embeddings=1024)
    tiny.write_chat_dataset(roots.datasets / "check.jsonl", repeats=64)
    configured, note = _ft_devices(cpu, want_gpus)
    print(note, file=sys.stderr)
    lease = await build_lease(configured)
    n_gpus = want_gpus or len(lease.devices)
    if not 1 <= n_gpus <= len(lease.devices):
        raise SystemExit(f"--ft-gpus {want_gpus}: the lease has {len(lease.devices)} devices")
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
            "gpus": n_gpus,
        }, ResolveContext(roots))
        job, _ = await runner.submit("finetune", params)
        seen: dict[str, Any] = {"peak_vram_mib": 0, "gpu_peak_used_mib": {}, "gpu_idle_used_mib": gpu_used_mib()}
        while not (current := await store.get(job.id)).finished:
            _watch(current.pid, lease.snapshot(), seen)
            await asyncio.sleep(0.2)
    finally:
        await runner.stop()
        await db.close()
    if current.status != "succeeded" or current.result is None:
        raise SystemExit(f"finetune job {current.status}: {current.error}")
    result = current.result
    ranks = result.get("ranks") or [{"rank": 0, "memory": result["memory"]}]
    per_rank = [{"rank": r["rank"], "device": r["memory"]["device"],
                 "peak_mib": r["memory"]["peak_bytes"] // MIB, "measured_by": r["memory"]["measured_by"],
                 "estimate_mib": (r["memory"]["estimate_bytes"] or 0) // MIB,
                 "before_load_mib": r["memory"]["before_load_bytes"] // MIB,
                 "samples": r.get("samples")} for r in ranks]
    return {"note": note, "world_size": result.get("world_size", 1), "devices": seen.get("devices"),
            "cuda_visible_devices": seen.get("cuda_visible_devices"),
            "gpu_idle_used_mib": seen["gpu_idle_used_mib"], "gpu_peak_used_mib": seen["gpu_peak_used_mib"],
            "peak_vram_mib": seen["peak_vram_mib"], "ranks": per_rank,
            "tokens_per_s": result["tokens_per_s"], "steps": result["steps"]}


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
    peaks = seen["gpu_peak_used_mib"]
    for index, mib in gpu_used_mib().items():
        peaks[index] = max(peaks.get(index, 0), mib)


def start_server(work: Path, streams: int, models_dir: Path,
                 extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    log_path = work / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUVISOR_")}
    env.update(GPUVISOR_PARALLEL=str(streams), GPUVISOR_N_CTX="1024", GPUVISOR_WRITE_DEMO_MODEL="false",
               GPUVISOR_QUEUE_LIMIT="256", **(extra_env or {}))
    with log_path.open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "supervisor", "serve", "--host", "127.0.0.1",
                                 "--port", "0", "--state-dir", str(work / "srv"), "--models-dir",
                                 str(models_dir)], stdout=log, stderr=subprocess.STDOUT, env=env,
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
    """A GGUF on llama.cpp at 1, 4 and 16 streams."""
    (work / "gguf").mkdir(parents=True, exist_ok=True)
    target = work / "gguf" / "check.gguf"
    if model is not None:
        target.symlink_to(model.resolve())
    else:
        write_tiny_gguf(target, n_embd=512, n_layer=8, n_head=8, n_head_kv=4, n_ff=1408, n_ctx=4096)
    return await _serve_and_measure(work, work / "gguf", {}, (1, 4, 16), max_tokens)


# The vLLM kind's streams: one, a GPU's usual batch, and a full one.
VLLM_STREAMS = (1, 16, 64)


async def vllm_serve_check(work: Path, vllm_python: str, max_tokens: int, cpu: bool) -> dict[str, Any]:
    """A tiny random Hugging Face model of the GGUF check model's shape (head
    dim 64, which vLLM's CPU attention also takes) on vLLM at 1, 16 and 64
    streams; on a CPU dry run the small test shape."""
    models = work / "hf"
    shape = {} if cpu else {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
                            "num_attention_heads": 8, "num_key_value_heads": 4}
    _tiny_hf().build_vllm_model(models / "check", max_position_embeddings=4096, **shape)
    out = await _serve_and_measure(work, models, {"GPUVISOR_VLLM_PYTHON": vllm_python}, VLLM_STREAMS, max_tokens)
    out["vllm_kv_cache_tokens"] = out.pop("engine_kv_tokens")
    return out


async def _serve_and_measure(work: Path, models_dir: Path, env: dict[str, str], streams: tuple[int, ...],
                             max_tokens: int) -> dict[str, Any]:
    """Serve the model ``check`` from ``models_dir`` with as many slots as the
    most streams; its placement, VRAM against the fit, and tokens/s per count."""
    before = SmiSource().read()
    proc, base = start_server(work, max(streams), models_dir, env)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
            async with http.post(f"{base}/api/models/check/load", json={}) as resp:
                if resp.status >= 400:
                    raise SystemExit(f"load failed ({resp.status}): {await resp.text()}")
            shown = await _wait_ready(http, base)
            after = SmiSource().read()
            used = {r.index: (r.free_bytes - a.free_bytes) // MIB
                    for r in before for a in after if a.index == r.index}
            async with http.get(f"{base}/api/models/check/log") as resp:
                log_text = await resp.text()
            await _stream_tokens(http, base, 8)  # warm-up: the first request's setup is not measured
            rates = {}
            for n in streams:
                start = time.monotonic()
                tokens = await asyncio.gather(*(_stream_tokens(http, base, max_tokens) for _ in range(n)))
                rates[str(n)] = round(sum(tokens) / (time.monotonic() - start), 1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    fit = shown.get("fit") or {}
    worker = shown.get("worker") or {}
    kv_tokens = _VLLM_KV_TOKENS.search(log_text)
    return {"engine": shown.get("engine"), "placement": worker.get("placement"), "vram_used_mib_per_gpu": used,
            "estimate_mib": (fit.get("needed_bytes") or 0) // MIB, "n_ctx": fit.get("n_ctx"),
            "slots": fit.get("slots"), "kv_budget_mib": (fit.get("kv_bytes") or 0) / MIB,
            "engine_kv_tokens": int(kv_tokens.group(1).replace(",", "")) if kv_tokens else None,
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
        if args.no_finetune:
            report["finetune"] = "skipped: --no-finetune"
        else:
            report["finetune"] = await finetune_check(work / "ft", args.cpu_dry_run, args.steps, args.hidden,
                                                      args.layers, args.ft_gpus)
        if "llamacpp" not in args.kinds:
            report["serving"] = "skipped: not asked for (--kinds)"
        elif report["engine_gpus"] or args.cpu_dry_run:
            report["serving"] = await serve_check(work / "srv", args.model, args.max_tokens)
        else:
            report["serving"] = "skipped: the installed engine is its CPU build (no CUDA build at hand)"
        if "vllm" not in args.kinds:
            report["serving_vllm"] = "skipped: not asked for (--kinds)"
        elif not args.vllm_python:
            report["serving_vllm"] = ("skipped: no Python with vLLM at hand (install vLLM on the machine, "
                                      "or pass --vllm-python)")
        else:
            report["serving_vllm"] = await vllm_serve_check(work / "srv-vllm", args.vllm_python,
                                                            args.max_tokens, args.cpu_dry_run)
    return report


def finetune_lines(ft: dict[str, Any]) -> list[str]:
    """The fine-tune's memory, per GPU and per rank, as a person reads it."""
    lines = [f"finetune: {ft['note']}; {ft['world_size']} rank(s), {ft['tokens_per_s']} tokens/s"]
    idle = ft["gpu_idle_used_mib"]
    for index, peak in sorted(ft["gpu_peak_used_mib"].items()):
        lines.append(f"  GPU {index}: peak {peak} MiB used while it ran ({idle.get(index, 0)} MiB before)")
    for r in ft["ranks"]:
        how = r["measured_by"]
        if how == "RSS peak":  # the runtime's own memory is in it: say how much
            how += f"; {r['before_load_mib']} MiB before loading"
        lines.append(f"  rank {r['rank']} on {r['device']}: peak {r['peak_mib']} MiB ({how}), "
                     f"estimate {r['estimate_mib']} MiB, {r['samples']} samples")
    return lines


KINDS = ("llamacpp", "vllm")


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    if not kinds or any(k not in KINDS for k in kinds):
        raise argparse.ArgumentTypeError(f"--kinds takes {', '.join(KINDS)}, comma-separated: {text!r}")
    return kinds


def vllm_line(check: dict[str, Any]) -> str:
    """The vLLM serving check as a person reads it."""
    rates = ", ".join(f"{n} streams {tps} tok/s" for n, tps in check["tokens_per_s_by_streams"].items())
    placement = check["placement"] or {}
    where = ", ".join(placement.get("devices") or []) or "?"
    # vLLM's figure should be every sequence at full length: the budget holds exactly that.
    asked = (check["slots"] or 0) * (check["n_ctx"] or 0)
    return (f"vLLM on {where}: {check['slots']} sequences of {check['n_ctx']} tokens; KV budget "
            f"{check['kv_budget_mib']:.1f} MiB, vLLM's KV cache {check['vllm_kv_cache_tokens']} tokens "
            f"(asked {asked}); VRAM used {check['vram_used_mib_per_gpu']} MiB per GPU against an estimate of "
            f"{check['estimate_mib']} MiB; {rates}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-dry-run", action="store_true", help="run every step on the CPU")
    ap.add_argument("--steps", type=int, default=30, help="finetune optimizer steps")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size of the finetuned tiny model")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ft-gpus", type=int, default=0,
                    help="GPUs the fine-tune books (0: all of them; on a CPU dry run, 2 simulated)")
    ap.add_argument("--model", type=Path, help="a GGUF to serve instead of a generated tiny one")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per stream")
    ap.add_argument("--kinds", type=_kinds, default=("llamacpp", "vllm"),
                    help="engines to serve with, comma-separated (default llamacpp,vllm)")
    ap.add_argument("--vllm-python", default=default_vllm_python(),
                    help="a Python with vLLM and gpuvisor's worker package (default: the vLLM venv of a "
                         "checkout; bench/gpu_check.sh passes the one it found)")
    ap.add_argument("--no-finetune", action="store_true", help="serving only")
    ap.add_argument("--out", type=Path, help="also write the JSON report here")
    args = ap.parse_args()
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    print(text)
    if isinstance(report["finetune"], dict):
        print("\n".join(finetune_lines(report["finetune"])))
    if isinstance(report["serving_vllm"], dict):
        print(vllm_line(report["serving_vllm"]))
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
