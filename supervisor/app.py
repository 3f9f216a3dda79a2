"""Application wiring: middleware, routes and the resources the app owns.

Every long-lived resource is created and torn down by its own cleanup
context, so they unwind in reverse order of: database, model library (and its
watcher), GPU lease, worker pool, job runner. If one fails to start, those
before it still unwind.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web

from jobs.params import Roots
from supervisor import logs, responses
from supervisor.api import auth, metrics, openapi, proxies, shutdown, user_view, waiting
from supervisor.api import containers as routes_containers
from supervisor.api import files as routes_files
from supervisor.api import hosted_tools as routes_hosted_tools
from supervisor.api import jobs as routes_jobs
from supervisor.api import models as routes_models
from supervisor.api import openai as routes_openai
from supervisor.api import responses as routes_responses
from supervisor.api import vector_stores as routes_vector_stores
from supervisor.api import web as routes_web
from supervisor.api.io import answer_and_close, error_response, json_response
from supervisor.appkeys import (
    AUTH,
    CONFIG,
    DB,
    ENGINE_CHECK,
    JOB_NODES,
    JOB_RUNNER,
    JOB_SETTINGS,
    JOB_STORE,
    LEASE,
    LIBRARY,
    METRICS,
    POOL,
    SHUTDOWN,
    STARTED_AT,
)
from supervisor.config import Config
from supervisor.db import Database
from supervisor.errors import ApiError, BadRequest, NotFound
from supervisor.knowledge.schema import KNOWLEDGE_SCHEMA, VECTOR_BLOCKS_SCHEMA, VECTOR_STORE_EXPIRY_SCHEMA
from supervisor.lab.gpu_setup import build_lease, gpu_room
from supervisor.lab.job_schema import JOBS_NODE_SCHEMA, NODE_FILES_SCHEMA
from supervisor.lab.leftovers import remove_stale_sockets
from supervisor.lab.runner import JobRunner, RunnerSettings
from supervisor.lab.store import JOBS_OWNER_SCHEMA, JOBS_SCHEMA, JobStore
from supervisor.models import hub_cache
from supervisor.models.library import ModelLibrary
from supervisor.models.source import LibrarySource, ensure_demo_model
from supervisor.responses.hosted.settings import HostedSettings
from supervisor.responses.store import RESPONSES_OWNER_SCHEMA
from supervisor.sandbox.settings import open_pool
from supervisor.workers.engine_check import EngineCheck
from supervisor.workers.pool import WorkerPool
from supervisor.workers.ray_launcher import RayLauncher
from supervisor.workers.spec import Timing

log = logging.getLogger("gpuvisor.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Database migrations, in order; only ever append.
MIGRATIONS = [JOBS_SCHEMA, responses.RESPONSES_SCHEMA, auth.AUTH_SCHEMA, responses.RESPONSE_EVENTS_SCHEMA,
              JOBS_OWNER_SCHEMA, RESPONSES_OWNER_SCHEMA, KNOWLEDGE_SCHEMA, VECTOR_BLOCKS_SCHEMA,
              NODE_FILES_SCHEMA, VECTOR_STORE_EXPIRY_SCHEMA, JOBS_NODE_SCHEMA]  # append only


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    # logs.access_middleware (outside this one) normally assigned it already.
    request.setdefault("request_id", request.headers.get("X-Request-Id") or "req_" + secrets.token_hex(8))
    try:
        resp = await handler(request)
    except ApiError as err:
        if err.close_connection:
            return await answer_and_close(request, error_response(err))
        if auth.request_scope(request) is not None:  # a user key: no engine internals
            err = user_view.engine_error(err, request["request_id"])
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        routed: ApiError = NotFound(f"no route for {request.method} {request.path}")
        if exc.status != 404:
            routed = BadRequest(exc.reason)
            routed.status = exc.status
            routed.code = exc.reason.lower().replace(" ", "_")
        return error_response(routed)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError("internal server error"))
    if not resp.prepared:
        resp.headers.setdefault("X-Request-Id", request["request_id"])
    return resp


def timing_from(cfg: Config) -> Timing:
    return Timing(
        handshake_timeout=cfg.handshake_timeout,
        ping_interval=cfg.ping_interval,
        ping_timeout=cfg.ping_timeout,
        kill_grace=cfg.kill_grace,
        backoff_min=cfg.restart_backoff_min,
        backoff_max=cfg.restart_backoff_max,
        crash_limit=cfg.crash_limit,
        crash_window=cfg.crash_window,
        load_stall_timeout=cfg.load_stall_timeout,
        node_verdict_s=cfg.node_verdict_s,
    )


def roots_from(cfg: Config) -> Roots:
    roots = Roots(Path(cfg.models_dir), Path(cfg.datasets_dir), Path(cfg.outputs_dir))
    for d in roots.all():
        d.mkdir(parents=True, exist_ok=True)
    return roots


async def db_ctx(app: web.Application) -> AsyncIterator[None]:
    db = Database(app[CONFIG].db_path, MIGRATIONS)
    await db.open()
    app[DB] = db
    yield
    await db.close()


async def library_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    if cfg.write_demo_model:
        for written in ensure_demo_model(cfg.models_path, cfg.state_path):
            log.info("wrote a tiny random demo model to %s", written)
    dirs = [cfg.models_path, *(Path(d) for d in cfg.extra_model_dirs)]
    hub = hub_cache.resolve(cfg.hf_cache_dir)
    if hub.listed:
        log.info("listing the models of the Hugging Face cache %s", hub.path)
    library = ModelLibrary(dirs, hub.scan_dir, settle_s=cfg.library_settle_s,
                           vllm_python=cfg.vllm_python or None,
                           adapter_dirs=[Path(cfg.outputs_dir)] if cfg.outputs_dir else [])
    app[LIBRARY] = library
    stop = asyncio.Event()
    watcher = asyncio.create_task(library.watch_supervised(stop), name="library-watch")
    # Serve only once the first scan has run (a just-written file settles first).
    await asyncio.wait({watcher, asyncio.ensure_future(library.watching.wait())},
                       return_when=asyncio.FIRST_COMPLETED)
    if library.pending:
        await asyncio.wait_for(library.wait_until(lambda lib: not lib.pending), cfg.library_settle_s * 4 + 2)
    yield
    stop.set()
    await watcher


async def lease_ctx(app: web.Application) -> AsyncIterator[None]:
    """The GPU lease: the devices found at start. It holds no task of its own."""
    cfg = app[CONFIG]
    app[LEASE] = await build_lease(cfg.devices, drain_timeout=cfg.drain_timeout,
                                   settle_timeout=cfg.gpu_settle_timeout)
    yield


async def pool_ctx(app: web.Application) -> AsyncIterator[None]:
    """The worker pool (its reaper task and every worker process)."""
    cfg = app[CONFIG]
    lease = app[LEASE]
    source = LibrarySource(app[LIBRARY])
    pool = WorkerPool(source, cfg, timing_from(cfg), cfg.run_path, cfg.state_path / "logs",
                      admission=lease.worker_admission, device=lease.default_device,
                      gpus=gpu_room(lease, cfg.gpu_headroom), bookings=lease)
    lease.set_users(pool)
    # Sockets of a parent killed -9 (the state lock makes this the only one).
    await asyncio.to_thread(remove_stale_sockets, cfg.run_path, os.getpid())
    pool.start()
    app[POOL] = pool
    try:
        yield
    finally:
        await pool.stop_all()


async def runner_ctx(app: web.Application) -> AsyncIterator[None]:
    """The job runner: boot recovery, the scheduler, and every job process."""
    cfg = app[CONFIG]
    roots = roots_from(cfg)
    extra_env = {"HF_TOKEN": cfg.hf_token} if cfg.hf_token else {}
    # Downloads land in the cache the library lists (supervisor/models/hub_cache.py).
    extra_env.update(hub_cache.job_env(hub_cache.resolve(cfg.hf_cache_dir)))
    runner = JobRunner(JobStore(app[DB]), app[LEASE], RunnerSettings(
        state_dir=cfg.state_path, roots=roots, python=sys.executable,
        max_concurrent=cfg.max_concurrent_jobs or None, grace_s={},
        heartbeat_timeout_s=cfg.job_heartbeat_timeout, stop_timeout_s=cfg.job_grace_s,
        retention_s=cfg.job_retention_days * 86400, extra_env=extra_env),
        # On a cluster, jobs whose devices are a node's run there.
        nodes=app.get(JOB_NODES) or (launcher if isinstance(launcher := app[POOL].launcher, RayLauncher) else None),
        # Models downloaded into nodes' own caches: listed, and placed only where they are.
        on_node_models=app[POOL].set_node_models)
    app[JOB_STORE] = runner.store
    app[JOB_RUNNER] = runner
    if runner.node_models is not None:
        # A model on a node's own disk is checked there before a worker starts on it.
        app[POOL].room.check_held = runner.node_models.check_placed
    app[JOB_SETTINGS] = routes_jobs.JobSettings(
        roots, max_upload_bytes=cfg.max_upload_bytes, model_lookup=app[POOL].models.resolve,
        test_job_kinds=cfg.test_job_kinds)
    try:
        await runner.start()
        yield
    finally:
        # Once: the drain (on_shutdown) may have stopped it already.
        await runner.stop()


async def preload_ctx(app: web.Application) -> AsyncIterator[None]:
    """Load the configured models once everything else is up."""
    cfg = app[CONFIG]
    pool = app[POOL]
    for model_id in preload_list(cfg, pool.models):
        try:
            await pool.load(model_id)
        except ApiError as err:
            log.error("cannot preload %s: %s", model_id, err.message)
    yield


def preload_list(cfg: Config, models: LibrarySource) -> list[str]:
    """Configured preloads; with none, the only model when there is exactly one."""
    if cfg.preload:
        return list(cfg.preload)
    ids = models.model_ids()
    return ids if len(ids) == 1 else []


async def healthz(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    workers = pool.workers()
    # Alive either way (200): a failed model is "degraded", not a dead process.
    status = "degraded" if any(w["state"] == "failed" for w in workers) else "ok"
    # Whether /v1 wants a key: the API page says so. With auth on, only a
    # signed-in caller sees more than the status word (auth.py).
    auth_mode = "on" if await request.app[AUTH].enabled() else "off"
    return json_response({"status": status, "uptime_s": round(time.time() - request.app[STARTED_AT], 1),
                          "auth": auth_mode, "workers": workers})


async def readyz(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    # Ready when some model's generation worker serves, or none exists (models
    # load on demand). Not ready while generation workers exist and none
    # serves (booting, crashed, failed): an embedding worker alone does not
    # count. ``models`` gives each loaded model's own readiness.
    models = pool.readiness()
    ready = any(models.values()) or not models
    body = {"ready": ready, "models": models, "workers": pool.workers()}
    return json_response(body, status=200 if ready else 503)


async def workers(request: web.Request) -> web.Response:
    return json_response({"workers": request.app[POOL].workers()})


async def engine_check_ctx(app: web.Application) -> AsyncIterator[None]:
    check = EngineCheck()
    app[ENGINE_CHECK] = check
    check.start()
    yield
    await check.stop()


def build_app(cfg: Config) -> web.Application:
    gate = auth.Auth.from_config(cfg)
    stats = metrics.Metrics()
    # Outermost first: the real client (proxies), then the request id and
    # access log, metrics, typed errors, the Host allowlist, refusal while
    # draining, auth, JSON-only bodies (after auth: 401 before 415), and the
    # job named in a 503 gpu_busy.
    app = web.Application(middlewares=[
        proxies.TrustedProxies.from_config(cfg).middleware(), logs.access_middleware(cfg.access_log),
        stats.middleware(), error_middleware, proxies.HostAllowlist.from_config(cfg).middleware(),
        shutdown.refuse_while_draining, gate.middleware(), auth.require_json, waiting.describe_busy,
    ], client_max_size=cfg.max_body_bytes)
    app[CONFIG] = cfg
    app[STARTED_AT] = time.time()
    app[AUTH] = gate
    app[METRICS] = stats
    app[SHUTDOWN] = shutdown.ShutdownState()
    app.cleanup_ctx.extend([db_ctx, library_ctx, lease_ctx, pool_ctx, runner_ctx, preload_ctx,
                           engine_check_ctx])
    # After the contexts that provide the database and the pool.
    routes_responses.setup(app, retention_s=cfg.responses_retention_days * 86400,
                           keepalive_s=cfg.responses_keepalive_s, hosted=HostedSettings(
                               mcp_allowed_urls=tuple(cfg.mcp_allowed_urls),
                               max_iterations=cfg.hosted_max_iterations,
                               call_timeout_s=cfg.hosted_call_timeout_s,
                               total_timeout_s=cfg.hosted_total_timeout_s,
                               suppress_duplicates=cfg.hosted_suppress_duplicates,
                               web_search_url=cfg.web_search_searxng_url,
                               web_search_max_results=cfg.web_search_max_results,
                               web_search_timeout_s=cfg.web_search_timeout_s),
                           open_containers=functools.partial(open_pool, cfg))
    app.cleanup_ctx.extend([auth.keys_ctx, metrics.observe_ctx, routes_vector_stores.knowledge_ctx])
    app.on_response_prepare.extend([logs.add_request_id, auth.security_headers])
    app.on_shutdown.append(shutdown.drain)
    metrics.add_routes(app)
    auth.add_routes(app)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/api/workers", workers)
    routes_openai.add_routes(app)
    routes_files.add_routes(app)
    routes_vector_stores.add_routes(app)
    routes_containers.add_routes(app)
    routes_hosted_tools.add_routes(app)
    routes_jobs.add_routes(app)
    waiting.setup(app)  # before the models routes: their plain GET takes the whole path
    routes_models.add_routes(app)
    routes_web.add_routes(app)
    openapi.add_routes(app)
    return app
