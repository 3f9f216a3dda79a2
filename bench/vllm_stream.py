"""Streaming through gpuvisor's vLLM worker against vLLM's AsyncLLM directly.

Side by side in one run, on the same tiny random Hugging Face model (made
here, tests/tiny_hf.py), the same prompt, context, sequences and KV budget:
  (a) ``AsyncLLM`` in a process of its own (bench/vllm_direct.py, from the
      vLLM environment), built with the worker's own engine args: the limit;
  (b) gpuvisor ``/v1/completions`` over HTTP SSE (parent -> vLLM worker ->
      AsyncLLM).
At 1 and 8 concurrent streams, run by run interleaved so drift on a shared
machine hits both alike. Prints the aggregate tokens/s and the median time
to first token of each, and the ratios b/a (the issue's target: >= 0.9).
Both engines stay up for the whole run; each idles while the other streams.

Needs the vLLM environment (``make install-vllm``) and the train extra.
Run: python bench/vllm_stream.py [--tokens 512] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.config import default_vllm_python  # noqa: E402
from supervisor.lab.job_process import child_environ  # noqa: E402
from tests.server import Server, running, short_tempdir  # noqa: E402
from tests.tiny_hf import build_vllm_model  # noqa: E402

MODEL = "tiny-vllm"
PROMPT = "Once upon a time"
N_CTX = 2048
PARALLEL = 8
STREAMS = (1, 8)
# The pause before each measured run, for the other side to go quiet (see measure).
QUIET_S = 3.0


@dataclass
class Stream:
    start: float
    first: float
    end: float
    tokens: int


def aggregate_tps(streams: list[Stream]) -> float:
    """Tokens of all streams over the wall time from the first start to the last end."""
    wall = max(s.end for s in streams) - min(s.start for s in streams)
    return sum(s.tokens for s in streams) / wall if wall > 0 else 0.0


def median_ttft(streams: list[Stream]) -> float:
    return statistics.median(s.first - s.start for s in streams)


class Direct:
    """bench/vllm_direct.py in the vLLM environment, one batch per call."""

    def __init__(self, python: str, model: Path) -> None:
        env = child_environ(__import__("os").environ) | {"PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [python, str(REPO / "bench" / "vllm_direct.py"), str(model), str(N_CTX), str(PARALLEL)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if json.loads(self._line()).get("ready") is not True:
            raise RuntimeError("the direct engine did not start")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith("{"):  # vLLM logs to stderr; stdout is ours, but stay strict
                return line
        raise RuntimeError(f"the direct engine exited ({self.proc.wait()})")

    def run(self, streams: int, tokens: int) -> list[Stream]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"streams": streams, "tokens": tokens, "prompt": PROMPT}) + "\n")
        self.proc.stdin.flush()
        return [Stream(**s) for s in json.loads(self._line())["streams"]]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _one(client: httpx.AsyncClient, url: str, tokens: int) -> Stream:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    count = 0
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk: dict[str, Any] = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter()
            if chunk.get("usage"):
                count = int(chunk["usage"]["completion_tokens"])
    end = time.perf_counter()
    return Stream(start, first if first is not None else end, end, count)


async def openai_streams(base: str, streams: int, tokens: int) -> list[Stream]:
    """``streams`` completions of ``tokens`` tokens at once from an OpenAI-style
    server at ``base`` serving a model named MODEL (gpuvisor, or ``vllm serve``
    with that served name: bench/vllm_serve.py)."""
    limits = httpx.Limits(max_connections=streams + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return list(await asyncio.gather(*(_one(client, base + "/v1/completions", tokens) for _ in range(streams))))


Side = Callable[[int, int], list[Stream]]
Results = dict[tuple[str, int], list[list[Stream]]]


def openai_side(base: str) -> Side:
    """Streams through an OpenAI-style server at ``base``, as a measured side."""
    return lambda n, tokens: asyncio.run(openai_streams(base, n, tokens))


def measure(sides: list[tuple[str, Side]], tokens: int, runs: int) -> Results:
    """Each side at each count of STREAMS, run by run in alternating order so
    drift on a shared machine hits all alike; warmed first (first requests
    pay one-time costs on either side)."""
    for _, go in sides:
        go(1, 16)
    out: Results = {}
    for run in range(runs):
        for n in STREAMS:
            for name, go in sides if run % 2 == 0 else list(reversed(sides)):
                # Each side's vLLM model process keeps a core busy for about a
                # second after its streams end (its message queue polls before
                # it sleeps), and on the CPU build both sides' model processes
                # bind the same core: without the pause a side is measured
                # against the last one's polling.
                time.sleep(QUIET_S)
                got = go(n, tokens)
                if any(s.tokens != tokens for s in got):
                    raise RuntimeError(f"{name}: a stream ended early: {[s.tokens for s in got]}")
                out.setdefault((name, n), []).append(got)
    return out


def report(results: Results, baseline: str, tokens: int, runs: int) -> None:
    """The median tokens/s and time to first token per side, and gpuvisor's ratio to ``baseline``."""
    print(f"tiny random llama (2 layers, hidden 256), prompt {PROMPT!r}, {tokens} tokens per stream, "
          f"median of {runs} runs")
    width = max(len(baseline), len("gpuvisor"))
    print(f"{'streams':>7}  {'side':<{width}} {'tok/s':>9} {'TTFT ms':>8}")
    for n in STREAMS:
        tps: dict[str, float] = {}
        for name in (baseline, "gpuvisor"):
            batches = results[(name, n)]
            tps[name] = statistics.median(aggregate_tps(b) for b in batches)
            ttft = statistics.median(median_ttft(b) for b in batches) * 1000
            print(f"{n:>7}  {name:<{width}} {tps[name]:>9.1f} {ttft:>8.1f}")
        print(f"{n:>7}  ratio gpuvisor/{baseline}: {tps['gpuvisor'] / tps[baseline]:.3f}")


@contextmanager
def served_model(prefix: str, start_s: float) -> Iterator[tuple[Server, Path, str]]:
    """A gpuvisor server with the tiny model loaded on a ready vLLM worker:
    the server, the model's dir and the vLLM environment's python."""
    python = default_vllm_python()
    if not python:
        sys.exit("no vLLM environment: run `make install-vllm`")
    models = short_tempdir(prefix)
    build_vllm_model(models / MODEL, max_position_embeddings=N_CTX)
    env = {"GPUVISOR_VLLM_PYTHON": python, "GPUVISOR_PARALLEL": str(PARALLEL), "GPUVISOR_N_CTX": str(N_CTX)}
    with running(Server(models, env=env, model=MODEL)) as srv:
        r = httpx.post(f"{srv.base_url}/api/models/{MODEL}/load", timeout=start_s)
        r.raise_for_status()
        srv.wait_worker(lambda w: w["state"] == "ready", timeout=start_s)
        yield srv, models / MODEL, python


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per stream")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with served_model("gvbv", 600) as (srv, model, python):
        direct = Direct(python, model)
        try:
            results = measure([("gpuvisor", openai_side(srv.base_url)), ("AsyncLLM", direct.run)],
                              args.tokens, args.runs)
        finally:
            direct.close()
    report(results, "AsyncLLM", args.tokens, args.runs)


if __name__ == "__main__":
    main()
