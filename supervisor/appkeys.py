"""Every typed application state key, in one place (no module globals hold
live objects). The types are imported for checking only, so any module may
import this one without an import circle."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from supervisor.api.auth import Auth
    from supervisor.api.jobs import JobSettings
    from supervisor.api.metrics import Metrics
    from supervisor.api.shutdown import ShutdownState
    from supervisor.api.web import AssetTable
    from supervisor.config import Config
    from supervisor.db import Database
    from supervisor.knowledge.service import Knowledge
    from supervisor.lab.busy import WaitLine
    from supervisor.lab.lease import GpuLease
    from supervisor.lab.node_jobs import JobNodes
    from supervisor.lab.runner import JobRunner
    from supervisor.lab.store import JobStore
    from supervisor.models.library import ModelLibrary
    from supervisor.responses.lifecycle import ResponsesApi
    from supervisor.workers.engine_check import EngineCheck
    from supervisor.workers.pool import WorkerPool

# Wiring and models
CONFIG: web.AppKey[Config] = web.AppKey("config")
DB: web.AppKey[Database] = web.AppKey("db")
STARTED_AT: web.AppKey[float] = web.AppKey("started_at")
POOL: web.AppKey[WorkerPool] = web.AppKey("pool")
LIBRARY: web.AppKey[ModelLibrary] = web.AppKey("library")
ENGINE_CHECK: web.AppKey[EngineCheck] = web.AppKey("engine_check")

# Jobs and the device lease
LEASE: web.AppKey[GpuLease] = web.AppKey("lease")
JOB_STORE: web.AppKey[JobStore] = web.AppKey("job_store")
JOB_RUNNER: web.AppKey[JobRunner] = web.AppKey("job_runner")
JOB_SETTINGS: web.AppKey[JobSettings] = web.AppKey("job_settings")
WAIT_LINE: web.AppKey[WaitLine] = web.AppKey("wait_line")
# The cluster's nodes as the job runner sees them, when set before the app
# starts; unset, they are the Ray launcher's (with ray_address) or none. Set
# where node agents run in this process (a lab without Ray, the UI tests).
JOB_NODES: web.AppKey[JobNodes] = web.AppKey("job_nodes")

# HTTP services
AUTH: web.AppKey[Auth] = web.AppKey("auth")
METRICS: web.AppKey[Metrics] = web.AppKey("metrics")
SHUTDOWN: web.AppKey[ShutdownState] = web.AppKey("shutdown")
RESPONSES: web.AppKey[ResponsesApi] = web.AppKey("responses")
ASSETS: web.AppKey[AssetTable] = web.AppKey("web_assets")
OPENAPI_DOCUMENT: web.AppKey[bytes] = web.AppKey("openapi_document")
JOB_SCHEMA_ROUTES: web.AppKey[bool] = web.AppKey("job_schema_routes")

# Files and vector stores (supervisor/knowledge/)
KNOWLEDGE: web.AppKey[Knowledge] = web.AppKey("knowledge")
