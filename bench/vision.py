"""Prefill of one image against a text prompt of the same token count.

A worker's engine in this process, the tiny random vision pair of the tests
(or a bigger projector with ``--image-size`` / ``--patch``), on the CPU. Each
round runs both sides interleaved, each with a fresh image / fresh words so
the prompt cache never answers; the time is the worker's ``prefill_s`` (from
the request to the first token: for the image, decode + encode + its
embeddings' prefill). Medians over ``--runs``.

Run: python -m bench.vision [--runs 20] [--image-size 32] [--patch 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
from pathlib import Path

from tests.tiny_vision import png, write_tiny_mmproj, write_tiny_text_model
from worker import protocol as p
from worker.engine import Engine
from worker.engine_api import EngineOptions


def _run(engine: Engine, req: p.Generate) -> p.Done:
    out: list[object] = []
    engine.generate(req, out.append, threading.Event())
    done = out[-1]
    if not isinstance(done, p.Done):
        raise RuntimeError(f"request failed: {done}")
    return done


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.vision")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--patch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gv-vision-"))
    model = write_tiny_text_model(tmp / "tiny-vl.gguf")
    mmproj = write_tiny_mmproj(tmp / "mmproj.gguf", image_size=args.image_size, patch_size=args.patch)
    engine = Engine(EngineOptions(str(model), 4096, 0, args.threads, False,
                                  engine_socket=str(tmp / "e.sock"), mmproj=str(mmproj)))
    params = p.SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(200)}" for _ in range(n))

    # Calibrate: the image prompt's token count, then words to match it.
    probe = _run(engine, p.Generate(0, params, prompt=f"{p.MEDIA_MARKER} x", images=[png(64, 64, seed=0)]))
    n_words = 1
    while len(engine.tokenize(words(n_words))) < probe.prompt_tokens:
        n_words += 1
    image_s: list[float] = []
    text_s: list[float] = []
    text_tokens = text_cached = 0
    for i in range(args.runs):
        img = _run(engine, p.Generate(1, params, prompt=f"{p.MEDIA_MARKER} x", images=[png(64, 64, seed=i + 1)]))
        txt = _run(engine, p.Generate(2, params, prompt=words(n_words)))
        image_s.append(img.prefill_s)
        text_s.append(txt.prefill_s)
        text_tokens, text_cached = txt.prompt_tokens, txt.cached_tokens
        assert img.cached_tokens <= 1, "the prompt cache answered part of an image prompt"
    n_img = (args.image_size // args.patch) ** 2
    print(f"projector: {args.image_size}px, patch {args.patch} -> {n_img} embeddings per image; "
          f"{args.threads} thread(s), {args.runs} runs")
    print(f"image prompt: {probe.prompt_tokens} tokens, median prefill {statistics.median(image_s) * 1e3:.2f} ms")
    print(f"text prompt:  {text_tokens} tokens ({text_cached} from the cache), median prefill {statistics.median(text_s) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
