"""Typed API errors, each mapped to an HTTP status and an OpenAI-shaped body.

Handlers raise these; one middleware renders them. Errors are never matched by
message text: the class carries the status, the type and the code.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Re-exported: the one reader of msgspec's error text lives with the jobs,
# which must not import the parent.
from jobs.errors import ParamError
from jobs.errors import validation_param as validation_param  # noqa: PLC0414 - re-exported


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


class ApiError(Exception):
    """Base of every error an HTTP handler may raise on purpose."""

    status: int = 500
    type: str = "server_error"
    code: str | None = "internal_error"
    # Close the connection after answering (what is left of its body is junk).
    close_connection: bool = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = headers or {}

    def body(self) -> ErrorEnvelope:
        return ErrorEnvelope(ErrorBody(self.message, self.type, self.param, self.code))

    def to_dict(self) -> dict[str, Any]:
        return {"error": msgspec.to_builtins(self.body())}


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(ApiError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeout(ApiError):
    """The request body did not arrive in time (408); the connection closes."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"
    close_connection = True


class UpstreamError(ApiError):
    """The model worker failed while serving the request (502)."""

    status = 502
    type = "server_error"
    code = "worker_error"


class StorageFull(ApiError):
    """The disk under the database is full (507): nothing was written."""

    status = 507
    type = "server_error"
    code = "storage_full"


# Honoured by the OpenAI SDKs: their automatic retries would only repeat a
# failure that waiting cannot fix (and re-crash a worker on a poison request).
NO_RETRY = {"x-should-retry": "false"}


class ModelFailed(ApiError):
    """The model is marked failed (load error or crash loop) until it is loaded
    again (503, no Retry-After: it does not recover by itself)."""

    status = 503
    type = "server_error"
    code = "model_failed"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers=dict(NO_RETRY))


class Unavailable(ApiError):
    """Temporarily refused (503); always carries Retry-After."""

    status = 503
    type = "server_error"
    code = "unavailable"

    def __init__(self, message: str, *, retry_after: int = 1, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after)})
        self.retry_after = retry_after


class BusyJob(msgspec.Struct):
    """The job a refused request waits for: what the chat UI shows."""

    id: str
    kind: str
    label: str
    state: str  # holding, or draining (the device is being freed for it)
    progress: float
    eta_s: float | None  # from its progress so far; None until it has some
    jobs_waiting: int  # further jobs queued for the device behind it


class BusyErrorBody(ErrorBody):
    job: BusyJob | None = None


class BusyEnvelope(ErrorEnvelope):
    error: BusyErrorBody


class DeviceBusy(Unavailable):
    """503 ``gpu_busy``: a job holds (or is being given) the device. The API
    adds the job (see supervisor/lab/busy.py) before answering."""

    code = "gpu_busy"

    def __init__(self, message: str, *, retry_after: int = 10, job: BusyJob | None = None) -> None:
        super().__init__(message, retry_after=retry_after, code="gpu_busy")
        self.job = job

    def body(self) -> BusyEnvelope:
        return BusyEnvelope(BusyErrorBody(self.message, self.type, self.param, self.code, self.job))


class TooManyWaiting(Unavailable):
    """503: the line of chats waiting for a device is full."""

    code = "wait_line_full"

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after=10, code="wait_line_full")


class TooManyPlaces(ApiError):
    """429: this caller already holds its share of the wait line."""

    status = 429
    type = "requests"
    code = "wait_line_share"


def param_error(exc: ParamError) -> BadRequest:
    """The 400 for invalid job params (the job side raises its own type)."""
    return BadRequest(exc.message, param=exc.param, code=exc.code)
