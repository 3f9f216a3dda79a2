"""Streaming overhead: gpuvisor over HTTP SSE against its limit and a peer.

Streams N tokens (default 1,000) of the tiny random demo model at temperature
0 with ``ignore_eos``, the three interleaved run by run so drift on a shared
machine hits all alike:
  (a) llama.cpp's server engine (xllamacpp) called in this process, no HTTP
      and no IPC: the limit;
  (b) gpuvisor ``/v1/completions`` over HTTP SSE (parent -> worker -> engine);
  (c) the same in-process engine's own HTTP server, ``/v1/completions`` SSE
      over its Unix socket: llama.cpp's server as a peer.
Same model, slots and threads on every side. Prints tokens/s and time to
first token, the ratios b/a and b/c, and the parent's RSS idle and while
streaming. The demo model is so small that per-token overhead shows in full;
bench/engine.py repeats (a) against (b) on a model where the engine dominates.

Run: python bench/stream_overhead.py [--tokens 1000] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.inprocess import InProcessEngine, Stream  # noqa: E402
from supervisor.models.demo import write_tiny_gguf  # noqa: E402
from tests.server import Server, short_tempdir  # noqa: E402

PROMPT = "Once upon a time"
N_CTX = 2048
THREADS = 1  # as the test server's worker (GPUVISOR_N_THREADS)

# One client for every request: a new httpx client builds an SSL context
# (tens of ms) that would otherwise be counted as time to first token.
_HTTP = httpx.Client(timeout=300)


def stream_sse(http: httpx.Client, url: str, body: dict[str, Any]) -> Stream:
    """Stream an OpenAI-style completion; tokens from its usage chunk."""
    s = Stream(time.perf_counter())
    with http.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            # Decode only what is needed: the client's JSON work is no side's cost.
            if s.first is not None and '"usage"' not in line:
                continue
            data = json.loads(line[6:])
            if s.first is None and data.get("choices") and data["choices"][0].get("text"):
                s.first = time.perf_counter()
            if data.get("usage"):
                s.tokens = int(data["usage"]["completion_tokens"])
    s.end = time.perf_counter()
    return s


def completion(model: str, n: int) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}


def summarize(name: str, runs: list[Stream]) -> dict[str, float]:
    tps = statistics.median(r.tps for r in runs)
    ttft = statistics.median(r.ttft or 0.0 for r in runs)
    print(f"  {name:<38} {tps:10.1f} tok/s   ttft {ttft * 1000:8.1f} ms   "
          f"({runs[0].tokens} tokens, median of {len(runs)})", flush=True)
    return {"tps": tps, "ttft": ttft}


class PeakRSS:
    """The largest RSS of a process while running, sampled every 10 ms."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.01)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--parallel", type=int, default=1, help="engine slots, every side")
    args = ap.parse_args()
    n = args.tokens
    work = Path(tempfile.mkdtemp(prefix="gvbench", dir="/tmp"))
    models = short_tempdir("gvbm")
    model = write_tiny_gguf(models / "tiny.gguf")
    print(f"stream overhead: {n} tokens, tiny random model, temperature 0, parallel {args.parallel}, "
          f"{THREADS} engine thread, {args.runs} interleaved runs each")
    local = InProcessEngine(model, parallel=args.parallel, n_ctx=N_CTX, threads=THREADS, sock=work / "e.sock")
    # The engine's own listener, reached over its Unix socket.
    peer = httpx.Client(transport=httpx.HTTPTransport(uds=str(local.sock)), base_url="http://engine",
                        timeout=300)
    srv = Server(models, env={"GPUVISOR_N_CTX": str(N_CTX), "GPUVISOR_PARALLEL": str(args.parallel),
                              "GPUVISOR_N_THREADS": str(THREADS)}).start()
    try:
        sides: dict[str, Callable[[int], Stream]] = {
            "a": lambda k: local.stream(PROMPT, k),
            "b": lambda k: stream_sse(_HTTP, srv.base_url + "/v1/completions", completion(srv.model, k)),
            "c": lambda k: stream_sse(peer, "/v1/completions", completion("tiny", k)),
        }
        for fn in sides.values():
            fn(16)  # warm-up: first graph, connection, caches
        parent = psutil.Process(srv.proc.pid)  # type: ignore[union-attr]
        rss_idle = parent.memory_info().rss
        runs: dict[str, list[Stream]] = {key: [] for key in sides}
        with PeakRSS(parent) as rss:
            for r in range(args.runs):
                order = list(sides)[r % 3:] + list(sides)[: r % 3]
                for key in order:
                    runs[key].append(sides[key](n))
        results = {
            "a": summarize("(a) in-process engine (xllamacpp)", runs["a"]),
            "b": summarize("(b) gpuvisor HTTP SSE", runs["b"]),
            "c": summarize("(c) llama.cpp server HTTP SSE (Unix)", runs["c"]),
        }
        for key, label in (("b", "gpuvisor"), ("c", "llama.cpp server")):
            wrong = [s.tokens for s in runs[key] if s.tokens != n]
            if wrong:
                print(f"  WARNING: {label} streamed {wrong} tokens, asked for {n}")
        responses_compare(srv.base_url, srv.model, n, args.runs)
    finally:
        srv.cleanup()
        peer.close()
        local.close()
        shutil.rmtree(models, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    print(f"  ratio b/a (tok/s) = {results['b']['tps'] / results['a']['tps']:.2f}   (target >= 0.8)")
    print(f"  ratio b/c (tok/s) = {results['b']['tps'] / results['c']['tps']:.2f}   (target >= 0.8)")
    print(f"  parent RSS idle {rss_idle / 2**20:.1f} MiB, peak while streaming {rss.peak / 2**20:.1f} MiB")
    return 0


def responses_compare(base_url: str, model: str, n: int, runs: int) -> None:
    """/v1/responses against /v1/chat/completions on the same server."""
    from bench.responses_bench import compare_responses_to_chat

    compare_responses_to_chat(base_url, model, tokens=n, runs=runs)


if __name__ == "__main__":
    sys.exit(main())
