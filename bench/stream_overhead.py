"""Streaming overhead: gpuvisor over HTTP SSE against its limits and a peer.

Streams N tokens (default 1,000) of the tiny random model at temperature 0,
several runs each, side by side in one run:
  (a) in-process ``Llama.generate()``, no server: the limit;
  (b) gpuvisor ``/v1/completions`` over HTTP SSE;
  (c) llama-cpp-python's own ``python -m llama_cpp.server`` over HTTP SSE
      (needs ``pip install 'llama-cpp-python[server]'``; skipped otherwise).
Prints tokens/s and time to first token, the ratios b/a and b/c, and the
parent's RSS idle and while streaming. Absolute numbers drift on a shared
machine; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.demo_model import write_tiny_gguf  # noqa: E402
from tests.server import Server, short_tempdir  # noqa: E402

PROMPT = "Once upon a time"
N_CTX = 2048


class Run:
    def __init__(self, tokens: int, ttft: float, total: float) -> None:
        self.tokens, self.ttft, self.total = tokens, ttft, total

    @property
    def tps(self) -> float:
        return self.tokens / self.total


def bench_inprocess(model: Path, n: int, runs: int) -> list[Run]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=N_CTX, n_threads=1, verbose=False)
    prompt = llm.tokenize(PROMPT.encode())
    out = []
    for i in range(runs + 1):
        llm.reset()  # no prefix cache: each run evaluates the prompt, as a server request would
        t0 = time.perf_counter()
        ttft = 0.0
        count = 0
        for _tok in llm.generate(prompt, temp=0.0, top_k=40, top_p=1.0, min_p=0.05, reset=True):
            count += 1
            if count == 1:
                ttft = time.perf_counter() - t0
            if count >= n:
                break
        if i > 0:  # the first run warms up the compute graph, like the server's warm-up
            out.append(Run(count, ttft, time.perf_counter() - t0))
    del llm
    return out


# One client for every request: a new httpx client builds an SSL context
# (tens of ms) that would otherwise be counted as time to first token.
_HTTP = httpx.Client(timeout=300)


def stream_sse(url: str, body: dict[str, Any], token_count_from_usage: bool) -> Run:
    t0 = time.perf_counter()
    ttft = 0.0
    chunks = 0
    tokens = 0
    with _HTTP.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            if data.get("choices") and data["choices"][0].get("text"):
                chunks += 1
                if chunks == 1:
                    ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return Run(tokens if token_count_from_usage else chunks, ttft, total)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_llama_cpp_server(model: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", str(N_CTX),
         "--n_threads", "1", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama_cpp.server did not start")


def summarize(name: str, runs: list[Run]) -> dict[str, float]:
    tps = statistics.median(r.tps for r in runs)
    ttft = statistics.median(r.ttft for r in runs)
    toks = runs[0].tokens
    print(f"  {name:<34} {tps:10.1f} tok/s   ttft {ttft * 1000:8.1f} ms   ({toks} tokens, median of {len(runs)})",
          flush=True)
    return {"tps": tps, "ttft": ttft}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3)
    # llama_cpp.server slows down quadratically with output length (minutes
    # per 1,000-token run on a small machine): one run is enough to compare.
    ap.add_argument("--peer-runs", type=int, default=1)
    ap.add_argument("--no-peer", action="store_true", help="skip (c), which takes minutes")
    args = ap.parse_args()
    n = args.tokens
    work = Path(tempfile.mkdtemp(prefix="gvbench"))
    model = write_tiny_gguf(work / "tiny.gguf")
    results: dict[str, dict[str, float]] = {}
    print(f"stream overhead: {n} tokens, tiny random model, temperature 0, {args.runs} runs each")

    results["a"] = summarize("(a) in-process Llama.generate()", bench_inprocess(model, n, args.runs))

    models = short_tempdir("gvbm")
    (models / "tiny.gguf").symlink_to(model)
    srv = Server(models, env={"GPUVISOR_N_CTX": str(N_CTX)}).start()
    try:
        parent = psutil.Process(srv.proc.pid)  # type: ignore[union-attr]
        rss_idle = parent.memory_info().rss
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": n, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        url = srv.base_url + "/v1/completions"
        stream_sse(url, body, True)  # warm-up
        peak = [0]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], parent.memory_info().rss)
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        runs = [stream_sse(url, body, True) for _ in range(args.runs)]
        stop.set()
        sampler.join()
        results["b"] = summarize("(b) gpuvisor HTTP SSE", runs)
        responses_compare(srv.base_url, n, args.runs)
    finally:
        srv.cleanup()

    if args.no_peer:
        print("  (c) skipped (--no-peer)")
    elif importlib.util.find_spec("sse_starlette") and importlib.util.find_spec("fastapi"):
        proc, base = start_llama_cpp_server(model)
        try:
            # Ban every end-of-generation token so all three produce n tokens.
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": n, "temperature": 0, "stream": True,
                    "logit_bias": {"2": -100.0, "4": -100.0}}
            stream_sse(base + "/v1/completions", {**body, "max_tokens": 16}, False)  # warm-up
            results["c"] = summarize("(c) llama_cpp.server HTTP SSE",
                                     [stream_sse(base + "/v1/completions", body, False)
                                      for _ in range(args.peer_runs)])
        finally:
            proc.terminate()
            proc.wait()
    else:
        print("  (c) skipped: pip install 'llama-cpp-python[server]' to compare")

    print(f"  ratio b/a (tok/s) = {results['b']['tps'] / results['a']['tps']:.2f}   (target >= 0.8)")
    if "c" in results:
        print(f"  ratio b/c (tok/s) = {results['b']['tps'] / results['c']['tps']:.1f}   (target >= 10)")
    print(f"  parent RSS idle {rss_idle / 2**20:.1f} MiB, peak while streaming {peak[0] / 2**20:.1f} MiB")
    return 0


def responses_compare(base_url: str, n: int, runs: int) -> None:
    """/v1/responses against /v1/chat/completions on the same server."""
    from bench.responses_bench import compare_responses_to_chat

    compare_responses_to_chat(base_url, "tiny", tokens=n, runs=runs)


if __name__ == "__main__":
    sys.exit(main())
