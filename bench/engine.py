"""gpuvisor against llama.cpp's server engine called in-process: throughput,
batching, head-of-line blocking and cancel during a long prefill.

Side by side in one run, the two sides interleaved round by round so drift on
a shared machine hits both alike, medians over ``--runs``:

1. one stream of ``--tokens`` tokens: gpuvisor ``/v1/completions`` (SSE)
   against ``xllamacpp.Server`` in this process, same model, slots, threads;
2. ``--streams`` concurrent streams: aggregate tokens/s on both sides, and
   against one stream (the gain from batching slots);
3. head-of-line: a short request sent while a long stream runs (parallel >= 2)
   must end first;
4. cancel during a long prefill (parallel 1): a client that disconnects
   shortly after sending must free the slot long before the whole prompt is
   evaluated. The engine sees a cancel only when it reports prefill progress
   (after each 512-token batch) and has begun the next batch by then, so up to
   two batches run on; gpuvisor should add nothing to that. Measured as the
   latency of a short request sent at the disconnect (less its idle latency),
   both sides, against the uncancelled prefill of the same prompt length.

The models are random llama GGUFs (the demo model's vocab, larger layers) so
the engine, not Python, dominates; their shapes are printed.

Run: python -m bench.engine [--runs 3] [--tokens 1000] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.inprocess import PREFILL_BATCH, InProcessEngine, Stream, aggregate_tps  # noqa: E402
from supervisor.models.demo import write_tiny_gguf  # noqa: E402
from tests.server import Server, short_tempdir  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """The layers of a random llama model (the demo vocab)."""

    n_embd: int
    n_layer: int
    n_ff: int

    def write(self, path: Path) -> Path:
        return write_tiny_gguf(path, n_embd=self.n_embd, n_layer=self.n_layer, n_ff=self.n_ff,
                               n_ctx=2 * N_CTX)

    def describe(self, path: Path) -> str:
        return (f"n_embd {self.n_embd}, n_layer {self.n_layer}, n_ff {self.n_ff}, "
                f"F32 {path.stat().st_size / 2**20:.0f} MiB")


PROMPT = "Once upon a time"
SHORT_PROMPT = "hi"
SHORT_TOKENS = 8
N_CTX = 4096  # per slot: room for the long prompt and the long stream
# Decode-bound comparisons: small enough for 1,000 tokens in seconds on one
# core, large enough (39 MiB of F32 weights, beyond the CPU caches) that the
# engine, not Python, sets the pace and batching slots pays.
THROUGHPUT_SHAPE = Shape(n_embd=384, n_layer=6, n_ff=1024)
# Prefill-bound: a few thousand prompt tokens take seconds (92 MiB).
PREFILL_SHAPE = Shape(n_embd=512, n_layer=8, n_ff=1408)
WORDS = ["the", "a", "is", "of", "and", "to", "in", "it", "you", "that", "hello", "world", "model",
         "tiny", "random", "demo", "yes", "no", "lab", "gpu", "job", "data", "train", "loss", "fine"]

# One client for every request, pooled across the concurrent streams' threads.
_HTTP = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


def median(values: list[float]) -> float:
    return statistics.median(values)


def long_prompt(tokens: int, seed: int) -> str:
    """About ``tokens`` tokens (the engine reports the exact count), different
    from the second character on for each seed, so no run reuses another's
    prompt cache. Most of the demo vocab's word pieces cannot be reached by
    merges from single characters, so its tokenizer spends about one token per
    character."""
    rng = random.Random(seed)
    parts = [f"<{seed}>"]
    while sum(len(p) + 1 for p in parts) < tokens:
        parts.append(rng.choice(WORDS))
    return " ".join(parts)[: tokens - 1]


# ---------------------------------------------------------------- gpuvisor client


def gv_stream(base: str, model: str, prompt: str, max_tokens: int,
              on_first: Callable[[], None] | None = None) -> Stream:
    """Stream ``/v1/completions``; tokens are the server's own usage count."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    s = Stream(time.perf_counter())
    with _HTTP.stream("POST", base + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            # Decode only what is needed: the client's JSON work is not gpuvisor's.
            if s.first is None or '"usage"' in line or '"error"' in line:
                _gv_chunk(s, json.loads(line[6:]), on_first)
    s.end = time.perf_counter()
    return s


def _gv_chunk(s: Stream, obj: dict[str, Any], on_first: Callable[[], None] | None) -> None:
    if "error" in obj:
        raise RuntimeError(f"gpuvisor stream error: {obj['error']}")
    if s.first is None and obj.get("choices") and obj["choices"][0].get("text"):
        s.first = time.perf_counter()
        if on_first is not None:
            on_first()
    if obj.get("usage"):
        s.tokens = int(obj["usage"]["completion_tokens"])
        s.prompt_tokens = int(obj["usage"]["prompt_tokens"])


def send_and_disconnect(base: str, model: str, prompt: str, after: float) -> float:
    """Send a streamed request, then close the connection ``after`` seconds
    later without reading anything; returns when it was closed."""
    url = urlsplit(base)
    data = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                       "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sent = time.perf_counter()
        sock.sendall(head + data)
        time.sleep(max(0.0, sent + after - time.perf_counter()))
    return time.perf_counter()


def check_tokens(where: str, streams: list[Stream], want: int, problems: list[str]) -> None:
    for s in streams:
        if s.tokens != want:
            problems.append(f"{where}: {s.tokens} tokens, asked for {want} with ignore_eos")


def concurrently(fn: Callable[[], Stream], n: int) -> list[Stream]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: fn(), range(n)))


def start_server(models: Path, parallel: int, threads: int) -> Server:
    env = {"GPUVISOR_PARALLEL": str(parallel), "GPUVISOR_N_THREADS": str(threads),
           "GPUVISOR_N_CTX": str(N_CTX), "GPUVISOR_ACCESS_LOG": "false"}
    srv = Server(models, env=env).start()
    got = srv.worker()["parallel"]
    if got != parallel:
        raise RuntimeError(f"asked for parallel {parallel}, the worker has {got}")
    return srv


# ---------------------------------------------------------------- 1, 2, 3


def bench_throughput(work: Path, args: argparse.Namespace, problems: list[str]) -> None:
    shape = THROUGHPUT_SHAPE
    models = short_tempdir("gvbe")
    model = shape.write(models / "tput.gguf")
    P, T, n, k, per = args.parallel, args.threads, args.tokens, args.streams, args.stream_tokens
    print(f"model A: {shape.describe(model)}; parallel {P} both sides, {T} engine thread(s), "
          f"median of {args.runs} interleaved runs", flush=True)
    local = InProcessEngine(model, parallel=P, n_ctx=N_CTX, threads=T, sock=work / "a.sock")
    srv = start_server(models, P, T)
    try:
        base, name = srv.base_url, srv.model

        # Pairs of sides that run back to back; which goes first flips every round.
        sides: list[tuple[str, Callable[[], list[Stream]]]] = [
            ("local1", lambda: [local.stream(PROMPT, n)]),
            ("gv1", lambda: [gv_stream(base, name, PROMPT, n)]),
            ("localk", lambda: concurrently(lambda: local.stream(PROMPT, per), k)),
            ("gvk", lambda: concurrently(lambda: gv_stream(base, name, PROMPT, per), k)),
        ]
        # Warm-up: first use of each slot and connection.
        concurrently(lambda: local.stream(PROMPT, 8), k)
        concurrently(lambda: gv_stream(base, name, PROMPT, 8), k)
        out: dict[str, list[list[Stream]]] = {key: [] for key, _ in sides}
        for r in range(args.runs):
            for key, fn in sides if r % 2 == 0 else [sides[i ^ 1] for i in range(len(sides))]:
                out[key].append(fn())
        for key, want in (("local1", n), ("gv1", n), ("localk", per), ("gvk", per)):
            check_tokens(key, [s for group in out[key] for s in group], want, problems)
        report_throughput(out, n, k, per, P)
        head_of_line(base, name, median([g[0].tps for g in out["gv1"]]), args, problems)
    finally:
        srv.cleanup()
        local.close()
        shutil.rmtree(models, ignore_errors=True)


def report_throughput(out: dict[str, list[list[Stream]]], n: int, k: int, per: int, P: int) -> None:
    l1 = median([g[0].tps for g in out["local1"]])
    g1 = median([g[0].tps for g in out["gv1"]])
    lt = median([g[0].ttft or 0.0 for g in out["local1"]])
    gt = median([g[0].ttft or 0.0 for g in out["gv1"]])
    lk = median([aggregate_tps(g) for g in out["localk"]])
    gk = median([aggregate_tps(g) for g in out["gvk"]])
    r1, rk = g1 / l1, gk / lk
    # Per round: the two sides of one round ran back to back.
    per1 = [g[0].tps / l[0].tps for g, l in zip(out["gv1"], out["local1"])]
    perk = [aggregate_tps(g) / aggregate_tps(l) for g, l in zip(out["gvk"], out["localk"])]
    print(f"1. single stream, {n} tokens:")
    print(f"  in-process engine              {l1:8.1f} tok/s   ttft {lt * 1000:6.1f} ms")
    print(f"  gpuvisor /v1/completions SSE   {g1:8.1f} tok/s   ttft {gt * 1000:6.1f} ms")
    print(f"  single stream gpuvisor/in-process = {r1:.2f}   (target >= 0.9: {'ok' if r1 >= 0.9 else 'MISSED'}); "
          f"per round {_runs(per1)}")
    print(f"2. {k} concurrent streams x {per} tokens, parallel {P}:")
    print(f"  in-process engine              {lk:8.1f} tok/s aggregate")
    print(f"  gpuvisor /v1/completions SSE   {gk:8.1f} tok/s aggregate")
    print(f"  {k} streams gpuvisor/in-process = {rk:.2f}   (target >= 0.85: {'ok' if rk >= 0.85 else 'MISSED'}); "
          f"per round {_runs(perk)}")
    print(f"  batching gain, {k}-stream aggregate / 1 stream: gpuvisor x{gk / g1:.2f}, in-process x{lk / l1:.2f}",
          flush=True)


def head_of_line(base: str, model: str, single_tps: float, args: argparse.Namespace,
                 problems: list[str]) -> None:
    """A short request sent while a long stream runs must not wait for it."""
    # Long enough to run several seconds at the measured single-stream speed.
    long_tokens = max(500, min(N_CTX - 64, int(single_tps * args.hol_seconds)))
    started = threading.Event()
    result: list[Stream] = []
    t0 = time.perf_counter()
    runner = threading.Thread(target=lambda: result.append(
        gv_stream(base, model, PROMPT, long_tokens, on_first=started.set)))
    runner.start()
    if not started.wait(60):
        problems.append("head-of-line: the long stream never produced a token")
    time.sleep(0.5)  # well inside the long stream
    short = gv_stream(base, model, SHORT_PROMPT, SHORT_TOKENS)
    runner.join()
    long = result[0]
    ok = short.end < long.end
    print(f"3. head-of-line, parallel {args.parallel}: long stream {long_tokens} tokens, "
          f"short {SHORT_TOKENS} tokens sent at {short.start - t0:.2f} s")
    print(f"  short ended at {short.end - t0:.2f} s ({short.seconds * 1000:.0f} ms), long ended at "
          f"{long.end - t0:.2f} s: {'PASS' if ok else 'FAIL'} (the short one must end first)", flush=True)
    if not ok:
        problems.append("head-of-line: the short request ended after the long stream")


# ---------------------------------------------------------------- 4


def bench_cancel(work: Path, args: argparse.Namespace, problems: list[str]) -> None:
    shape = PREFILL_SHAPE
    models = short_tempdir("gvbc")
    model = shape.write(models / "prefill.gguf")
    T, n, after = args.threads, args.prefill_tokens, args.cancel_after
    print("4. cancel during a long prefill, parallel 1 (the cancelled request holds the only slot);")
    print(f"  model B: {shape.describe(model)}; prompt ~{n} tokens, batch {PREFILL_BATCH}, "
          f"client gone {after:.2f} s after sending, {T} engine thread(s)", flush=True)
    local = InProcessEngine(model, parallel=1, n_ctx=N_CTX, threads=T, sock=work / "b.sock")
    srv = start_server(models, 1, T)
    seeds = iter(range(1, 1_000_000))
    rows: dict[str, list[float]] = {k: [] for k in (
        "l_prefill", "g_prefill", "l_batch", "l_seen", "l_free", "g_free", "l_idle", "g_idle")}
    prompt_tokens: list[int] = []
    try:
        base, name = srv.base_url, srv.model
        local.stream(SHORT_PROMPT, SHORT_TOKENS)
        gv_stream(base, name, SHORT_PROMPT, SHORT_TOKENS)
        for r in range(args.runs):
            # Pairs of sides back to back, which goes first flipping every round;
            # every prompt is new, so no run reuses another's prompt cache.
            steps: list[Callable[[], None]] = [
                lambda: local_uncancelled(local, long_prompt(n, next(seeds)), rows, prompt_tokens),
                lambda: gv_uncancelled(base, name, long_prompt(n, next(seeds)), rows),
                lambda: local_cancelled(local, long_prompt(n, next(seeds)), after, rows),
                lambda: gv_cancelled(base, name, long_prompt(n, next(seeds)), after, rows),
            ]
            for step in steps if r % 2 == 0 else [steps[i ^ 1] for i in range(len(steps))]:
                step()
    finally:
        srv.cleanup()
        local.close()
        shutil.rmtree(models, ignore_errors=True)
    report_cancel(rows, prompt_tokens, problems)


def local_uncancelled(local: InProcessEngine, prompt: str, rows: dict[str, list[float]],
                      prompt_tokens: list[int]) -> None:
    s = local.stream(prompt, 1)
    rows["l_prefill"].append(s.ttft or s.seconds)
    prompt_tokens.append(s.prompt_tokens)
    # Progress reports: one when the slot starts, then one per evaluated batch.
    gaps = [b - a for a, b in zip(s.progress[1:], s.progress[2:])]
    rows["l_batch"] += gaps


def gv_uncancelled(base: str, model: str, prompt: str, rows: dict[str, list[float]]) -> None:
    s = gv_stream(base, model, prompt, 1)
    rows["g_prefill"].append(s.ttft or s.seconds)


def local_cancelled(local: InProcessEngine, prompt: str, after: float, rows: dict[str, list[float]]) -> None:
    rows["l_idle"].append(local.stream(SHORT_PROMPT, SHORT_TOKENS).seconds)
    cancel_at = time.perf_counter() + after
    result: list[Stream] = []
    runner = threading.Thread(target=lambda: result.append(local.stream(prompt, 16, cancel_at=cancel_at)))
    runner.start()
    time.sleep(max(0.0, cancel_at - time.perf_counter()))
    # Sent at the cancel: the engine's one slot takes it once the long one lets go.
    short = local.stream(SHORT_PROMPT, SHORT_TOKENS)
    runner.join()
    rows["l_free"].append(short.end - cancel_at - rows["l_idle"][-1])
    long = result[0]
    if long.cancelled_at is not None:
        rows["l_seen"].append(long.cancelled_at - cancel_at)


def gv_cancelled(base: str, model: str, prompt: str, after: float, rows: dict[str, list[float]]) -> None:
    rows["g_idle"].append(gv_stream(base, model, SHORT_PROMPT, SHORT_TOKENS).seconds)
    gone = send_and_disconnect(base, model, prompt, after)
    # Queued in the parent until the worker reports the cancelled one done.
    short = gv_stream(base, model, SHORT_PROMPT, SHORT_TOKENS)
    rows["g_free"].append(short.end - gone - rows["g_idle"][-1])


def report_cancel(rows: dict[str, list[float]], prompt_tokens: list[int], problems: list[str]) -> None:
    m = {k: median(v) if v else float("nan") for k, v in rows.items()}
    print(f"  prompt {median([float(t) for t in prompt_tokens]):.0f} tokens; engine progress reports "
          f"every {m['l_batch']:.2f} s (median gap between {PREFILL_BATCH}-token batches, in-process)")
    print(f"  uncancelled prefill (time to first token)   in-process {m['l_prefill']:6.2f} s   "
          f"gpuvisor {m['g_prefill']:6.2f} s")
    print(f"  cancelled: slot free after the disconnect    in-process {m['l_free']:6.2f} s   "
          f"gpuvisor {m['g_free']:6.2f} s   (short request latency after it, minus its idle "
          f"latency: in-process {m['l_idle'] * 1000:.0f} ms, gpuvisor {m['g_idle'] * 1000:.0f} ms)")
    print(f"  in-process engine saw the cancel {m['l_seen']:.2f} s after it was asked (at its next progress "
          f"report), then still ran the batch it had begun: up to two batches in all")
    print(f"  slot free after cancel / uncancelled prefill: gpuvisor {m['g_free'] / m['g_prefill']:.2f}, "
          f"in-process {m['l_free'] / m['l_prefill']:.2f}")
    extra = m["g_free"] - m["l_free"]
    verdict = "ok" if extra <= 0.25 else "SLOW"
    print(f"  gpuvisor slot free minus in-process = {extra * 1000:+.0f} ms (target <= +250 ms: {verdict}); "
          f"runs gpuvisor {_runs(rows['g_free'])}, in-process {_runs(rows['l_free'])}", flush=True)
    if verdict != "ok":
        problems.append(f"cancel: gpuvisor freed the slot {m['g_free']:.2f} s after the client left, "
                        f"the engine in-process {m['l_free']:.2f} s")


def _runs(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs per side")
    ap.add_argument("--tokens", type=int, default=1000, help="tokens of the single stream")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams")
    ap.add_argument("--stream-tokens", type=int, default=300, help="tokens of each concurrent stream")
    ap.add_argument("--parallel", type=int, default=8, help="slots for 1-3, both sides")
    ap.add_argument("--threads", type=int, default=1, help="engine threads, both sides")
    ap.add_argument("--hol-seconds", type=float, default=5.0, help="about how long the long stream runs")
    ap.add_argument("--prefill-tokens", type=int, default=2560, help="prompt of the cancelled request")
    ap.add_argument("--cancel-after", type=float, default=0.5, help="seconds from sending to disconnect")
    ap.add_argument("--quick", action="store_true", help="fewer and shorter runs (about a minute)")
    ap.add_argument("--skip-cancel", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.tokens, args.stream_tokens, args.hol_seconds = 2, 400, 120, 3.0
        args.prefill_tokens = 1536
    if args.parallel < 2:
        ap.error("--parallel must be at least 2 (head-of-line needs two slots)")
    work = Path(tempfile.mkdtemp(prefix="gvbe", dir="/tmp"))
    problems: list[str] = []
    t0 = time.monotonic()
    print(f"engine: gpuvisor against llama.cpp's server engine in-process (xllamacpp); "
          f"{os.cpu_count()} cores", flush=True)
    try:
        bench_throughput(work, args, problems)
        if not args.skip_cancel:
            bench_cancel(work, args, problems)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"took {time.monotonic() - t0:.0f} s")
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
