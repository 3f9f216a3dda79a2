"""Typed application state keys (no module globals hold live objects)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from supervisor.config import Config
    from supervisor.db import Database
    from supervisor.models.library import ModelLibrary
    from supervisor.workers.engine_check import EngineCheck
    from supervisor.workers.pool import WorkerPool

CONFIG: web.AppKey[Config] = web.AppKey("config")
POOL: web.AppKey[WorkerPool] = web.AppKey("pool")
DB: web.AppKey[Database] = web.AppKey("db")
STARTED_AT: web.AppKey[float] = web.AppKey("started_at")
LIBRARY: web.AppKey[ModelLibrary] = web.AppKey("library")
ENGINE_CHECK: web.AppKey[EngineCheck] = web.AppKey("engine_check")
