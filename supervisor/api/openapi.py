"""``GET /openapi.json``: an OpenAPI 3.1 document of every route.

Request bodies are described by the very ``msgspec.Struct``s that decode
them (``msgspec.json.schema_components``), and error bodies by
:class:`supervisor.errors.ErrorEnvelope`, the Struct every error is rendered
from, so the document cannot drift from what the server validates. The route
table below names, for each (method, path), its summary, its body Struct, its
query and header parameters and its possible statuses; ``tests/test_openapi``
fails when the app registers a route this table does not document.

``HEAD`` is documented implicitly: aiohttp adds it to every ``GET``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from aiohttp import web

from jobs.kinds import job_kinds
from supervisor.api.container_files import AddFileById
from supervisor.api.containers import CreateContainer
from supervisor.api.job_estimate import EstimateBody
from supervisor.api.jobs import CancelBody, SubmitBody
from supervisor.api.openai_types import ChatRequest, CompletionRequest, EmbeddingRequest
from supervisor.api.vector_stores import AddFile, CreateStore, ModifyStore, Search
from supervisor.appkeys import OPENAPI_DOCUMENT
from supervisor.config import ModelSettings
from supervisor.errors import ErrorEnvelope
from supervisor.responses.models import CreateRequest

OPENAPI_PATH = "/openapi.json"
REF = "#/components/schemas/{name}"
_PATH_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::[^}]*)?\}")

JSON = "application/json"
SSE = "text/event-stream"

STATUS_TEXT = {
    200: "OK",
    201: "Created",
    303: "Redirect",
    304: "Not modified (ETag matched)",
    400: "Invalid request: the body, a field, a parameter or a path (`error.param` names it)",
    401: "Missing or invalid API key (only when keys or an admin token are configured)",
    403: "Refused: the key lacks the role, or a cross-site request",
    404: "Not found",
    409: "Conflict with the current state",
    413: "Request body over the size limit",
    429: "Refused for a while: this caller's requests keep crashing model workers (`crash_cooldown`); "
         "see Retry-After",
    502: "The model worker failed while serving the request",
    503: "Temporarily refused (queue full, GPU held by a job, model failed or loading); see Retry-After",
}


@dataclass(frozen=True)
class Param:
    name: str
    where: Literal["query", "header"]
    schema: Mapping[str, Any]
    description: str


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    tag: str
    # The Struct the handler decodes the JSON body into (None: no JSON body).
    body: type | None = None
    body_required: bool = True
    # A non-JSON body (form or multipart): media type and inline schema.
    form: tuple[str, Mapping[str, Any]] | None = None
    params: tuple[Param, ...] = ()
    ok: int = 200
    media: tuple[str, ...] = (JSON,)
    errors: tuple[int, ...] = ()
    path_descriptions: Mapping[str, str] = field(default_factory=dict)


def _q(name: str, schema: Mapping[str, Any], description: str) -> Param:
    return Param(name, "query", schema, description)


_INT = {"type": "integer"}
_STR = {"type": "string"}
_BOOL_TEXT = {"type": "string", "enum": ["true", "false", "1", "0"]}
_MODEL_ID = {"id": "A model id as listed by `/api/models` (may contain '/')."}
_JOB_ID = {"id": "A job id (`job_...`)."}
_RESPONSE_ID = {"response_id": "A stored response id (`resp_...`)."}
_FILE_ID = {"file_id": "A file id (`file-...`)."}
_STORE_ID = {"store_id": "A vector store id (`vs_...`)."}
_CONTAINER_ID = {"container_id": "A code_interpreter container id (`cntr_...`)."}
_CONTAINER_FILE_ID = {"file_id": "A container file id (`cfile_...`)."}
_PAGE = (
    _q("limit", {"type": "integer", "minimum": 1, "maximum": 100}, "Page size (default 20; 100 for files)."),
    _q("order", {"type": "string", "enum": ["asc", "desc"]}, "By creation time (default desc)."),
    _q("after", _STR, "The id to list after."),
)
_INFERENCE_ERRORS = (400, 404, 413, 429, 502, 503)
_NO_BODY = (303, 304)

ROUTES: tuple[Operation, ...] = (
    # ---------------------------------------------------------- OpenAI-compatible
    Operation("GET", "/v1/models", "List the models of the library with their worker state", "openai"),
    Operation("POST", "/v1/chat/completions", "Chat completion (streamed as SSE with `stream: true`)",
              "openai", body=ChatRequest, media=(JSON, SSE), errors=_INFERENCE_ERRORS),
    Operation("POST", "/v1/completions", "Text completion (streamed as SSE with `stream: true`)",
              "openai", body=CompletionRequest, media=(JSON, SSE), errors=_INFERENCE_ERRORS),
    Operation("POST", "/v1/embeddings", "Embeddings of one or more inputs", "openai",
              body=EmbeddingRequest, errors=_INFERENCE_ERRORS),
    Operation("POST", "/v1/responses", "Create a response (Responses API); streamed as SSE with `stream: true`",
              "responses", body=CreateRequest, media=(JSON, SSE), errors=_INFERENCE_ERRORS),
    Operation("GET", "/v1/responses/{response_id}", "Retrieve a stored response, or stream a background one's events",
              "responses", params=(
                  _q("stream", _BOOL_TEXT, "Stream a background response's stored and further events (SSE)."),
                  _q("starting_after", {"type": "integer", "minimum": -1, "maximum": 2**63 - 1},
                     "With stream: the sequence number after which events start (default -1: all)."),
              ), media=(JSON, SSE), errors=(400, 404), path_descriptions=_RESPONSE_ID),
    Operation("DELETE", "/v1/responses/{response_id}", "Delete a stored response", "responses",
              errors=(404,), path_descriptions=_RESPONSE_ID),
    Operation("GET", "/v1/responses/{response_id}/input_items", "List the input items of a stored response",
              "responses", params=(
                  _q("after", _STR, "Item id to list after."),
                  _q("limit", {"type": "integer", "minimum": 1, "maximum": 100}, "Page size (default 20)."),
                  _q("order", {"type": "string", "enum": ["asc", "desc"]}, "Sort order (default desc)."),
              ), errors=(400, 404), path_descriptions=_RESPONSE_ID),
    Operation("POST", "/v1/responses/{response_id}/cancel", "Cancel a background response", "responses",
              errors=(400, 404, 409), path_descriptions=_RESPONSE_ID),
    # ---------------------------------------------------------- files and vector stores
    Operation("POST", "/v1/files", "Upload a file (multipart fields `file` and `purpose`)", "files",
              form=("multipart/form-data", {"type": "object", "required": ["file", "purpose"], "properties": {
                  "file": {"type": "string", "format": "binary"},
                  "purpose": {"type": "string", "enum": ["assistants", "user_data"]}}}),
              errors=(400, 413)),
    Operation("GET", "/v1/files", "List files, newest first", "files", params=(
        _q("purpose", _STR, "Only files of this purpose."), *_PAGE), errors=(400, 404)),
    Operation("GET", "/v1/files/{file_id}", "Retrieve a file", "files", errors=(400, 404), path_descriptions=_FILE_ID),
    Operation("GET", "/v1/files/{file_id}/content", "A file's bytes", "files", media=("application/octet-stream",),
              errors=(400, 404), path_descriptions=_FILE_ID),
    Operation("DELETE", "/v1/files/{file_id}", "Delete a file (and take it out of every vector store)", "files",
              errors=(400, 404), path_descriptions=_FILE_ID),
    Operation("POST", "/v1/vector_stores", "Create a vector store, optionally with files", "vector_stores",
              body=CreateStore, errors=(400, 404, 409)),
    Operation("GET", "/v1/vector_stores", "List vector stores, newest first", "vector_stores", params=_PAGE,
              errors=(400, 404)),
    Operation("GET", "/v1/vector_stores/{store_id}", "Retrieve a vector store", "vector_stores",
              errors=(400, 404), path_descriptions=_STORE_ID),
    Operation("POST", "/v1/vector_stores/{store_id}", "Modify a vector store: name, metadata, expires_after "
              "(a field left out stays; null clears it)", "vector_stores", body=ModifyStore,
              errors=(400, 404, 413), path_descriptions=_STORE_ID),
    Operation("DELETE", "/v1/vector_stores/{store_id}", "Delete a vector store and its chunks", "vector_stores",
              errors=(400, 404), path_descriptions=_STORE_ID),
    Operation("POST", "/v1/vector_stores/{store_id}/files", "Add a file to a vector store (indexed in the background)",
              "vector_stores", body=AddFile, errors=(400, 404, 409), path_descriptions=_STORE_ID),
    Operation("GET", "/v1/vector_stores/{store_id}/files", "List a vector store's files", "vector_stores", params=(
        _q("filter", {"type": "string", "enum": ["in_progress", "completed", "failed", "cancelled"]},
           "Only files of this status."), *_PAGE), errors=(400, 404), path_descriptions=_STORE_ID),
    Operation("GET", "/v1/vector_stores/{store_id}/files/{file_id}", "Retrieve a vector store's file",
              "vector_stores", errors=(400, 404), path_descriptions={**_STORE_ID, **_FILE_ID}),
    Operation("DELETE", "/v1/vector_stores/{store_id}/files/{file_id}",
              "Take a file out of a vector store (its chunks go, the file stays)", "vector_stores",
              errors=(400, 404), path_descriptions={**_STORE_ID, **_FILE_ID}),
    Operation("POST", "/v1/vector_stores/{store_id}/search", "Search a vector store (hybrid: embeddings and words)",
              "vector_stores", body=Search, errors=(400, 404, 409, 502, 503), path_descriptions=_STORE_ID),
    # ---------------------------------------------------------- code_interpreter containers
    Operation("POST", "/v1/containers", "Create a container (name, file_ids copied from /v1/files, expires_after "
              "in minutes up to code_interpreter_idle_s, memory_limit)", "containers", body=CreateContainer,
              errors=(400, 409, 413)),
    Operation("GET", "/v1/containers", "List the key's containers, newest first", "containers",
              params=(*_PAGE, _q("name", _STR, "Only containers of this name.")), errors=(400,)),
    Operation("GET", "/v1/containers/{container_id}", "Retrieve a container", "containers", errors=(400, 404),
              path_descriptions=_CONTAINER_ID),
    Operation("DELETE", "/v1/containers/{container_id}", "Delete a container and its files", "containers",
              errors=(400, 404, 409), path_descriptions=_CONTAINER_ID),
    Operation("POST", "/v1/containers/{container_id}/files", "Put a file in a container: upload it (multipart "
              "field `file`) or copy one of the key's files (JSON `file_id`)", "containers", body=AddFileById,
              form=("multipart/form-data", {"type": "object", "required": ["file"], "properties": {
                  "file": {"type": "string", "format": "binary"}}}),
              errors=(400, 404, 409, 413), path_descriptions=_CONTAINER_ID),
    Operation("DELETE", "/v1/containers/{container_id}/files/{file_id}", "Delete a container's file",
              "containers", errors=(400, 404), path_descriptions={**_CONTAINER_ID, **_CONTAINER_FILE_ID}),
    Operation("GET", "/v1/containers/{container_id}/files", "List a container's files (oldest first with asc)",
              "containers", params=_PAGE, errors=(400, 404), path_descriptions=_CONTAINER_ID),
    Operation("GET", "/v1/containers/{container_id}/files/{file_id}", "Retrieve a container's file", "containers",
              errors=(400, 404), path_descriptions={**_CONTAINER_ID, **_CONTAINER_FILE_ID}),
    Operation("GET", "/v1/containers/{container_id}/files/{file_id}/content", "A container file's bytes",
              "containers", media=("application/octet-stream",), errors=(400, 404),
              path_descriptions={**_CONTAINER_ID, **_CONTAINER_FILE_ID}),
    # ---------------------------------------------------------- lab: jobs
    Operation("POST", "/api/jobs", "Submit a job; `params` follow the kind's schema", "jobs",
              body=SubmitBody, ok=201, errors=(400, 413, 503)),
    Operation("GET", "/api/jobs", "List jobs, newest first", "jobs", params=(
        _q("status", _STR, "Comma-separated statuses (queued, running, succeeded, failed, cancelled, interrupted)."),
        _q("kind", _STR, "Only jobs of this kind."),
        _q("limit", {"type": "integer", "minimum": 1, "maximum": 500}, "Page size (default 50)."),
        _q("cursor", _STR, "`next_cursor` of the previous page."),
    ), errors=(400,)),
    Operation("GET", "/api/jobs/schema", "JSON Schema of each job kind's params", "jobs"),
    Operation("POST", "/api/jobs/estimate", "A fine-tune's memory per device and whether it fits, before submit "
              "(a submission's body; `train` may be left out; nothing is queued)", "jobs",
              body=EstimateBody, errors=(400, 413)),
    Operation("GET", "/api/jobs/nodes", "The cluster's alive nodes a job may name in `node` "
              "(`cluster`: false and none without a cluster)", "jobs", errors=(503,)),
    Operation("GET", "/api/jobs/{id}", "One job", "jobs", errors=(404,), path_descriptions=_JOB_ID),
    Operation("DELETE", "/api/jobs/{id}", "Delete a finished job and its events", "jobs",
              errors=(404, 409), path_descriptions=_JOB_ID),
    Operation("GET", "/api/jobs/{id}/events", "Job events as SSE: replay after Last-Event-ID, then live",
              "jobs", params=(
                  Param("Last-Event-ID", "header", _INT, "Replay events after this sequence number."),
                  _q("after", _INT, "Same as Last-Event-ID, for clients that cannot set headers."),
              ), media=(SSE,), errors=(400, 404), path_descriptions=_JOB_ID),
    Operation("GET", "/api/jobs/{id}/log", "The tail of a job's log", "jobs",
              params=(_q("tail", {"type": "integer", "minimum": 0}, "Bytes from the end."),),
              media=("text/plain",), errors=(400, 404), path_descriptions=_JOB_ID),
    Operation("POST", "/api/jobs/{id}/cancel", "Cancel a job (`save` checkpoints a resumable one first)",
              "jobs", body=CancelBody, body_required=False,
              params=(_q("save", _BOOL_TEXT, "Same as the body's `save`."),),
              errors=(400, 404, 409), path_descriptions=_JOB_ID),
    Operation("POST", "/api/jobs/{id}/resume", "Resume an interrupted resumable job from its checkpoint",
              "jobs", errors=(400, 404, 409), path_descriptions=_JOB_ID),
    Operation("POST", "/api/datasets", "Upload a dataset file (multipart field `file`)", "jobs",
              form=("multipart/form-data", {"type": "object", "required": ["file"], "properties": {
                  "file": {"type": "string", "format": "binary"}}}),
              ok=201, errors=(400, 413)),
    Operation("GET", "/api/datasets", "The datasets directory's files (name, bytes, modified), newest first",
              "jobs"),
    Operation("GET", "/api/dataset/templates", "Dataset templates and accepted file types", "jobs"),
    Operation("GET", "/api/gpu", "The GPU lease: holders and waiters per device", "jobs"),
    # ---------------------------------------------------------- lab: models
    Operation("GET", "/api/models", "The model library with each model's worker state", "models"),
    Operation("GET", "/api/models/{id}", "One model", "models", errors=(404,), path_descriptions=_MODEL_ID),
    Operation("POST", "/api/models/{id}/load", "Load a model (optional settings override the defaults)",
              "models", body=ModelSettings, body_required=False, errors=(400, 404, 503),
              path_descriptions=_MODEL_ID),
    Operation("POST", "/api/models/{id}/unload", "Unload a model", "models", errors=(404,),
              path_descriptions=_MODEL_ID),
    Operation("DELETE", "/api/models/{id}", "Remove a model a download put on cluster nodes' own disks from "
              "every node that holds it (its workers unloaded first; 409 and nothing removed when such a node "
              "is not reachable, or for a model in the shared directories)", "models", errors=(404, 409, 503),
              path_descriptions=_MODEL_ID),
    Operation("GET", "/api/models/{id}/wait", "Wait in line while a job holds the device (long poll)",
              "models", errors=(400, 404), path_descriptions=_MODEL_ID,
              params=(_q("ticket", {"type": "string"}, "The ticket of the previous poll: keeps the place"),
                      _q("timeout_s", {"type": "number", "minimum": 0, "maximum": 25},
                         "How long to wait for the device before answering with the position"))),
    Operation("GET", "/api/models/{id}/log", "The tail of a model worker's log (admin only)", "models",
              params=(
                  _q("tail", {"type": "integer", "minimum": 1, "maximum": 1 << 20},
                     "Bytes from the end (default 65536)."),
                  _q("mode", {"type": "string", "enum": ["generate", "embedding"]},
                     "Which of the model's workers (default generate)."),
              ), media=("text/plain",), errors=(400, 403, 404), path_descriptions=_MODEL_ID),
    # ---------------------------------------------------------- service
    Operation("GET", "/healthz", "Liveness, uptime and workers", "service"),
    Operation("GET", "/readyz", "Ready to serve (503 while no worker serves)", "service", errors=(503,)),
    Operation("GET", "/api/workers", "Every model worker with its state and counters", "service"),
    Operation("GET", "/api/hosted-tools", "Which hosted tools requests may use, and why not", "service"),
    Operation("GET", "/metrics", "Prometheus metrics", "service", media=("text/plain",)),
    Operation("GET", OPENAPI_PATH, "This document", "service"),
    # ---------------------------------------------------------- web UI and login
    Operation("GET", "/", "The lab web UI", "ui", media=("text/html",), errors=(304,)),
    Operation("GET", "/static/{name}", "A static file of the web UI", "ui", params=(
        _q("v", _STR, "Content hash; a matching one makes the file cacheable for a year."),
    ), media=("application/octet-stream",), errors=(304, 404),
              path_descriptions={"name": "A file name from web/static."}),
    Operation("GET", "/login", "The sign-in page", "ui", media=("text/html",)),
    Operation("POST", "/login", "Sign in with the admin token (sets a session cookie)", "ui",
              form=("application/x-www-form-urlencoded", {"type": "object", "required": ["token"],
                                                          "properties": {"token": _STR}}),
              ok=303, errors=(401,)),
    Operation("POST", "/logout", "Sign out", "ui", ok=303),
)


def operation_keys(routes: Iterable[Operation] = ROUTES) -> set[tuple[str, str]]:
    return {(op.method, op.path) for op in routes}


def route_key(method: str, canonical: str) -> tuple[str, str]:
    """(method, OpenAPI path) of a registered aiohttp route: ``{id:.+}`` -> ``{id}``."""
    return method, _PATH_PARAM.sub(lambda m: "{" + m.group(1) + "}", canonical)


# ---------------------------------------------------------------- schemas


def _body_types() -> list[type]:
    types: list[type] = [ErrorEnvelope]
    types += [op.body for op in ROUTES if op.body is not None]
    types += [spec.params for spec in job_kinds().values()]
    return list(dict.fromkeys(types))


def _submit_schema(components: Mapping[str, Any]) -> dict[str, Any]:
    """SubmitBody's ``params`` is validated against the kind's own Struct
    after decoding: document that as one variant per kind."""
    base = components[SubmitBody.__name__]
    variants = []
    for name, spec in job_kinds().items():
        props = dict(base["properties"])
        props["kind"] = {"const": name, "description": spec.description}
        props["params"] = {"$ref": REF.format(name=spec.params.__name__)}
        variants.append({"type": "object", "title": f"{name} job", "properties": props,
                         "required": ["kind"], "additionalProperties": False})
    return {"oneOf": variants}


def _request_body(op: Operation, refs: Mapping[type, Any], components: Mapping[str, Any]) -> dict[str, Any] | None:
    content: dict[str, Any] = {}
    if op.form is not None:
        media, form = op.form
        content[media] = {"schema": dict(form)}
    if op.body is not None:
        # With a form too: either is taken (a container file: an upload, or a file_id as JSON).
        content[JSON] = {"schema": _submit_schema(components) if op.body is SubmitBody else refs[op.body]}
    if not content:
        return None
    return {"required": op.form is not None or op.body_required, "content": content}


def _parameters(op: Operation) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in _PATH_PARAM.findall(op.path):
        out.append({"name": name, "in": "path", "required": True, "schema": {"type": "string"},
                    "description": op.path_descriptions.get(name, "")})
    for p in op.params:
        out.append({"name": p.name, "in": p.where, "required": False, "schema": dict(p.schema),
                    "description": p.description})
    return out


# Before OpenAPI 3.2 an event stream's schema describes each event, as
# clients parse it: its fields (data, event, id, retry), not the raw text.
_SSE_EVENT = {"type": "object", "properties": {
    "data": _STR, "event": _STR, "id": _STR, "retry": {"type": "integer", "minimum": 0}}}
_MEDIA_SCHEMAS: dict[str, dict[str, Any]] = {JSON: {"type": "object"}, SSE: _SSE_EVENT}


def _responses(op: Operation, error_ref: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {str(op.ok): {"description": STATUS_TEXT[op.ok]}}
    if op.ok not in _NO_BODY:
        out[str(op.ok)]["content"] = {m: {"schema": _MEDIA_SCHEMAS.get(m, _STR)} for m in op.media}
    for status in op.errors:
        if status in _NO_BODY:
            out[str(status)] = {"description": STATUS_TEXT[status]}
        elif op.tag == "ui" and op.method == "POST":
            out[str(status)] = {"description": STATUS_TEXT[status], "content": {"text/html": {"schema": _STR}}}
        else:
            out[str(status)] = {"description": STATUS_TEXT[status], "content": {JSON: {"schema": error_ref}}}
    # Any route may be refused by auth, a body limit or a shutdown in progress.
    out.setdefault("default", {"description": "An error (OpenAI-shaped body)",
                               "content": {JSON: {"schema": error_ref}}})
    return out


def build_document() -> dict[str, Any]:
    """The whole document, built from the route table and the Structs."""
    types = _body_types()
    refs_list, components = msgspec.json.schema_components(types, ref_template=REF)
    refs = dict(zip(types, refs_list, strict=True))
    error_ref = refs[ErrorEnvelope]
    paths: dict[str, dict[str, Any]] = {}
    for op in ROUTES:
        entry: dict[str, Any] = {
            "summary": op.summary,
            "operationId": _operation_id(op),
            "tags": [op.tag],
            "parameters": _parameters(op),
            "responses": _responses(op, error_ref),
        }
        body = _request_body(op, refs, components)
        if body is not None:
            entry["requestBody"] = body
        paths.setdefault(op.path, {})[op.method.lower()] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": "gpuvisor", "version": _version(),
                 "description": "OpenAI-compatible serving, lab jobs and one fair GPU lease."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        # Auth applies only when keys or an admin token are configured.
        "security": [{}, {"bearer": []}],
    }


def _operation_id(op: Operation) -> str:
    words = re.sub(r"[^A-Za-z0-9]+", "_", op.path).strip("_") or "root"
    return f"{op.method.lower()}_{words}"


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gpuvisor")
    except metadata.PackageNotFoundError:
        return "dev"


# The encoded document: routes and Structs are fixed once the app is built.


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI_DOCUMENT], content_type=JSON)


def add_routes(app: web.Application) -> None:
    app[OPENAPI_DOCUMENT] = msgspec.json.encode(build_document())
    app.router.add_get(OPENAPI_PATH, openapi_json)
