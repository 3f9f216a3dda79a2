"""``GET /metrics`` in the Prometheus text format (prometheus_client).

Two kinds of series:
- event series kept by :class:`Metrics` (one per app, no global registry):
  HTTP requests by route and status, request durations, and per model the
  time to first token and decode speed, fed by ``WorkerPool.on_done``;
- speculative decoding per drafting worker: tokens drafted and accepted, and
  their ratio (the worker's counters, read at scrape time);
- state read at scrape time by :class:`Snapshot`: queue depth, worker state
  and restarts, loaded models, GPU lease holder and waits, jobs by status and
  job durations (over the jobs the database still retains).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from supervisor.appkeys import DB, LEASE, METRICS, POOL
from worker.protocol import Done

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
JOB_BUCKETS = (1, 10, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 24 * 3600)


def route_of(request: web.Request) -> str:
    """The route pattern, not the path: bounded label values."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


class Metrics:
    """Counters and histograms that live as long as the app."""

    def __init__(self) -> None:
        self.requests = Counter("gpuvisor_http_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=None)
        self.durations = Histogram("gpuvisor_http_request_duration_seconds",
                                   "Time to the end of the response, streams included",
                                   ["route"], buckets=HTTP_BUCKETS, registry=None)
        self.ttft = Histogram("gpuvisor_time_to_first_token_seconds",
                              "Time from the worker receiving a request to its first token",
                              ["model"], buckets=TTFT_BUCKETS, registry=None)
        self.tps = Histogram("gpuvisor_decode_tokens_per_second",
                             "Decode speed of finished generations", ["model"],
                             buckets=TPS_BUCKETS, registry=None)
        self.tokens = Counter("gpuvisor_completion_tokens", "Tokens generated", ["model"], registry=None)
        self._all = (self.requests, self.durations, self.ttft, self.tps, self.tokens)

    def collect(self) -> Iterable[Metric]:
        for metric in self._all:
            yield from metric.collect()

    def observe_done(self, model: str, done: Done) -> None:
        """A ``WorkerPool.on_done`` observer."""
        if done.completion_tokens > 0:
            self.ttft.labels(model).observe(done.prefill_s)
            self.tokens.labels(model).inc(done.completion_tokens)
        if done.decode_s > 0 and done.completion_tokens > 1:
            # The first token belongs to prefill; decode covers the rest.
            self.tps.labels(model).observe((done.completion_tokens - 1) / done.decode_s)

    def middleware(self) -> Middleware:
        clock = time.monotonic

        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            start = clock()
            status = "499"
            try:
                resp = await handler(request)
                status = str(resp.status)
                return resp
            except web.HTTPException as exc:
                status = str(exc.status)
                raise
            finally:
                route = route_of(request)
                self.requests.labels(route, request.method, status).inc()
                self.durations.labels(route).observe(clock() - start)

        return middleware


def histogram_buckets(values: Sequence[float], bounds: Sequence[float]) -> list[tuple[str, float]]:
    """Cumulative buckets for a HistogramMetricFamily."""
    ordered = sorted(values)
    out = [(_fmt(b), float(bisect.bisect_right(ordered, b))) for b in bounds]
    out.append(("+Inf", float(len(ordered))))
    return out


def _fmt(bound: float) -> str:
    return str(float(bound))


class Snapshot:
    """State read at scrape time; a collector for one scrape."""

    def __init__(self, workers: list[dict[str, Any]], lease: dict[str, Any] | None,
                 jobs: list[tuple[str, str, int]], durations: list[tuple[str, str, float]]) -> None:
        self.workers = workers
        self.lease = lease
        self.jobs = jobs
        self.durations = durations

    def collect(self) -> Iterable[Metric]:
        yield from self._workers()
        yield from self._speculative()
        if self.lease is not None:
            yield from self._lease(self.lease)
        yield from self._jobs()

    def _workers(self) -> Iterable[Metric]:
        queue = GaugeMetricFamily("gpuvisor_queue_depth", "Requests queued or in flight per model",
                                  labels=["model", "mode"])
        state = GaugeMetricFamily("gpuvisor_worker_state", "1 for the state each worker is in",
                                  labels=["model", "mode", "state"])
        restarts = CounterMetricFamily("gpuvisor_worker_restarts", "Worker restarts after a crash, by cause",
                                       labels=["model", "mode", "cause"])
        reason = GaugeMetricFamily("gpuvisor_worker_last_failure_info",
                                   "Why the worker last crashed or failed (1 while known)",
                                   labels=["model", "mode", "reason"])
        loaded = GaugeMetricFamily("gpuvisor_models_loaded", "Workers ready to serve")
        for w in self.workers:
            labels = [w["model"], w["mode"]]
            queue.add_metric(labels, int(w["queued"]) + int(w["in_flight"]))
            state.add_metric([*labels, w["state"]], 1)
            for cause, n in w["restarts_by_cause"].items():
                restarts.add_metric([*labels, cause], int(n))
            if w["reason"]:
                reason.add_metric([*labels, str(w["reason"])[:200]], 1)
        loaded.add_metric([], sum(1 for w in self.workers if w["state"] == "ready"))
        return [queue, state, restarts, reason, loaded]

    def _speculative(self) -> Iterable[Metric]:
        """Draft counters of the workers that draft, since each started."""
        labels = ["model", "speculative"]
        drafted = CounterMetricFamily("gpuvisor_speculative_draft_tokens",
                                      "Tokens drafted by speculative decoding", labels=labels)
        accepted = CounterMetricFamily("gpuvisor_speculative_accepted_tokens",
                                       "Drafted tokens the model accepted", labels=labels)
        ratio = GaugeMetricFamily("gpuvisor_speculative_acceptance_ratio",
                                  "Share of drafted tokens accepted (absent before any draft)", labels=labels)
        for w in self.workers:
            stats = w.get("stats")
            if w["mode"] != "generate" or w.get("speculative", "off") == "off" or not stats:
                continue
            key = [w["model"], w["speculative"]]
            drafted.add_metric(key, int(stats["draft_tokens"]))
            accepted.add_metric(key, int(stats["draft_accepted"]))
            if stats["draft_tokens"]:
                ratio.add_metric(key, stats["draft_accepted"] / stats["draft_tokens"])
        return [drafted, accepted, ratio]

    @staticmethod
    def _lease(snap: dict[str, Any]) -> Iterable[Metric]:
        held = GaugeMetricFamily("gpuvisor_lease_held", "1 while a job reserves or holds the device",
                                 labels=["device"])
        holder = GaugeMetricFamily("gpuvisor_lease_holder_info", "The job that holds a device",
                                   labels=["device", "job_id", "kind", "state"])
        held_for = GaugeMetricFamily("gpuvisor_lease_held_seconds", "How long the holder has held it",
                                     labels=["device"])
        waiters = GaugeMetricFamily("gpuvisor_lease_waiters", "Jobs waiting for a device")
        wait = GaugeMetricFamily("gpuvisor_lease_longest_wait_seconds", "Longest current wait for a device")
        for dev in snap["devices"]:
            h = dev["holder"]
            held.add_metric([dev["id"]], 0 if h is None else 1)
            if h is not None:
                holder.add_metric([dev["id"], h["job_id"], h["label"], h["state"]], 1)
                held_for.add_metric([dev["id"]], float(h["state_for_s"]))
        waiting = snap["waiters"]
        waiters.add_metric([], len(waiting))
        wait.add_metric([], max((float(w["waited_s"]) for w in waiting), default=0.0))
        return [held, holder, held_for, waiters, wait]

    def _jobs(self) -> Iterable[Metric]:
        jobs = GaugeMetricFamily("gpuvisor_jobs", "Jobs in the database by status and kind",
                                 labels=["status", "kind"])
        for status, kind, n in self.jobs:
            jobs.add_metric([status, kind], n)
        hist = HistogramMetricFamily("gpuvisor_job_duration_seconds",
                                     "Run time of finished jobs still retained in the database",
                                     labels=["kind", "status"])
        groups: dict[tuple[str, str], list[float]] = {}
        for kind, status, seconds in self.durations:
            groups.setdefault((kind, status), []).append(seconds)
        for (kind, status), values in sorted(groups.items()):
            hist.add_metric([kind, status], histogram_buckets(values, JOB_BUCKETS), sum(values))
        return [jobs, hist]




async def snapshot(app: web.Application) -> Snapshot:

    pool = app.get(POOL)
    lease = app.get(LEASE)
    conn = app[DB].reader
    jobs = [(r[0], r[1], int(r[2])) for r in await conn.execute_fetchall(
        "SELECT status, kind, count(*) FROM jobs GROUP BY status, kind")]
    durations = [(r[0], r[1], float(r[2])) for r in await conn.execute_fetchall(
        "SELECT kind, status, finished_at - started_at FROM jobs "
        "WHERE started_at IS NOT NULL AND finished_at IS NOT NULL")]
    return Snapshot(pool.workers() if pool is not None else [],
                    lease.snapshot() if lease is not None else None, jobs, durations)


async def metrics_handler(request: web.Request) -> web.Response:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(request.app[METRICS])
    registry.register(await snapshot(request.app))
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def observe_ctx(app: web.Application) -> AsyncIterator[None]:
    """Feeds the pool's finished generations into the histograms."""
    observer = app[METRICS].observe_done
    pool = app[POOL]
    pool.on_done.append(observer)
    yield
    pool.on_done.remove(observer)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/metrics", metrics_handler)
