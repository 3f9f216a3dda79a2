"""Application wiring: middleware, routes and the resources the app owns.

Every long-lived resource (database, worker pool) is created and torn down by
a cleanup context, so they unwind in reverse order of creation.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from supervisor import routes_openai, routes_web
from supervisor.config import Config
from supervisor.errors import ApiError, BadRequest, NotFound
from supervisor.handle import Timing
from supervisor.httputil import error_response, json_response
from supervisor.keys import CONFIG, POOL, STARTED_AT
from supervisor.models_dir import ModelsDir, ensure_demo_model
from supervisor.pool import WorkerPool

log = logging.getLogger("gpuvisor.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request["request_id"] = request.headers.get("X-Request-Id") or "req_" + secrets.token_hex(8)
    try:
        resp = await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err: ApiError = NotFound(f"no route for {request.method} {request.path}")
        if exc.status != 404:
            err = BadRequest(exc.reason)
            err.status = exc.status
            err.code = exc.reason.lower().replace(" ", "_")
        return error_response(err)
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
    )


def preload_list(cfg: Config, models: ModelsDir) -> list[str]:
    """Configured preloads; with none, the only model when there is exactly one."""
    if cfg.preload:
        return list(cfg.preload)
    ids = models.model_ids()
    return ids if len(ids) == 1 else []


async def pool_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    if cfg.write_demo_model:
        written = ensure_demo_model(cfg.models_path, cfg.state_path)
        if written is not None:
            log.info("wrote the tiny random demo model to %s", written)
    models = ModelsDir(cfg.models_path)
    pool = WorkerPool(models, cfg, timing_from(cfg), cfg.run_path, cfg.state_path / "logs")
    app[POOL] = pool
    for model_id in preload_list(cfg, models):
        try:
            await pool.load(model_id)
        except ApiError as err:
            log.error("cannot preload %s: %s", model_id, err.message)
    yield
    await pool.stop_all()


async def healthz(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    return json_response({"status": "ok", "uptime_s": round(time.time() - request.app[STARTED_AT], 1),
                          "workers": pool.workers()})


async def readyz(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    configured = bool(pool.models.model_ids())
    ready = pool.any_ready() or not configured
    body = {"ready": ready, "workers": pool.workers()}
    return json_response(body, status=200 if ready else 503)


async def workers(request: web.Request) -> web.Response:
    return json_response({"workers": request.app[POOL].workers()})


def build_app(cfg: Config) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=cfg.max_body_bytes)
    app[CONFIG] = cfg
    app[STARTED_AT] = time.time()
    app.cleanup_ctx.append(pool_ctx)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/api/workers", workers)
    routes_openai.add_routes(app)
    routes_web.add_routes(app)
    return app
