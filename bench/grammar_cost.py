"""What a JSON-schema output format costs per request: LLGuidance vs GBNF.

Side by side in one run, on one worker process (the byte-level BPE tiny
model, whose vocab LLGuidance accepts), the same request with no output
format, with the schema as our GBNF (formats/schema_gbnf.py, the fallback
for vocabs LLGuidance refuses) and with the schema through LLGuidance: the
first-token latency (from sending the request to its first text, grammar
setup included) and the time per further token. LLGuidance is
measured twice: a schema the worker has not seen (its compile check runs
first, worker/guidance.py) and one it has. Then the same for a forced tool
call (Hermes syntax around the arguments' schema): the parent's GBNF
(supervisor/generation/grammar.py) against its LLGuidance grammar
(supervisor/generation/lark_calls.py).

The tiny model's forward pass takes a fraction of a millisecond, so what is
left is the grammar's own cost; on a real model the same milliseconds sit
beside a much longer forward pass.

``python -m bench.grammar_cost [--runs 20] [--tokens 32]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.tiny_bpe import write_tiny_bpe  # noqa: E402
from tests.worker_harness import Worker, spawn_worker  # noqa: E402
from worker import protocol as p  # noqa: E402
from supervisor.generation.grammar import tool_call_grammar  # noqa: E402
from supervisor.generation.lark_calls import lark_tool_grammar  # noqa: E402
from worker.grammar_guard import schema_to_grammar  # noqa: E402

DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
SCHEMAS: dict[str, dict[str, Any]] = {
    "small (object, bounded array)": {
        "type": "object", "properties": {"tags": {"type": "array", "items": DIGIT, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "large (200 properties)": {
        "type": "object", "properties": {f"field_{i}": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}
                                         for i in range(200)},
        "required": [f"field_{i}" for i in range(200)], "additionalProperties": False},
}
PROMPT = "<|im_start|>user\nanswer in JSON<|im_end|>\n<|im_start|>assistant\n"


async def timed(worker: Worker, params: p.SamplingParams) -> tuple[float, float, int]:
    """(first-token seconds, whole-request seconds, tokens) of one request,
    by the parent's clock: from sending it to its first text (a compile
    check included), and to its end."""
    req_id = worker.next_id
    worker.next_id += 1
    sent = time.perf_counter()
    worker.writer.write(worker.codec.encode(p.Generate(req_id, params, prompt=PROMPT)))
    first: float | None = None
    while True:
        msg = await worker.next_msg()
        if isinstance(msg, p.Delta) and first is None:
            first = time.perf_counter()
        elif isinstance(msg, p.Done):
            end = time.perf_counter()
            first = end if first is None else first
            return first - sent, end - sent, msg.completion_tokens
        elif isinstance(msg, p.Error):
            raise RuntimeError(msg.message)


async def case(worker: Worker, runs: int, make: Callable[[int], p.SamplingParams]) -> tuple[float, float, float]:
    """Medians over ``runs`` requests, each with the sampling ``make(i)`` returns."""
    results = [await timed(worker, make(i)) for i in range(runs)]
    return tuple(statistics.median(r[k] for r in results) for k in range(3))  # type: ignore[return-value]


async def main(runs: int, tokens: int) -> int:
    with tempfile.TemporaryDirectory(prefix="gvb") as tmp:
        model = write_tiny_bpe(Path(tmp) / "bpe.gguf")
        async with spawn_worker(model, n_ctx=2048) as (worker, hello):
            assert hello.facts.schema_grammar == "llguidance", hello.facts.schema_grammar
            base = p.SamplingParams(max_tokens=tokens, temperature=1.0, seed=1)
            print(f"first-token latency and whole request, median of {runs} requests of at most "
                  f"{tokens} tokens (tiny BPE model, one worker, CPU, 1 thread)\n")
            none = await case(worker, runs, lambda i: base)
            print(f"{'format':36s} {'case':24s} {'first token':>12s} {'vs none':>8s} {'request':>10s} {'tokens':>6s}")
            print(f"{'none':36s} {'':24s} {none[0] * 1e3:9.2f} ms {1.0:7.2f}x {none[1] * 1e3:7.2f} ms "
                  f"{none[2]:6.0f}")
            for label, schema in SCHEMAS.items():
                text = json.dumps(schema)
                gbnf = schema_to_grammar(text)
                rows = {
                    "GBNF (our converter)": lambda i: p.SamplingParams(
                        max_tokens=tokens, temperature=1.0, seed=1, grammar=gbnf),
                    # A new description each time: a schema the worker has not checked yet.
                    "LLGuidance, new schema": lambda i: p.SamplingParams(
                        max_tokens=tokens, temperature=1.0, seed=1,
                        json_schema=json.dumps({**schema, "description": f"run {i}"})),
                    "LLGuidance, same schema": lambda i: p.SamplingParams(
                        max_tokens=tokens, temperature=1.0, seed=1, json_schema=text),
                }
                for name, make in rows.items():
                    first, whole, n = await case(worker, runs, make)
                    print(f"{label:36s} {name:24s} {first * 1e3:9.2f} ms {first / none[0]:7.2f}x "
                          f"{whole * 1e3:7.2f} ms {n:6.0f}")
            for label, schema in SCHEMAS.items():
                if schema.get("type") != "object":
                    continue
                calls = {
                    "GBNF (our converter)": lambda i: p.SamplingParams(
                        max_tokens=tokens, temperature=1.0, seed=1,
                        grammar=tool_call_grammar([("f", schema)], style="hermes", parallel=False)),
                    "LLGuidance, new schema": lambda i: p.SamplingParams(
                        max_tokens=tokens, temperature=1.0, seed=1, grammar=lark_tool_grammar(
                            [("f", {**schema, "description": f"run {i}"}, False)], style="hermes", parallel=False)),
                    "LLGuidance, same schema": lambda i: p.SamplingParams(
                        max_tokens=tokens, temperature=1.0, seed=1,
                        grammar=lark_tool_grammar([("f", schema, False)], style="hermes", parallel=False)),
                }
                for name, make in calls.items():
                    first, whole, n = await case(worker, runs, make)
                    print(f"{'call: ' + label:36s} {name:24s} {first * 1e3:9.2f} ms {first / none[0]:7.2f}x "
                          f"{whole * 1e3:7.2f} ms {n:6.0f}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    sys.exit(asyncio.run(main(args.runs, args.tokens)))
