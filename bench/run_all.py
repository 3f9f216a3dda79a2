"""Run every benchmark in bench/ and write one Markdown report (bench/REPORT.md).

Each benchmark runs as its own process (a crash or a model loaded in-process
stays there) and its output is kept verbatim; the summary table picks the key
figures out of it. Worker crash-to-ready time is measured here, against the
peer it cannot beat: loading the same model in-process (llama.cpp's server
engine, through xllamacpp, as the worker runs it).

Run: python -m bench.run_all [--runs 3] [--quick] [--out bench/REPORT.md]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.models.demo import write_tiny_gguf  # noqa: E402
from tests.server import Server, short_tempdir  # noqa: E402

# Absolute paths never go into the report.
_PATH = re.compile(r"(?<![\w.])/(?:tmp|work|home|root|var|usr|opt)/[^\s'\"]*")


@dataclass
class BenchRun:
    name: str
    command: str
    seconds: float
    returncode: int
    output: str
    summary: list[tuple[str, str]] = field(default_factory=list)
    skipped: str = ""


def scrub(text: str) -> str:
    return _PATH.sub("<path>", text)


def run_script(name: str, args: list[str], timeout: float) -> BenchRun:
    cmd = [sys.executable, *args]
    shown = "python " + " ".join(args)
    print(f"== {name}: {shown}", flush=True)
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        code, out = done.returncode, done.stdout + (f"\n[stderr]\n{done.stderr[-3000:]}" if done.returncode else "")
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        code, out = -1, partial + f"\n[timed out after {timeout:.0f} s]"
    seconds = time.monotonic() - t0
    print(scrub(out), flush=True)
    return BenchRun(name, shown, seconds, code, scrub(out))


def grab(output: str, pattern: str) -> str | None:
    found = re.search(pattern, output)
    return found.group(1) if found else None


def summarize_stream(run: BenchRun) -> None:
    out = run.output
    for label, pattern in (
        ("(a) in-process engine (xllamacpp) tok/s", r"\(a\)[^\n]*?([\d.]+) tok/s"),
        ("(b) gpuvisor HTTP SSE tok/s", r"\(b\)[^\n]*?([\d.]+) tok/s"),
        ("(c) llama.cpp server HTTP SSE (Unix socket) tok/s", r"\(c\)[^\n]*?([\d.]+) tok/s"),
        ("ratio b/a (tok/s; target >= 0.8)", r"ratio b/a \(tok/s\) = ([\d.]+)"),
        ("ratio b/c (tok/s; target >= 0.8)", r"ratio b/c \(tok/s\) = ([\d.]+)"),
        ("Responses / chat tok/s (target >= 0.95)", r"responses/chat: tok/s x([\d.]+)"),
        ("Responses / chat TTFT", r"responses/chat:.*ttft x([\d.]+)"),
    ):
        value = grab(out, pattern)
        if value is not None:
            run.summary.append((label, value))
    rss = re.search(r"parent RSS idle ([\d.]+) MiB, peak while streaming ([\d.]+) MiB", out)
    if rss is not None:
        run.summary.append(("parent RSS idle / peak while streaming (MiB)", f"{rss.group(1)} / {rss.group(2)}"))


def summarize_jobs(run: BenchRun) -> None:
    for label, pattern in (
        ("job submits/s over HTTP (ratio to target 500)", r"submits/s over HTTP\s+(\d+ .*ratio [\d.]+)"),
        ("job events/s ingested (ratio to target 5000)", r"events/s ingested\s+(\d+ .*ratio [\d.]+)"),
        ("job SSE latency", r"SSE latency ms\s+(.*)"),
    ):
        value = grab(run.output, pattern)
        if value is not None:
            run.summary.append((label, " ".join(value.split())))


def summarize_grammar(run: BenchRun) -> None:
    """First-token latency per schema and grammar, and its ratio to no schema."""
    for line in run.output.splitlines():
        found = re.match(r"(small|large) \(.*?\)\s+(GBNF|LLGuidance, \w+ schema).*?\s([\d.]+ ms)\s+([\d.]+x)", line)
        if found:
            run.summary.append((f"first token, {found[1]} schema, {found[2]}", f"{found[3]} ({found[4]} vs none)"))


def summarize_engine(run: BenchRun) -> None:
    out = run.output
    for label, pattern in (
        ("models (A: 1-3, B: 4)", r"model A: ([^;]*);[\s\S]*?model B: ([^;]*);"),
        ("1. single stream tok/s: in-process / gpuvisor",
         r"1\. single[\s\S]*?in-process engine\s+([\d.]+) tok/s[\s\S]*?gpuvisor /v1/completions SSE\s+([\d.]+) tok/s"),
        ("1. single stream gpuvisor / in-process (target >= 0.9)",
         r"single stream gpuvisor/in-process = ([\d.]+ +\(target[^)]*\))"),
        ("2. 8 streams aggregate tok/s: in-process / gpuvisor",
         r"2\. [\s\S]*?in-process engine\s+([\d.]+) tok/s aggregate[\s\S]*?SSE\s+([\d.]+) tok/s aggregate"),
        ("2. 8 streams gpuvisor / in-process (target >= 0.85)", r"streams gpuvisor/in-process = ([\d.]+ +\(target[^)]*\))"),
        ("2. batching gain, 8 streams / 1 stream", r"/ 1 stream: (gpuvisor x[\d.]+, in-process x[\d.]+)"),
        ("3. head-of-line: short ended at", r"short ended at ([^\n]*?) \(the short"),
        ("4. uncancelled prefill (s)", r"uncancelled prefill \(time to first token\)\s+(in-process\s+[\d.]+ s\s+gpuvisor\s+[\d.]+ s)"),
        ("4. slot free after a cancel (s)", r"slot free after the disconnect\s+(in-process\s+[\d.]+ s\s+gpuvisor\s+[\d.]+ s)"),
        ("4. engine progress report interval", r"progress reports every ([\d.]+ s)"),
        ("4. gpuvisor minus in-process, slot free (target <= +250 ms)", r"slot free minus in-process = ([^;]*);"),
    ):
        found = re.search(pattern, out)
        if found is not None:
            run.summary.append((label, " / ".join(" ".join(g.split()) for g in found.groups())))


def summarize_load(run: BenchRun, result_path: Path) -> None:
    if not result_path.exists():
        return
    result = json.loads(result_path.read_text())
    if "by_parallel" in result:
        for parallel, one in result["by_parallel"].items():
            _summarize_load_one(run, one, f"load, parallel {parallel}: ")
        return
    _summarize_load_one(run, result, "load: ")


def _summarize_load_one(run: BenchRun, result: dict[str, Any], prefix: str) -> None:
    rounds = result["rounds"]
    last = rounds[-1]
    ttft50 = statistics.median(r["ttft_p50_ms"] for r in rounds if r["ttft_p50_ms"] is not None)
    ttft99 = statistics.median(r["ttft_p99_ms"] for r in rounds if r["ttft_p99_ms"] is not None)
    shed = statistics.median(r["shed_rate"] for r in rounds)
    summary = [
        ("TTFT client p50 / p99 (ms, median over rounds)", f"{ttft50:.0f} / {ttft99:.0f}"),
        ("shed rate (median over rounds)", f"{shed:.1%}"),
        ("clients x rounds x seconds", f"{result['clients']} x {len(rounds)} x {result['duration_s']:.0f}"),
        ("ok requests/s per round", ", ".join(str(r["throughput_rps"]) for r in rounds)),
        ("tokens/s per round", ", ".join(str(r["tokens_per_s"]) for r in rounds)),
        ("TTFT client p50 / p99 (ms, last round)", f"{last['ttft_p50_ms']} / {last['ttft_p99_ms']}"),
        ("queue wait mean / p50~ / p99~ (ms, last round)",
         f"{last['queue_wait_mean_ms']} / {last['queue_wait_p50_ms']} / {last['queue_wait_p99_ms']}"),
        ("worker prefill mean / p50~ / p99~ (ms, last round)",
         f"{last['prefill_mean_ms']} / {last['prefill_p50_ms']} / {last['prefill_p99_ms']}"),
        ("shed at the queue bound per round",
         ", ".join(f"{r['shed_rate']:.1%} ({r['shed_503']} x 503, {r['shed_in_stream']} in-stream)" for r in rounds)),
        ("other errors", json.dumps([r["other_errors"] for r in rounds])),
        ("parent RSS before -> after each round (MiB)",
         f"{result['rss_before_mib']} -> " + ", ".join(str(r["rss_mib"]) for r in rounds)
         + f" (growth after round 1: {result['rss_growth_mib']:+.1f})"),
        ("open fds before -> after each round",
         f"{result['fds_before']} -> " + ", ".join(str(r["open_fds"]) for r in rounds)
         + f" (growth {result['fd_growth']:+d})"),
    ]
    run.summary += [(prefix + label, value) for label, value in summary]


# ---------------------------------------------------------------- crash to ready


# The crash test's worker: one slot of 1,024 tokens, one thread (tests/server.py's settings).
_CRASH_ENGINE = {"parallel": 1, "n_ctx": 1024, "threads": 1}


def _load_in_process(model: Path) -> float:
    from bench.inprocess import InProcessEngine

    with tempfile.TemporaryDirectory(prefix="gvsock", dir="/tmp") as tmp:
        t0 = time.perf_counter()
        engine = InProcessEngine(model, sock=Path(tmp) / "e.sock", **_CRASH_ENGINE)
        seconds = time.perf_counter() - t0
        engine.close()
    return seconds


def _load_in_fresh_process(model: Path) -> float:
    """A new interpreter that imports xllamacpp and loads the model into the
    engine: what any process-isolated restart must pay at least. It exits at
    once, without teardown: a Server dropped right after it was made can hang
    in its destructor (see bench/inprocess.py)."""
    code = ("import os, sys, xllamacpp; from pathlib import Path; "
            "from bench.inprocess import engine_params; "
            "s = xllamacpp.Server(engine_params(Path(sys.argv[1]), sock=Path(sys.argv[2]), "
            f"parallel={_CRASH_ENGINE['parallel']}, n_ctx={_CRASH_ENGINE['n_ctx']}, "
            f"threads={_CRASH_ENGINE['threads']})); os._exit(0)")
    with tempfile.TemporaryDirectory(prefix="gvsock", dir="/tmp") as tmp:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code, str(model), str(Path(tmp) / "e.sock")], check=True,
                       capture_output=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        seconds = time.perf_counter() - t0
    return seconds


def bench_crash_to_ready(kills: int) -> BenchRun:
    """SIGKILL the worker and time until it is ready again and until a request succeeds."""
    print("== worker crash-to-ready", flush=True)
    t_start = time.monotonic()
    model = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="gvcrash")) / "tiny.gguf")
    loads = [_load_in_process(model) for _ in range(kills)]
    cold = [_load_in_fresh_process(model) for _ in range(kills)]
    models = short_tempdir("gvcrashm")
    (models / "tiny.gguf").symlink_to(model)
    # A 1 s crash window with kills 1.5 s apart: every restart waits only the
    # minimum backoff, so samples measure the restart, not a growing backoff.
    srv = Server(models, env={"GPUVISOR_CRASH_LIMIT": "1000", "GPUVISOR_CRASH_WINDOW": "1",
                              "GPUVISOR_PARALLEL": str(_CRASH_ENGINE["parallel"])}).start()
    ready: list[float] = []
    served: list[float] = []
    try:
        backoff = float(srv.env()["GPUVISOR_RESTART_BACKOFF_MIN"])
        for _ in range(kills):
            pid = srv.kill_worker()
            t0 = time.perf_counter()
            srv.wait_worker(lambda w: w["state"] == "ready" and w["pid"] != pid, timeout=60)
            ready.append(time.perf_counter() - t0)
            r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
                "model": srv.model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
            r.raise_for_status()
            served.append(time.perf_counter() - t0)
            time.sleep(1.5)  # past the crash window
    finally:
        srv.stop(signal.SIGTERM)
        srv.cleanup()
    ready_s, served_s, load_s = statistics.median(ready), statistics.median(served), statistics.median(loads)
    cold_s = statistics.median(cold)
    restart_s = ready_s - backoff
    lines = [
        f"worker crash-to-ready: {kills} SIGKILLs, restart backoff minimum {backoff} s",
        f"  SIGKILL -> worker ready (median)        {ready_s * 1000:8.1f} ms",
        f"  SIGKILL -> first request served         {served_s * 1000:8.1f} ms",
        f"  ready minus the backoff wait            {restart_s * 1000:8.1f} ms",
        f"  peer: fresh python + import + load      {cold_s * 1000:8.1f} ms",
        f"  peer: in-process model load only        {load_s * 1000:8.1f} ms",
        f"  ratio (ready - backoff) / fresh-process load = {restart_s / cold_s:.2f}",
    ]
    out = "\n".join(lines)
    print(out, flush=True)
    run = BenchRun("worker crash-to-ready", "bench.run_all (built in)", time.monotonic() - t_start, 0, out)
    run.summary = [
        ("crash -> worker ready (median ms)", f"{ready_s * 1000:.0f}"),
        ("crash -> first request served (median ms)", f"{served_s * 1000:.0f}"),
        ("crash -> ready minus the backoff wait (ms)", f"{restart_s * 1000:.0f}"),
        ("peer: fresh python + import xllamacpp + load (median ms)", f"{cold_s * 1000:.0f}"),
        ("peer: model load in a running process (median ms)", f"{load_s * 1000:.0f}"),
        ("ratio (crash -> ready - backoff) / fresh-process load", f"{restart_s / cold_s:.2f}"),
    ]
    return run


# ---------------------------------------------------------------- report


def machine() -> list[tuple[str, str]]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass  # not Linux: platform's answer stands
    gpu = "none (the lease manages one logical device, cpu)"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if smi.returncode == 0 and smi.stdout.strip():
            gpu = "; ".join(smi.stdout.strip().splitlines())
    except (OSError, subprocess.TimeoutExpired):
        pass  # no driver: no GPU
    from importlib import metadata

    return [
        ("CPU", cpu),
        ("cores (logical, usable)", f"{psutil.cpu_count()} ({len(os.sched_getaffinity(0))})"),
        ("RAM", f"{psutil.virtual_memory().total / 2**30:.1f} GiB"),
        ("GPU", gpu),
        ("OS", f"{platform.system()} {platform.release()}"),
        ("Python", platform.python_version()),
        ("xllamacpp (llama.cpp server engine)", metadata.version("xllamacpp")),
    ]


def write_report(path: Path, runs: list[BenchRun], started: dt.datetime, args: argparse.Namespace) -> None:
    lines = [
        "# gpuvisor benchmark report",
        "",
        f"Generated by `python -m bench.run_all --runs {args.runs}{' --quick' if args.quick else ''}` on "
        f"{started:%Y-%m-%d %H:%M} UTC (total {sum(r.seconds for r in runs) / 60:.1f} min).",
        "Absolute numbers drift on a shared machine; ratios are measured side by side in one run.",
        "All runs use random llama models (no GPU needed), so they measure gpuvisor's own overhead,",
        "not a model's speed: the tiny demo model, except in the engine benchmark, whose larger",
        "random models (shapes in its output) make the engine, not Python, set the pace.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in machine()],
        "",
        "## Summary",
        "",
        "| benchmark | figure | value |",
        "|---|---|---|",
    ]
    for run in runs:
        if run.skipped:
            lines.append(f"| {run.name} | skipped | {run.skipped} |")
            continue
        if run.returncode != 0:
            lines.append(f"| {run.name} | FAILED | exit code {run.returncode}, see its output below |")
        for label, value in run.summary:
            lines.append(f"| {run.name} | {label} | {value} |")
    lines += ["", "## Outputs", ""]
    for run in runs:
        lines += [f"### {run.name}", ""]
        if run.skipped:
            lines += [f"Skipped: {run.skipped}", ""]
            continue
        lines += [f"`{run.command}` ({run.seconds:.0f} s, exit code {run.returncode})", "", "```",
                  run.output.strip(), "```", ""]
    path.write_text(scrub("\n".join(lines)) + "\n")


def finetune_missing() -> str:
    missing = [m for m in ("torch", "transformers", "peft") if importlib.util.find_spec(m) is None]
    return f"the train extra is not installed (missing: {', '.join(missing)})" if missing else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3, help="runs per side in stream_overhead")
    ap.add_argument("--quick", action="store_true", help="smaller sizes everywhere (minutes, not tens)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "REPORT.md")
    args = ap.parse_args(argv)
    started = dt.datetime.now(dt.UTC)
    runs: list[BenchRun] = []
    tokens = "300" if args.quick else "1000"

    stream = run_script("stream overhead and Responses vs chat",
                        ["bench/stream_overhead.py", "--runs", str(args.runs), "--tokens", tokens], 1800)
    summarize_stream(stream)
    runs.append(stream)

    engine_args = ["-m", "bench.engine", "--runs", str(args.runs)] + (["--quick"] if args.quick else [])
    engine = run_script("engine: gpuvisor vs the engine in-process", engine_args, 900)
    summarize_engine(engine)
    runs.append(engine)

    grammar = run_script("grammar cost: LLGuidance vs GBNF",
                         ["-m", "bench.grammar_cost", "--runs", "10" if args.quick else "30"], 600)
    summarize_grammar(grammar)
    runs.append(grammar)

    jobs_args = ["-m", "bench.jobs"] + (["--submits", "300", "--events", "20000"] if args.quick else [])
    jobs = run_script("lab jobs", jobs_args, 900)
    summarize_jobs(jobs)
    runs.append(jobs)

    with tempfile.TemporaryDirectory(prefix="gvrunall") as tmp:
        result = Path(tmp) / "load.json"
        # Parallel slots 1 and 2 (the CPU default), one server each, rounds alternated.
        load_args = ["-m", "bench.load", "--compare-parallel", "1,2", "--json", str(result)]
        load_args += ["--duration", "8", "--rounds", "2"] if args.quick else ["--duration", "20", "--rounds", "2"]
        load = run_script("load, parallel 1 vs 2", load_args, 900)
        summarize_load(load, result)
        load.command = scrub(load.command)
        runs.append(load)

    runs.append(bench_crash_to_ready(3 if args.quick else 5))

    missing = finetune_missing()
    if not (REPO / "bench" / "finetune.py").exists():
        runs.append(BenchRun("finetune", "", 0, 0, "", skipped="bench/finetune.py is not present"))
    elif missing:
        runs.append(BenchRun("finetune", "", 0, 0, "", skipped=missing))
    else:
        ft_args = ["-m", "bench.finetune"] + (["--steps", "20", "--rounds", "1"] if args.quick else [])
        ft = run_script("finetune", ft_args, 1800)
        for what in ("whole-run", "per-step median"):
            value = grab(ft.output, rf"training tokens/s, {what}: (in-process \d+, through the job runner \d+, ratio [\d.]+)")
            if value is not None:
                ft.summary.append((f"training tok/s, {what}", value))
        value = grab(ft.output, r"conversion of the tiny model: (.*)")
        if value is not None:
            ft.summary.append(("HF -> GGUF conversion", value))
        runs.append(ft)

    write_report(args.out, runs, started, args)
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")
    return 0 if all(r.returncode == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
