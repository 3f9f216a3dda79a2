"""The hosted-tool loop's overhead per iteration: a forced code_interpreter
call through gpuvisor against the same code run in the sandbox alone.

Side by side in one run, interleaved call by call so drift on a shared
machine hits both alike: a real gpuvisor (the tiny model, the sandbox on)
streams a response whose first generation is forced to call
code_interpreter; the client notes when each event arrives. Then the very
code that call ran is run again here, in a container of a sandbox built
from the same settings the service uses (the same Python, hidden paths and
limits), with nothing around it. Per iteration it reports:

- sandbox alone: the tool's own time, measured apart;
- the call through gpuvisor: from the call's ``interpreting`` event to its
  ``completed`` event, as the client saw them;
- the turnaround: from the call written (``code.done``) to the next
  generation's first event, in three parts: to ``interpreting`` (the first
  generation ends and the loop takes the call), the call, and from
  ``completed`` to the next generation's first event (the items appended,
  the prompt rendered again, its prefill: on a real model mostly prefill);
- the overhead: the call and the turnaround minus the sandbox alone.

The tiny model's weights are random: its code is gibberish, so a run is
Python starting and refusing it (what a short cell costs), and about half
its forced calls leave the code string open and never run; those are
retried, and counted.

``python -m bench.tool_loop [--runs 10]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.config import Config  # noqa: E402
from supervisor.models.demo import write_tiny_gguf  # noqa: E402
from supervisor.sandbox.containers import ContainerPool  # noqa: E402
from supervisor.sandbox.settings import sandbox_spec  # noqa: E402
from tests.sandbox_support import find_python  # noqa: E402
from tests.server import Server, running, short_tempdir  # noqa: E402

N_CTX = 8192
TOOL = {"type": "code_interpreter", "container": {"type": "auto"}}
BODY = {"model": "tiny", "input": "compute", "tools": [TOOL], "tool_choice": "required", "stream": True,
        "store": False, "max_output_tokens": 1500, "parallel_tool_calls": False}
TRIES_PER_RUN = 12


@dataclass(frozen=True)
class Through:
    """One forced call through gpuvisor, by the client's clock (seconds)."""

    code: str
    to_run: float  # code.done -> interpreting
    in_call: float  # interpreting -> completed
    to_next: float  # completed -> the next generation's first event
    input_tokens: int  # both generations' prompts together

    @property
    def turnaround(self) -> float:
        return self.to_run + self.in_call + self.to_next


def _stream_once(http: httpx.Client, url: str) -> Through | None:
    """One streamed response; None when its call never ran."""
    seen: dict[str, float] = {}
    code = None
    call_id = None
    input_tokens = 0
    with http.stream("POST", url, json=BODY) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            ev: dict[str, Any] = json.loads(line[6:])
            kind = ev["type"]
            if kind == "response.code_interpreter_call_code.done" and call_id is None:
                call_id, code = ev["item_id"], ev["code"]
                seen["written"] = now
            elif kind == "response.code_interpreter_call.interpreting" and ev["item_id"] == call_id:
                seen["interpreting"] = now
            elif kind == "response.code_interpreter_call.completed" and ev["item_id"] == call_id:
                seen["completed"] = now
            elif ("completed" in seen and "next" not in seen
                  and kind in ("response.output_item.added", "response.completed", "response.incomplete")):
                seen["next"] = now
            if kind in ("response.completed", "response.incomplete"):
                input_tokens = ev["response"]["usage"]["input_tokens"]
    if code is None or not {"interpreting", "completed", "next"} <= seen.keys():
        return None
    return Through(code, seen["interpreting"] - seen["written"], seen["completed"] - seen["interpreting"],
                   seen["next"] - seen["completed"], input_tokens)


def _first_prompt(http: httpx.Client, url: str) -> int:
    """The first generation's prompt, in tokens (one token generated, no call run)."""
    body = {**BODY, "stream": False, "max_output_tokens": 1}
    reply = http.post(url, json=body)
    reply.raise_for_status()
    tokens: int = reply.json()["usage"]["input_tokens"]
    return tokens


async def _alone(pool: ContainerPool, code: str) -> float:
    container = pool.create()
    try:
        started = time.perf_counter()
        await pool.run(container, code)
        return time.perf_counter() - started
    finally:
        pool.remove(container.id)


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:8.1f} ms (min {min(values) * 1000:.1f}, max {max(values) * 1000:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="calls that ran, each measured both ways")
    args = parser.parse_args()
    python, reasons = find_python()
    if python is None:
        sys.exit("no sandbox on this machine: " + "; ".join(reasons))
    models = short_tempdir("gvm")
    write_tiny_gguf(models / "tiny.gguf", n_ctx=N_CTX)
    env = {"GPUVISOR_N_CTX": str(N_CTX), "GPUVISOR_CODE_INTERPRETER": "true",
           "GPUVISOR_CODE_INTERPRETER_PYTHON": python, "GPUVISOR_HOSTED_MAX_ITERATIONS": "2",
           "GPUVISOR_CODE_INTERPRETER_MAX_CONTAINERS": "1000"}
    with running(Server(models, env=env, model="tiny")) as srv:
        # The sandbox as the service builds it from its settings.
        cfg = Config(state_dir=str(srv.state_dir), models_dir=str(models), code_interpreter=True,
                     code_interpreter_python=python)
        pool = ContainerPool(short_tempdir("gvbc"), sandbox_spec(cfg))
        through: list[Through] = []
        alone: list[float] = []
        tries = 0
        with httpx.Client(timeout=300) as http:
            url = f"{srv.base_url}/v1/responses"
            _stream_once(http, url)  # warm: the model loaded, the first container made
            first_prompt = _first_prompt(http, url)
            while len(through) < args.runs:
                tries += 1
                if tries > args.runs * TRIES_PER_RUN:
                    sys.exit(f"only {len(through)} of {tries} forced calls ran")
                got = _stream_once(http, url)
                if got is None:
                    continue
                through.append(got)
                alone.append(asyncio.run(_alone(pool, got.code)))
        pool.close()
    in_call = [t.in_call - a for t, a in zip(through, alone, strict=True)]
    turnaround = [t.turnaround - a for t, a in zip(through, alone, strict=True)]
    print(f"tool-loop overhead per iteration, {len(through)} forced code_interpreter calls "
          f"({tries} tried, {tries - len(through)} left their code unfinished), medians:")
    rows = [
        ("sandbox alone (the tool's own time)", alone),
        ("call written -> interpreting", [t.to_run for t in through]),
        ("the call (interpreting -> completed)", [t.in_call for t in through]),
        ("completed -> next generation's first event", [t.to_next for t in through]),
        ("turnaround (call written -> next generation)", [t.turnaround for t in through]),
        ("overhead in the call (the call - alone)", in_call),
        ("overhead per iteration (turnaround - alone)", turnaround),
    ]
    for label, values in rows:
        print(f"  {label:<46} {_ms(values)}")
    second = statistics.median([t.input_tokens - first_prompt for t in through])
    print(f"  the next generation's prompt: {second:.0f} tokens (the first's {first_prompt}, then the call "
          "and its logs)")
    ratio = statistics.median([t.in_call for t in through]) / statistics.median(alone)
    print(f"  ratio, call through gpuvisor / sandbox alone: {ratio:.2f}")


if __name__ == "__main__":
    main()
