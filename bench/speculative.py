"""Prompt-lookup (n-gram) speculative decoding: when does it pay?

Side by side on one server, the same greedy request with ``draft_ngram`` 0
(off), 4 and 10: tokens/s for an input the output can copy from (a text to
repeat) and for free generation. With the tiny random model the output rarely
copies its prompt, so this mostly shows the cost of drafting; on a real model
copying tasks (editing code, quoting a document) are where it helps.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.models.demo import write_tiny_gguf  # noqa: E402
from tests.server import Server, short_tempdir  # noqa: E402

PROMPTS = {
    "copy": "Repeat exactly: " + " ".join(["the tiny model is a demo of the lab gpu job"] * 20),
    "free": "Tell a story.",
}


def tps(srv: Server, prompt: str, n: int) -> float:
    t0 = time.perf_counter()
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=300, json={
        "model": "tiny", "temperature": 0, "max_tokens": n, "ignore_eos": True,
        "messages": [{"role": "user", "content": prompt}]})
    r.raise_for_status()
    return float(r.json()["usage"]["completion_tokens"]) / (time.perf_counter() - t0)


def main(n: int = 400, runs: int = 3) -> int:
    models = short_tempdir("gvbm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=4096)
    srv = Server(models, state_dir=Path(tempfile.mkdtemp(prefix="gvbs", dir="/tmp"))).start()
    try:
        print(f"speculative decoding (prompt lookup): {n} tokens, greedy, median of {runs}")
        base: dict[str, float] = {}
        for draft in (0, 4, 10):
            httpx.post(srv.base_url + "/api/models/tiny/load", json={"draft_ngram": draft}, timeout=120)
            srv.wait_worker(lambda w: w["state"] == "ready")
            for name, prompt in PROMPTS.items():
                tps(srv, prompt, 16)  # warm-up
                value = statistics.median(tps(srv, prompt, n) for _ in range(runs))
                base.setdefault(name, value)
                print(f"  draft_ngram={draft:<3} {name:<5} {value:8.1f} tok/s   x{value / base[name]:.2f} vs off")
    finally:
        srv.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
