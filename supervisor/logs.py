"""Structured logs: text, key=value or JSON lines; request ids; secrets redacted.

Every formatter escapes control characters (and Unicode line and bidi
controls) in what a record carries, so no request field (a path with ``%0A``,
a header) can forge a log line or drive a terminal; only a traceback keeps
its own newlines.

Every request gets an id (``X-Request-Id`` from the client when it is sane,
else a new one). It is returned in the response header, attached to the
access log line and passed to the model worker with the generation, so one
request can be followed across processes.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from supervisor import bad_http_log

LOG_FORMATS = ("text", "kv", "json")
QUIET_LIBRARIES = ("gguf", "watchfiles")
# Fields a record may carry through ``extra=``; rendered after the message.
CONTEXT_FIELDS = ("request_id", "status", "duration_ms", "client", "scheme", "host", "key", "model")
# Shapes of secrets we hand out or accept: our API keys, HF tokens, bearer headers.
_SECRET_SHAPES = re.compile(
    r"(gv_[0-9a-f]{8}_[A-Za-z0-9_\-]+|hf_[A-Za-z0-9]{16,}|(?i:bearer)\s+[A-Za-z0-9._~+/=\-]+)")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
REDACTED = "[redacted]"
# C0 and C1 controls, DEL, Unicode line/paragraph separators and bidi overrides.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(match: re.Match[str]) -> str:
    c = match.group(0)
    return _SHORT_ESCAPES.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def escape_controls(text: str) -> str:
    """``text`` on one line: each control character as a visible escape."""
    return _CONTROL.sub(_escape_char, text)


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group(0)):04x}"


def incoming_request_id(request: web.BaseRequest) -> str:
    """The client's X-Request-Id if it is short and plain (no log injection)."""
    given = request.headers.get("X-Request-Id", "")
    if _REQUEST_ID.fullmatch(given):
        return given
    return "req_" + secrets.token_hex(8)


class Redactor(logging.Filter):
    """Replaces known secret values and secret-shaped strings in records."""

    def __init__(self, secrets_: Iterable[str] = ()) -> None:
        super().__init__()
        # Short values would redact ordinary words; configured secrets are long.
        self.values = sorted({s for s in secrets_ if len(s) >= 8}, key=len, reverse=True)

    def scrub(self, text: str) -> str:
        for value in self.values:
            text = text.replace(value, REDACTED)
        return _SECRET_SHAPES.sub(REDACTED, text)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = self.scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_text is None:
            record.exc_text = self.scrub(logging.Formatter().formatException(record.exc_info))
        return True


def _context(record: logging.LogRecord) -> dict[str, Any]:
    return {k: getattr(record, k) for k in CONTEXT_FIELDS if getattr(record, k, None) is not None}


def _exc_text(record: logging.LogRecord, fmt: logging.Formatter) -> str:
    if record.exc_text:
        return record.exc_text
    return fmt.formatException(record.exc_info) if record.exc_info else ""


def _kv_value(value: Any) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=') and not _CONTROL.search(text):
        return text
    return json.dumps(text)  # ensure_ascii: every control character escaped


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        fields = {"ts": f"{ts}.{int(record.msecs):03d}Z", "level": record.levelname.lower(),
                  "logger": record.name, "msg": record.getMessage(), **_context(record)}
        line = " ".join(f"{k}={_kv_value(v)}" for k, v in fields.items())
        exc = _exc_text(record, self)
        if exc:
            line += " exc=" + _kv_value(exc)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage(), **_context(record)}
        exc = _exc_text(record, self)
        if exc:
            out["exc"] = exc
        # json escapes C0 itself; DEL, C1 and U+2028-style characters are
        # valid raw in JSON strings (the only place they can be): escape them.
        return _CONTROL.sub(_json_escape, json.dumps(out, default=str, ensure_ascii=False))


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        # record.message is the formatter's own scratch copy (format() sets it
        # from getMessage() each time): escaping it changes no other handler.
        record.message = escape_controls(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ctx = _context(record)
        return line + ("" if not ctx else " " + " ".join(f"{k}={_kv_value(v)}" for k, v in ctx.items()))


def configure(level: str, fmt: str, secret_values: Iterable[str] = ()) -> None:
    """Install one stderr handler (journald adds its own timestamps)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}")
    formatter: logging.Formatter = {"json": JsonFormatter, "kv": KeyValueFormatter}.get(fmt, TextFormatter)()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler.addFilter(Redactor(secret_values))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Libraries that narrate at INFO what says nothing to an operator: the
    # gguf writer every file it writes (the demo model at first start),
    # watchfiles every batch of changes it sees in the models dirs (a file
    # being copied in is dozens). Their warnings still show.
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    bad_http_log.install()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# Routes the UI (and monitoring) poll every few seconds, and the UI's static
# assets (a dozen per page view): hundreds of lines an hour that say nothing.
# Their successful reads are logged at DEBUG; the page itself (``/``) stays
# at INFO, one line per visit.
POLLED_PATHS = ("/healthz", "/readyz", "/metrics", "/api/gpu", "/api/workers")
POLLED_PREFIXES = ("/api/models", "/api/jobs", "/static")


def access_level(method: str, path: str, status: int) -> int:
    """DEBUG for a successful read of a polled route or an asset; INFO for
    changes and errors."""
    polled = path in POLLED_PATHS or any(path == p or path.startswith(p + "/") for p in POLLED_PREFIXES)
    quiet = method in ("GET", "HEAD") and status < 400 and polled
    return logging.DEBUG if quiet else logging.INFO


def access_middleware(enabled: bool) -> Middleware:
    """Assigns the request id and writes one access line per request."""
    access = logging.getLogger("gpuvisor.access")

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        request["request_id"] = incoming_request_id(request)
        start = time.monotonic()
        status = 499  # the client went away before an answer (nginx's convention)
        try:
            resp: web.StreamResponse = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            if status == 499 and "committed_status" in request:
                # The answer had started (a stream): as nginx does, log the
                # status the client was sent, not that it left before the end.
                status = request["committed_status"]
            if enabled:
                access.log(access_level(request.method, request.path, status),
                           "%s %s %d", request.method, request.path, status, extra={
                    "request_id": request["request_id"], "client": request.remote,
                    "scheme": request.scheme, "host": request.host,
                    "status": status, "key": request.get("auth_name"),
                    "duration_ms": round((time.monotonic() - start) * 1000, 1)})

    return middleware


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: streamed responses get the header too, and the
    access log learns the status that was sent."""
    request["committed_status"] = response.status
    rid = request.get("request_id")
    if rid and "X-Request-Id" not in response.headers:
        response.headers["X-Request-Id"] = rid
