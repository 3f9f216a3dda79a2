"""Load test: many concurrent clients mixing streamed chat, streamed Responses
and job submissions against one real server, for a fixed time, in rounds.

Reports per round: requests/s by kind, tokens/s, time to first token (p50,
p99) as the client sees it and split into queue wait and worker prefill, the
503 shed rate at the queue bound, and the parent's RSS and open file
descriptors after each round (growth across rounds would be a leak).

The worker prefill comes from the server's own histogram
(``gpuvisor_time_to_first_token_seconds``: worker receipt -> first token), so
the mean queue wait (client TTFT - worker prefill) is exact over the same
finished generations; its quantiles are estimated from the histogram buckets.

Run: python -m bench.load [--clients 200] [--duration 30] [--rounds 3] [--parallel N]
     python -m bench.load --compare-parallel 1,2   (one server per value, rounds alternated)
     python -m bench.load --smoke        (about 10 s, used by the test suite)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.models.demo import write_tiny_gguf  # noqa: E402
from tests.server import Server, short_tempdir  # noqa: E402

TTFT_METRIC = "gpuvisor_time_to_first_token_seconds"
MIX: dict[str, float] = {"chat": 0.45, "responses": 0.35, "job": 0.20}


@dataclass
class Sample:
    kind: str
    status: int  # HTTP status; 0 = transport error or timeout
    ttft: float | None = None
    tokens: int = 0
    error: str = ""


@dataclass
class RoundResult:
    round: int
    seconds: float
    requests: dict[str, int]
    ok: dict[str, int]
    shed_503: int
    # Responses streams refused at the queue bound: 200, then response.failed (queue_full).
    shed_in_stream: int
    shed_rate: float
    other_errors: dict[str, int]
    throughput_rps: float
    tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    prefill_p50_ms: float | None
    prefill_p99_ms: float | None
    prefill_mean_ms: float | None
    queue_wait_mean_ms: float | None
    queue_wait_p50_ms: float | None
    queue_wait_p99_ms: float | None
    rss_mib: float
    open_fds: int


@dataclass
class LoadReport:
    clients: int
    duration_s: float
    rss_before_mib: float
    fds_before: int
    rounds: list[RoundResult] = field(default_factory=list)

    @property
    def rss_growth_mib(self) -> float:
        # From the end of the first round: that one includes warm-up allocations.
        return self.rounds[-1].rss_mib - self.rounds[0].rss_mib if self.rounds else 0.0

    @property
    def fd_growth(self) -> int:
        return self.rounds[-1].open_fds - self.fds_before if self.rounds else 0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rss_growth_mib"] = self.rss_growth_mib
        out["fd_growth"] = self.fd_growth
        return out


# ---------------------------------------------------------------- clients


async def _sse_lines(resp: aiohttp.ClientResponse) -> Any:
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line.startswith("data: "):
            yield line[6:]


async def chat(http: aiohttp.ClientSession, base: str, model: str, rng: random.Random) -> Sample:
    body = {"model": model, "stream": True, "max_tokens": rng.randint(16, 96), "temperature": 0.8,
            "messages": [{"role": "user", "content": "write a line of a poem"}],
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    async with http.post(base + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return Sample("chat", resp.status, error=await _code(resp))
        sample = Sample("chat", 200)
        async for data in _sse_lines(resp):
            if data == "[DONE]":
                return sample
            obj = json.loads(data)
            if "error" in obj:
                return Sample("chat", 200, error="stream:" + str(obj["error"].get("code")))
            if sample.ttft is None and obj["choices"] and obj["choices"][0]["delta"].get("content"):
                sample.ttft = time.perf_counter() - t0
            if obj.get("usage"):
                sample.tokens = int(obj["usage"]["completion_tokens"])
    return Sample("chat", 200, error="stream ended without [DONE]")


async def responses(http: aiohttp.ClientSession, base: str, model: str, rng: random.Random) -> Sample:
    body = {"model": model, "stream": True, "input": "write a line of a poem", "temperature": 0.8,
            "max_output_tokens": rng.randint(16, 96), "store": rng.random() < 0.5}
    t0 = time.perf_counter()
    async with http.post(base + "/v1/responses", json=body) as resp:
        if resp.status != 200:
            return Sample("responses", resp.status, error=await _code(resp))
        sample = Sample("responses", 200)
        async for data in _sse_lines(resp):
            obj = json.loads(data)
            kind = obj.get("type")
            if kind == "response.output_text.delta" and sample.ttft is None:
                sample.ttft = time.perf_counter() - t0
            elif kind in ("response.completed", "response.incomplete"):
                sample.tokens = int((obj["response"].get("usage") or {}).get("output_tokens", 0))
                return sample
            elif kind == "response.failed":
                code = ((obj.get("response") or {}).get("error") or {}).get("code")
                # A refused generation arrives inside the 200 stream: a shed all the same.
                return Sample("responses", 200, error=f"stream:{kind}:{code}")
            elif kind == "error":
                return Sample("responses", 200, error=f"stream:error:{obj.get('code')}")
    return Sample("responses", 200, error="stream ended without a terminal event")


async def job(http: aiohttp.ClientSession, base: str, rng: random.Random) -> Sample:
    # No device: a job holding the lease would refuse all inference meanwhile.
    body = {"kind": "sleep", "params": {"steps": 2, "step_seconds": 0.01, "use_device": False,
                                        "tag": f"load-{rng.random():.6f}"}}
    async with http.post(base + "/api/jobs", json=body) as resp:
        await resp.read()
        return Sample("job", resp.status, error="" if resp.status in (200, 201) else str(resp.status))


async def _code(resp: aiohttp.ClientResponse) -> str:
    try:
        return str((await resp.json(content_type=None))["error"]["code"])
    except (ValueError, KeyError, TypeError, aiohttp.ContentTypeError):
        return f"http {resp.status}"


async def client(http: aiohttp.ClientSession, base: str, model: str, seed: int, until: float,
                 out: list[Sample]) -> None:
    rng = random.Random(seed)
    kinds, weights = list(MIX), list(MIX.values())
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        kind = rng.choices(kinds, weights)[0]
        try:
            if kind == "chat":
                sample = await chat(http, base, model, rng)
            elif kind == "responses":
                sample = await responses(http, base, model, rng)
            else:
                sample = await job(http, base, rng)
        except (aiohttp.ClientError, TimeoutError) as exc:
            sample = Sample(kind, 0, error=f"{type(exc).__name__}: {exc}")
        out.append(sample)
        if sample.status == 503 or sample.error.endswith(":queue_full") or kind == "job":
            # A shed client backs off briefly, as a real one would.
            await asyncio.sleep(rng.uniform(0.05, 0.3))


# ---------------------------------------------------------------- server-side numbers


def parse_histogram(text: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets, sum, count) of a Prometheus histogram, all labels summed."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name.endswith("_sum"):
                total += s.value
            elif s.name.endswith("_count"):
                count += s.value
    return sorted(buckets.items()), total, count


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Linear interpolation inside the bucket holding quantile q (as Prometheus does)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            width = n - prev_n
            return prev_le + (le - prev_le) * ((rank - prev_n) / width if width else 1.0)
        prev_le, prev_n = le, n
    return prev_le


async def scrape(http: aiohttp.ClientSession, base: str) -> tuple[list[tuple[float, float]], float, float] | None:
    async with http.get(base + "/metrics") as resp:
        if resp.status != 200:
            return None  # metrics not served: no server-side split
        return parse_histogram(await resp.text(), TTFT_METRIC)


def diff_hist(after: tuple[list[tuple[float, float]], float, float],
              before: tuple[list[tuple[float, float]], float, float] | None
              ) -> tuple[list[tuple[float, float]], float, float]:
    if before is None:
        return after
    old = dict(before[0])
    return ([(le, n - old.get(le, 0.0)) for le, n in after[0]], after[1] - before[1], after[2] - before[2])


# ---------------------------------------------------------------- rounds


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


async def cancel_leftover_jobs(http: aiohttp.ClientSession, base: str) -> None:
    """Queued jobs from one round must not weigh on the next."""
    while True:
        async with http.get(base + "/api/jobs?status=queued,running&limit=500") as resp:
            jobs = (await resp.json())["data"]
        if not jobs:
            return
        for j in jobs:
            async with http.post(f"{base}/api/jobs/{j['id']}/cancel") as resp:
                await resp.read()


async def one_round(n: int, base: str, model: str, clients: int, duration: float,
                    parent: psutil.Process) -> RoundResult:
    timeout = aiohttp.ClientTimeout(total=120, sock_read=60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        before = await scrape(http, base)
        samples: list[Sample] = []
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        until = t0 + duration
        await asyncio.gather(*(client(http, base, model, n * 100_000 + i, until, samples)
                               for i in range(clients)))
        seconds = loop.time() - t0
        after = await scrape(http, base)
        await cancel_leftover_jobs(http, base)
    return summarize(n, samples, seconds, None if after is None else diff_hist(after, before), parent)


def summarize(n: int, samples: list[Sample], seconds: float,
              hist: tuple[list[tuple[float, float]], float, float] | None,
              parent: psutil.Process) -> RoundResult:
    requests = Counter(s.kind for s in samples)
    ok = Counter(s.kind for s in samples if s.status in (200, 201) and not s.error)
    shed = sum(1 for s in samples if s.status == 503)
    shed_in_stream = sum(1 for s in samples if s.error.endswith(":queue_full"))
    others = Counter(s.error or str(s.status) for s in samples
                     if (s.status not in (200, 201, 503) or (s.status in (200, 201) and s.error))
                     and not s.error.endswith(":queue_full"))
    ttfts = [s.ttft for s in samples if s.ttft is not None and not s.error]
    prefill_p50 = prefill_p99 = prefill_mean = None
    wait_mean = wait_p50 = wait_p99 = None
    if hist is not None and hist[2] > 0:
        prefill_p50 = bucket_quantile(hist[0], 0.5)
        prefill_p99 = bucket_quantile(hist[0], 0.99)
        prefill_mean = hist[1] / hist[2]
        if ttfts:
            wait_mean = max(0.0, statistics.fmean(ttfts) - prefill_mean)
            p50, p99 = quantile(ttfts, 0.5), quantile(ttfts, 0.99)
            wait_p50 = None if p50 is None or prefill_p50 is None else max(0.0, p50 - prefill_p50)
            wait_p99 = None if p99 is None or prefill_p99 is None else max(0.0, p99 - prefill_p99)
    return RoundResult(
        round=n, seconds=round(seconds, 2), requests=dict(requests), ok=dict(ok), shed_503=shed,
        shed_in_stream=shed_in_stream, shed_rate=round((shed + shed_in_stream) / max(1, len(samples)), 4),
        other_errors=dict(others),
        throughput_rps=round(sum(ok.values()) / seconds, 1),
        tokens_per_s=round(sum(s.tokens for s in samples if not s.error) / seconds, 1),
        ttft_p50_ms=_ms(quantile(ttfts, 0.5)), ttft_p99_ms=_ms(quantile(ttfts, 0.99)),
        prefill_p50_ms=_ms(prefill_p50), prefill_p99_ms=_ms(prefill_p99), prefill_mean_ms=_ms(prefill_mean),
        queue_wait_mean_ms=_ms(wait_mean), queue_wait_p50_ms=_ms(wait_p50), queue_wait_p99_ms=_ms(wait_p99),
        rss_mib=round(parent.memory_info().rss / 2**20, 1), open_fds=parent.num_fds(),
    )


async def settled_fds(parent: psutil.Process, baseline: int, timeout: float = 10.0) -> int:
    """Open fds once they stop exceeding the baseline (or after ``timeout``)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (fds := parent.num_fds()) > baseline and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    return int(fds)


async def run_load(base: str, model: str, parent: psutil.Process, clients: int, duration: float,
                   rounds: int) -> LoadReport:
    report = LoadReport(clients, duration, round(parent.memory_info().rss / 2**20, 1), parent.num_fds())
    for n in range(1, rounds + 1):
        result = await one_round(n, base, model, clients, duration, parent)
        # The server closes its side of the clients' connections and reaps
        # cancelled jobs on its own time: count fds once that has settled.
        result.open_fds = await settled_fds(parent, report.fds_before)
        report.rounds.append(result)
        print_round(result)
    return report


def print_round(r: RoundResult) -> None:
    print(f"  round {r.round}: {r.throughput_rps} ok req/s ({r.ok}), {r.tokens_per_s} tok/s, "
          f"shed {r.shed_rate:.1%} ({r.shed_503} as 503, {r.shed_in_stream} in-stream), other errors {r.other_errors or 'none'}")
    print(f"    TTFT client p50 {r.ttft_p50_ms} ms p99 {r.ttft_p99_ms} ms | worker prefill p50 "
          f"{r.prefill_p50_ms} p99 {r.prefill_p99_ms} mean {r.prefill_mean_ms} | queue wait mean "
          f"{r.queue_wait_mean_ms} p50~{r.queue_wait_p50_ms} p99~{r.queue_wait_p99_ms} ms")
    print(f"    parent RSS {r.rss_mib} MiB, open fds {r.open_fds}")


def start_server(queue_limit: int, parallel: int | None = None) -> Server:
    """A server on the tiny model; ``parallel`` None = the server's default slots."""
    model = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="gvload")) / "tiny.gguf")
    models = short_tempdir("gvloadm")
    (models / "tiny.gguf").symlink_to(model)
    env = {"GPUVISOR_N_CTX": "2048", "GPUVISOR_QUEUE_LIMIT": str(queue_limit),
           "GPUVISOR_MAX_CONCURRENT_JOBS": "2", "GPUVISOR_ACCESS_LOG": "false"}
    if parallel is not None:
        env["GPUVISOR_PARALLEL"] = str(parallel)
    return Server(models, env=env).start()


# ---------------------------------------------------------------- parallel slots compared


async def run_compare(servers: dict[int, Server], clients: int, duration: float,
                      rounds: int) -> dict[int, LoadReport]:
    """One round per server in turn, the order flipped every round, so drift
    on a shared machine hits every setting alike."""
    parents = {p: psutil.Process(srv.proc.pid) for p, srv in servers.items()}  # type: ignore[union-attr]
    reports = {p: LoadReport(clients, duration, round(proc.memory_info().rss / 2**20, 1), proc.num_fds())
               for p, proc in parents.items()}
    order = list(servers)
    for n in range(1, rounds + 1):
        for p in order if n % 2 else order[::-1]:
            srv = servers[p]
            result = await one_round(n, srv.base_url, srv.model, clients, duration, parents[p])
            result.open_fds = await settled_fds(parents[p], reports[p].fds_before)
            reports[p].rounds.append(result)
            print(f"  [parallel {p}]", end="")
            print_round(result)
    return reports


def _median_of(rounds: list[RoundResult], key: str) -> float | None:
    values = [getattr(r, key) for r in rounds if getattr(r, key) is not None]
    return round(statistics.median(values), 4) if values else None


def print_compare(reports: dict[int, LoadReport]) -> None:
    print("  parallel slots side by side (median over rounds):")
    print(f"    {'parallel':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'queue wait mean ms':>19} "
          f"{'shed':>7} {'ok req/s':>9} {'tok/s':>8}")
    for p, rep in reports.items():
        shed = _median_of(rep.rounds, "shed_rate")
        print(f"    {p:>8} {_median_of(rep.rounds, 'ttft_p50_ms')!s:>12} {_median_of(rep.rounds, 'ttft_p99_ms')!s:>12} "
              f"{_median_of(rep.rounds, 'queue_wait_mean_ms')!s:>19} {(shed or 0.0):>7.1%} "
              f"{_median_of(rep.rounds, 'throughput_rps')!s:>9} {_median_of(rep.rounds, 'tokens_per_s')!s:>8}")


def compare_parallel(args: argparse.Namespace) -> dict[str, Any]:
    values = [int(v) for v in args.compare_parallel.split(",")]
    servers: dict[int, Server] = {}
    try:
        for p in values:
            servers[p] = start_server(args.queue_limit, p)
        print(f"load: {args.clients} clients, {args.rounds} rounds of {args.duration:.0f} s per setting, "
              f"parallel {values} alternated, queue limit {args.queue_limit}, mix {MIX}")
        reports = asyncio.run(run_compare(servers, args.clients, args.duration, args.rounds))
    finally:
        for srv in servers.values():
            srv.cleanup()
    print_compare(reports)
    return {"by_parallel": {str(p): rep.to_dict() for p, rep in reports.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--queue-limit", type=int, default=64)
    ap.add_argument("--parallel", type=int, help="engine slots per worker (default: the server's)")
    ap.add_argument("--compare-parallel", metavar="N,M", help="one server per slot count, rounds alternated")
    ap.add_argument("--smoke", action="store_true", help="about 10 s: 2 rounds of 4 s")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.duration, args.rounds = 4.0, 2
    if args.compare_parallel:
        result = compare_parallel(args)
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=1))
        return result
    srv = start_server(args.queue_limit, args.parallel)
    try:
        assert srv.proc is not None
        parent = psutil.Process(srv.proc.pid)
        print(f"load: {args.clients} clients, {args.rounds} rounds of {args.duration:.0f} s, "
              f"queue limit {args.queue_limit}, mix {MIX}")
        report = asyncio.run(run_load(srv.base_url, srv.model, parent, args.clients, args.duration, args.rounds))
    finally:
        srv.cleanup()
    print(f"  parent RSS {report.rss_before_mib} MiB before, growth after round 1: "
          f"{report.rss_growth_mib:+.1f} MiB; open fds {report.fds_before} before, growth {report.fd_growth:+d}")
    result = report.to_dict()
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
