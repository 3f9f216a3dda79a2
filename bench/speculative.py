"""Speculative decoding: when does it pay?

Side by side on one server, the same greedy request with drafting off, with
prompt lookup (``ngram``) and with a draft model (``draft``): tokens/s, the
ratio to off, and the share of drafted tokens the target accepted, for an
input the output can copy from (a text to repeat) and for free generation.

Random tiny models do not copy their prompt and a random draft does not
agree with its target, so two draft models are measured:
- ``random``: other weights, one layer (what an unrelated draft costs);
- ``agree``: the target's own first layer, with the target's further layers
  scaled down so they barely change its output. A synthetic pair, built to
  show what drafting gives when draft and target mostly agree; real pairs
  (a 0.5B draft for a 7B+ target) land in between, on real text.

``python bench/speculative.py [tokens] [runs]``
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gguf
import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.models.demo import write_tiny_gguf  # noqa: E402
from tests.server import Server, short_tempdir  # noqa: E402
from tests.tiny_mtp import write_tiny_mtp  # noqa: E402

PROMPTS = {
    "copy": "Repeat exactly: " + " ".join(["the tiny model is a demo of the lab gpu job"] * 20),
    "free": "Tell a story.",
}
DIMS: dict[str, Any] = {"n_embd": 256, "n_ff": 768, "n_head": 8, "n_head_kv": 4, "n_ctx": 4096}
TARGET_LAYERS = 12
# (model, label, load body); ratios are to the first "off" of the same model.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("target", "off", {"speculative": "off"}),
    ("target", "ngram", {"speculative": "ngram", "draft_max": 8}),
    ("target", "draft random", {"speculative": "draft", "draft_model": "draft-random", "draft_max": 4}),
    ("target", "draft agree", {"speculative": "draft", "draft_model": "draft-agree", "draft_max": 4}),
    ("mtp", "off", {"speculative": "off"}),
    ("mtp", "mtp", {"speculative": "mtp", "draft_max": 2}),
]


def write_models(models: Path) -> None:
    target = write_tiny_gguf(models / "target.gguf", seed=0, n_layer=TARGET_LAYERS, **DIMS)
    # The same seed draws the same embeddings, head and first layer.
    write_tiny_gguf(models / "draft-agree.gguf", seed=0, n_layer=1, **DIMS)
    write_tiny_gguf(models / "draft-random.gguf", seed=9, n_layer=1, **DIMS)
    reader = gguf.GGUFReader(target, "r+")
    for t in reader.tensors:
        layer = t.name.split(".")[1] if t.name.startswith("blk.") else ""
        # What a further layer adds to the residual stream, nearly silenced.
        if layer not in ("", "0") and t.name.endswith(("attn_output.weight", "ffn_down.weight")):
            t.data[...] *= 0.01
    del reader  # flushes the memory map
    # A random MTP head agrees with nothing: this shows what MTP costs.
    write_tiny_mtp(models / "mtp.gguf", n_layer=6, n_embd=256, n_ff=768, n_head=8, n_head_kv=4, n_ff_exp=192)


def tps(srv: Server, model: str, prompt: str, n: int) -> float:
    t0 = time.perf_counter()
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=600, json={
        "model": model, "temperature": 0, "max_tokens": n, "ignore_eos": True,
        "messages": [{"role": "user", "content": prompt}]})
    r.raise_for_status()
    return float(r.json()["usage"]["completion_tokens"]) / (time.perf_counter() - t0)


def counters(srv: Server, model: str) -> tuple[int, int]:
    # The worker reports its counters with each heartbeat (1 s).
    time.sleep(1.5)
    s = httpx.get(srv.base_url + f"/api/models/{model}", timeout=10).json()["speculative"]
    return int(s["draft_tokens"] or 0), int(s["draft_accepted"] or 0)


def measure(srv: Server, model: str, prompt: str, n: int, runs: int) -> tuple[float, str]:
    tps(srv, model, prompt, 16)  # warm-up
    drafted0, accepted0 = counters(srv, model)
    value = statistics.median(tps(srv, model, prompt, n) for _ in range(runs))
    drafted1, accepted1 = counters(srv, model)
    drafted = drafted1 - drafted0
    rate = f"{(accepted1 - accepted0) / drafted:6.1%} of {drafted}" if drafted else "  (nothing drafted)"
    return value, rate


def main(n: int = 256, runs: int = 3) -> int:
    models = short_tempdir("gvbm")
    write_models(models)
    srv = Server(models, state_dir=Path(tempfile.mkdtemp(prefix="gvbs", dir="/tmp")), model="target").start()
    try:
        print(f"speculative decoding: tiny random models ({TARGET_LAYERS}-layer llama target, 6-layer "
              f"glm4moe with MTP), {n} tokens, greedy, median of {runs}, one slot of 4096")
        base: dict[tuple[str, str], float] = {}
        for model, label, body in CASES:
            r = httpx.post(srv.base_url + f"/api/models/{model}/load", json={**body, "parallel": 1, "n_ctx": 4096}, timeout=300)
            r.raise_for_status()
            srv.wait_worker(lambda w: w["state"] == "ready", model=model, timeout=120)
            for name, prompt in PROMPTS.items():
                value, rate = measure(srv, model, prompt, n, runs)
                base.setdefault((model, name), value)
                print(f"  {model:<6} {label:<13} {name:<5} {value:8.1f} tok/s   "
                      f"x{value / base[model, name]:.2f} vs off   accepted {rate}")
    finally:
        srv.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:3])))
