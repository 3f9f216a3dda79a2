"""``/api/models``: the library with each model's worker state; load and unload;
a model worker's log."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from formats.chat_templates import TemplateFileError, builtin_name, read_template_file
from supervisor.api.adapter_views import api_adapters, base_adapters
from supervisor.api.auth import request_scope
from supervisor.api.io import decode_json, json_response, read_body
from supervisor.appkeys import CONFIG, JOB_RUNNER, LIBRARY, POOL
from supervisor.config import Config, ModelSettings
from supervisor.errors import BadRequest, Conflict, ModelNotFound
from supervisor.generation.profile import file_tool_format, served_profile
from supervisor.generation.sampling import model_sampling
from supervisor.models.hf_vision import hf_takes_images
from supervisor.models.library import ModelEntry
from supervisor.models.projector import Modalities, projector_modalities
from supervisor.models.sampling_defaults import SAMPLING_FIELDS
from supervisor.workers.drafting import describe_speculative
from supervisor.workers.handle import WorkerState, worker_log_path
from supervisor.workers.pool import WorkerPool
from worker.protocol import ModelFacts


def model_media(pool: WorkerPool, entry: ModelEntry) -> tuple[Modalities, str]:
    """Whether the model takes images and audio, and why not when its
    projector failed.

    Once its worker said hello this is what the worker reports: true only
    when the projector loaded (for an hf model: when vLLM serves it as
    multimodal). Before that, the encoders of a linked projector count (it
    loads with the model), or an hf model's vision tower in its config.json;
    one that then fails turns them false, with the reason in ``vision_error``.
    """
    handle = pool.handles.get((entry.id, False))
    facts = handle.facts if handle is not None else None
    if facts is not None:
        return Modalities(facts.vision, facts.audio), facts.vision_error
    if entry.kind == "hf":
        # An hf model's image tower is in its own weights, not a projector file.
        return Modalities(hf_takes_images(entry.path), False), ""
    if entry.mmproj is None:
        return Modalities(False, False), ""
    # A file the header reader cannot tell counts as an image projector
    # until its worker says (with the reason when it is none).
    return projector_modalities(entry.mmproj) or Modalities(True, False), ""



def describe_model(entry: ModelEntry, pool: WorkerPool, for_user: bool = False) -> dict[str, Any]:
    info = entry.info
    facts = info or entry.hf  # a GGUF header's facts, or an hf model's config
    media, vision_error = model_media(pool, entry)
    status = pool.status(entry.id)
    fit = pool.fits.get((entry.id, False))
    state = status["state"] if status else ("unloaded" if entry.usable else "unusable")
    return {
        "id": entry.id,
        "object": "model",
        "path": entry.path,
        "files": len(entry.files),
        "size_bytes": entry.size_bytes,
        "source": entry.source,
        "kind": entry.kind,
        "engine": entry.engine,
        "repo_id": entry.repo_id,
        # The cluster nodes whose own disks hold it (None: in the shared directories).
        "nodes": sorted(entry.nodes) or None,
        "mmproj": entry.mmproj,
        "projector_note": entry.projector_note,
        "vision": media.vision,
        "audio": media.audio,
        "vision_error": vision_error or None,
        "quantization": entry.quantization,
        "architecture": facts.architecture if facts else None,
        "context_length": facts.context_length if facts else None,
        "n_layer": facts.n_layer if facts else None,
        "supports_tools": bool(info and info.supports_tools),
        # How tools are offered: "native-<style>" or "generic" (generation/profile.py).
        "tool_format": _tool_format(pool, entry),
        "supports_reasoning": bool(info and info.supports_reasoning),
        "usable": entry.usable,
        "reason": (status or {}).get("reason") or entry.reason or pool.speculative.refusals.get(entry.id),
        "state": state,
        "worker": status,
        "keep_alive_expires_at": status["keep_alive_expires_at"] if status else None,
        "load": None if not status or status["load_progress"] is None else {
            "progress": status["load_progress"]},
        "fit": None if fit is None else msgspec.to_builtins(fit),
        "speculative": describe_speculative(pool.speculative, entry.id, pool.handles.get((entry.id, False))),
        # The worker's log is the machine's insides: admins only (user_view.py).
        "log_tail": None if for_user else _log_tail(pool, entry.id),
        # The LoRA adapters that fit this base, served as <id>:<adapter> (adapter_views.py).
        "adapters": base_adapters(entry),
        # What enforces JSON-schema output formats, once its worker said (null before).
        "structured_output": _structured_output(pool, entry),
        # The runaway guard, for requests that set no limit of their own.
        "limits": {"default_max_tokens": pool.cfg.default_max_tokens or None,
                   "request_timeout_s": pool.cfg.request_timeout_s or None,
                   "queue_timeout_s": pool.cfg.queue_timeout_s or None},
        # Which chat template the model is prompted with, and where it came from.
        "chat_template": chat_template_view(pool, entry, for_user),
        # What a request that leaves a sampling field out gets, and from where:
        # "config" ([model_defaults]), "model" (its file) or "default" (ours).
        "sampling": {field: {"value": s.value, "source": s.source}
                     for field, s in pool.sampling_defaults(entry.id).items()},
        # The model file's sampling keys that were not taken, with why.
        "sampling_ignored": model_sampling(entry).ignored or None,
    }


def _tool_format(pool: WorkerPool, entry: ModelEntry) -> str | None:
    """From the template its worker renders with, once it said; before, from the file's own."""
    facts = _facts(pool, entry)
    if facts is not None:
        return served_profile(facts).tool_format
    return file_tool_format(entry.info.chat_template) if entry.info else None


def _facts(pool: WorkerPool, entry: ModelEntry) -> ModelFacts | None:
    handle = pool.handles.get((entry.id, False))
    return handle.facts if handle is not None else None


def chat_template_view(pool: WorkerPool, entry: ModelEntry, for_user: bool = False) -> dict[str, Any]:
    """``source``: "override" (the model's chat_template_file setting, named
    in ``file``), "file" (the model's own), "architecture" (a built-in for
    it, named in ``name``) or "fallback" (ChatML). Before its worker loads,
    what the library can tell: null where the vocab decides (a llama GGUF
    may be Llama 2, Llama 3 or Mistral)."""
    handle = pool.handles.get((entry.id, False))
    # A worker started (or starting) runs with its own settings, maybe a load's.
    override_file = (handle.spec.chat_template_file if handle is not None
                     else pool.cfg.model_settings(entry.id).chat_template_file)
    override = str(override_file) if override_file else None
    facts = handle.facts if handle is not None else None
    if facts is not None and facts.template_source:
        source: str | None = facts.template_source
        name = facts.template_name or None
    else:
        source, name = _library_template(entry, override is not None)
    if source != "override":
        override = None
    elif override is not None and for_user:
        override = Path(override).name  # a user key sees no server paths
    return {"source": source, "name": name, "file": override}


def _library_template(entry: ModelEntry, overridden: bool) -> tuple[str | None, str | None]:
    """(source, built-in name) as the settings and the model's header tell."""
    if overridden:
        return "override", None
    own = entry.info.chat_template if entry.info else entry.hf.chat_template if entry.hf else None
    if own is not None:
        return "file", None
    architecture = entry.info.architecture if entry.info else entry.hf.model_type if entry.hf else ""
    name = builtin_name(architecture, None)
    if name is None:
        return None, None
    return ("architecture", name) if name else ("fallback", "chatml")


def _structured_output(pool: WorkerPool, entry: ModelEntry) -> str | None:
    """"llguidance" where the engine's LLGuidance accepts the model's vocab,
    "gbnf" for our fallback, "engine" for an engine's own (vLLM's)."""
    handle = pool.handles.get((entry.id, False))
    facts = handle.facts if handle is not None else None
    if facts is None:
        return None
    return facts.schema_grammar or "engine"


def _log_tail(pool: WorkerPool, model_id: str) -> str | None:
    """The worker log's last lines, kept from its last crash, while it is crashed or failed."""
    handle = pool.handles.get((model_id, False)) or pool.handles.get((model_id, True))
    if handle is None or handle.state not in (WorkerState.CRASHED, WorkerState.FAILED):
        return None
    return handle.log_tail


def _entry(request: web.Request) -> ModelEntry:
    model_id = request.match_info["id"]
    entry = request.app[LIBRARY].get(model_id)
    if entry is None:
        raise ModelNotFound(f"model '{model_id}' does not exist")
    return entry


async def list_models(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    entries = sorted(request.app[LIBRARY].list(), key=lambda e: e.id)
    for_user = request_scope(request) is not None
    return json_response({"object": "list", "data": [describe_model(e, pool, for_user) for e in entries],
                          "adapters": api_adapters(pool)})


async def get_model(request: web.Request) -> web.Response:
    return json_response(describe_model(_entry(request), request.app[POOL], request_scope(request) is not None))


async def load_model(request: web.Request) -> web.Response:
    entry = _entry(request)
    body = await read_body(request)
    options = decode_json(body, ModelSettings) if body.strip() else ModelSettings()
    if options.chat_template_file:
        path = await asyncio.to_thread(_template_file, options.chat_template_file, request.app[CONFIG])
        options = msgspec.structs.replace(options, chat_template_file=path)
    for field in SAMPLING_FIELDS:
        # Sampling is set per request or in the config, never by a load: refused, not ignored.
        if getattr(options, field) is not None:
            raise BadRequest(f"{field} is no load option: set it per request, or in "
                             f"[model_defaults.\"{entry.id}\"] in the config", param=field)
    pool = request.app[POOL]
    await pool.load(entry.id, options=options)
    return json_response(describe_model(entry, pool))


def _template_file(raw: str, cfg: Config) -> str:
    """A load's chat_template_file, resolved (a relative one in models_dir)
    and checked; a path from a request must lie in the model library's own
    folders (the config's [model_defaults] may name any)."""
    param = "chat_template_file"
    path = (Path(cfg.models_dir) / Path(raw).expanduser()).resolve()
    roots = [Path(d).resolve() for d in (cfg.models_dir, *cfg.extra_model_dirs) if d]
    if not any(path.is_relative_to(root) for root in roots):
        raise BadRequest("chat_template_file in a load must be inside models_dir or extra_model_dirs; "
                         "set another path in the model's [model_defaults] of the config", param=param)
    try:
        read_template_file(path)
    except TemplateFileError as exc:
        raise BadRequest(f"chat_template_file: {exc}", param=param) from exc
    return str(path)


async def unload_model(request: web.Request) -> web.Response:
    entry = _entry(request)
    pool = request.app[POOL]
    await pool.unload(entry.id)
    return json_response(describe_model(entry, pool))


async def delete_model(request: web.Request) -> web.Response:
    """Remove a model a download put on cluster nodes' own disks, from every
    node that holds it (supervisor/lab/node_models.py: its workers unloaded
    first; a node that holds it and cannot be reached is a 409, and nothing
    is removed). Models in the shared directories are the owner's files."""
    entry = _entry(request)
    if entry.source != "node":
        raise Conflict(f"model {entry.id} is in {entry.root or 'the models directory'}: gpuvisor removes only "
                       "models a download put on a cluster node's own disk; remove its files there",
                       code="model_not_removable")
    node_models = request.app[JOB_RUNNER].node_models
    if node_models is None:
        raise Conflict(f"model {entry.id} is held on the own disk of {', '.join(sorted(entry.nodes))}, and no "
                       "cluster is configured to reach it; nothing was removed", code="node_unreachable")
    freed = await node_models.remove(entry.id, request.app[POOL].unload)
    return json_response({"id": entry.id, "object": "model", "deleted": True, "nodes": sorted(freed),
                          "freed_bytes": sum(freed.values())})


LOG_TAIL_DEFAULT_BYTES = 64 << 10
LOG_TAIL_MAX_BYTES = 1 << 20


async def model_log(request: web.Request) -> web.Response:
    """The end of a model worker's log (stdout and stderr; admin only, see auth)."""
    entry = _entry(request)
    mode = request.query.get("mode", "generate")
    if mode not in ("generate", "embedding"):
        raise BadRequest("mode must be generate or embedding", param="mode")
    raw = request.query.get("tail", str(LOG_TAIL_DEFAULT_BYTES))
    if not raw.isdigit() or not 0 < int(raw) <= LOG_TAIL_MAX_BYTES:
        raise BadRequest(f"tail must be a byte count within 1..{LOG_TAIL_MAX_BYTES}", param="tail")
    path = worker_log_path(request.app[POOL].log_dir, entry.id, mode == "embedding")
    data = await asyncio.to_thread(_read_end, path, int(raw))
    return web.Response(body=data, content_type="text/plain", charset="utf-8")


def _read_end(path: Path, max_bytes: int) -> bytes:
    """The last ``max_bytes`` of a file from a line start; nothing when it was never written."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - max_bytes))
            data = f.read(max_bytes)
    except FileNotFoundError:
        return b""
    if size > max_bytes and b"\n" in data:
        data = data[data.index(b"\n") + 1:]
    return data


def add_routes(app: web.Application) -> None:
    # Model ids may contain '/' (sub-directories, Hub repos), so the verbs
    # are matched first and the plain GET takes the whole rest of the path.
    app.router.add_get("/api/models", list_models)
    app.router.add_post("/api/models/{id:.+}/load", load_model)
    app.router.add_post("/api/models/{id:.+}/unload", unload_model)
    app.router.add_get("/api/models/{id:.+}/log", model_log)
    app.router.add_get("/api/models/{id:.+}", get_model)
    app.router.add_delete("/api/models/{id:.+}", delete_model)
