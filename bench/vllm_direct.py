"""vLLM's ``AsyncLLM`` streaming in this process: the limit that
bench/vllm_stream.py holds gpuvisor's vLLM worker against.

Run from the vLLM environment (``make install-vllm``) by that bench, never by
hand. The engine is built exactly as the worker builds it (the same engine
args and KV budget: worker/engine_vllm.py), so the only difference between
the two sides is what gpuvisor adds: HTTP, SSE, the parent, the IPC.

Protocol: after the engine is up it prints ``{"ready": true}``; then each
stdin line ``{"streams": N, "tokens": T, "prompt": "..."}`` runs N streams of
T tokens at once (temperature 0, ``ignore_eos``) and prints one line
``{"streams": [{"start", "first", "end", "tokens"}, ...]}`` (perf_counter
seconds). EOF on stdin stops the engine and exits.

Usage (by the bench): python bench/vllm_direct.py MODEL_DIR N_CTX PARALLEL
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


async def _stream(llm: Any, ids: list[int], tokens: int, rid: str) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens,
                            output_kind=RequestOutputKind.DELTA)
    start = time.perf_counter()
    first: float | None = None
    count = 0
    async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), params, rid):
        got = len(out.outputs[0].token_ids)
        if got and first is None:
            first = time.perf_counter()
        count += got
    end = time.perf_counter()
    return {"start": start, "first": first if first is not None else end, "end": end, "tokens": count}


async def _serve(model: str, n_ctx: int, parallel: int) -> None:
    from worker.engine_api import EngineOptions
    from worker.engine_vllm import VllmEngine

    opts = EngineOptions(model, n_ctx, -1, 1, False, parallel=parallel)
    llm, _ = await VllmEngine._start(VllmEngine._engine_args(opts))
    tokenizer = llm.get_tokenizer()
    print(json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    batch = 0
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            ask = json.loads(line)
            ids = list(tokenizer.encode(ask["prompt"], add_special_tokens=True))
            batch += 1
            results = await asyncio.gather(*(_stream(llm, ids, int(ask["tokens"]), f"b{batch}-{i}")
                                             for i in range(int(ask["streams"]))))
            print(json.dumps({"streams": results}), flush=True)
    finally:
        llm.shutdown()


def main() -> None:
    model, n_ctx, parallel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    asyncio.run(_serve(model, n_ctx, parallel))


if __name__ == "__main__":  # vLLM spawns its engine core: it must not rerun this
    main()
