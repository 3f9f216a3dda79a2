"""The Responses path against chat completions on the same running server.

Streams the same prompt for the same number of tokens (temperature 0,
``ignore_eos``) through ``/v1/responses`` and ``/v1/chat/completions``,
alternating the two so drift on a shared machine hits both alike, and reports
tokens/s and time to first token with the ratios (target: within 5%).

Called by ``bench/stream_overhead.py`` with a running server; runnable alone:
``python -m bench.responses_bench [--tokens 1000] [--runs 5]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

PROMPT = "Once upon a time"
TARGET_RATIO = 0.95


@dataclass(frozen=True)
class Run:
    tokens: int
    ttft: float
    total: float

    @property
    def tps(self) -> float:
        return self.tokens / self.total


def _stream(http: httpx.Client, url: str, body: dict[str, Any], first_text: Any, tokens_of: Any) -> Run:
    t0 = time.perf_counter()
    ttft = 0.0
    tokens = 0
    with http.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if not ttft and first_text(data):
                ttft = time.perf_counter() - t0
            tokens = tokens_of(data) or tokens
    return Run(tokens, ttft, time.perf_counter() - t0)


def stream_chat(http: httpx.Client, base_url: str, model: str, n: int) -> Run:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": n,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    return _stream(
        http, base_url + "/v1/chat/completions", body,
        lambda d: bool(d.get("choices") and d["choices"][0].get("delta", {}).get("content")),
        lambda d: (d.get("usage") or {}).get("completion_tokens", 0),
    )


def stream_responses(http: httpx.Client, base_url: str, model: str, n: int) -> Run:
    body = {"model": model, "input": PROMPT, "max_output_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "store": False}
    return _stream(
        http, base_url + "/v1/responses", body,
        lambda d: d.get("type") == "response.output_text.delta",
        lambda d: ((d.get("response") or {}).get("usage") or {}).get("output_tokens", 0),
    )


def _median(runs: list[Run]) -> dict[str, float]:
    return {"tps": statistics.median(r.tps for r in runs), "ttft": statistics.median(r.ttft for r in runs),
            "tokens": float(runs[0].tokens)}


def compare_responses_to_chat(base_url: str, model: str, *, tokens: int = 1000, runs: int = 5) -> dict[str, Any]:
    """Median tokens/s and time to first token of both paths, and their ratios.

    Prints one line per path and the ratios; returns them for the caller.
    """
    chat: list[Run] = []
    responses: list[Run] = []
    # One client for every request: building one costs more than a short TTFT.
    with httpx.Client(timeout=300) as http:
        stream_chat(http, base_url, model, tokens)  # warm-up: model loaded, caches primed
        stream_responses(http, base_url, model, tokens)
        for _ in range(runs):
            chat.append(stream_chat(http, base_url, model, tokens))
            responses.append(stream_responses(http, base_url, model, tokens))
    result: dict[str, Any] = {"chat": _median(chat), "responses": _median(responses)}
    for name, label in (("chat", "/v1/chat/completions"), ("responses", "/v1/responses")):
        m = result[name]
        print(f"  {label:<34} {m['tps']:10.1f} tok/s   ttft {m['ttft'] * 1000:8.1f} ms"
              f"   ({int(m['tokens'])} tokens, median of {runs})")
    result["tps_ratio"] = result["responses"]["tps"] / result["chat"]["tps"]
    result["ttft_ratio"] = result["responses"]["ttft"] / result["chat"]["ttft"]
    verdict = "ok" if result["tps_ratio"] >= TARGET_RATIO else "BELOW TARGET"
    print(f"  responses/chat: tok/s x{result['tps_ratio']:.3f} ({verdict}, target >= {TARGET_RATIO}),"
          f" ttft x{result['ttft_ratio']:.3f}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo))
    from supervisor.models.demo import write_tiny_gguf
    from tests.server import Server, short_tempdir

    model = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="gvrb")) / "tiny.gguf")
    models = short_tempdir("gvrbm")
    (models / "tiny.gguf").symlink_to(model)
    srv = Server(models, env={"GPUVISOR_N_CTX": "2048"}).start()
    try:
        print(f"responses vs chat completions: {args.tokens} tokens, tiny random model, temperature 0")
        result = compare_responses_to_chat(srv.base_url, srv.model, tokens=args.tokens, runs=args.runs)
    finally:
        srv.cleanup()
    return 0 if result["tps_ratio"] >= TARGET_RATIO else 1


if __name__ == "__main__":
    raise SystemExit(main())
