"""Errors in the OpenAI JSON shape, and the one place gRPC status codes become HTTP statuses."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ApiError(Exception):
    """An error the gateway answers with: {"error": {"message", "type", "param", "code"}}.

    Not frozen: the interpreter sets __traceback__ and friends on a raised exception."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None  # sent as Retry-After, which the openai client honours

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def model_not_found(model: str, served: list[str]) -> ApiError:
    return ApiError(
        404,
        f"the model {model!r} does not exist; this cluster serves {', '.join(sorted(served)) or 'no model right now'}",
        param="model",
        code="model_not_found",
    )


def internal_error() -> ApiError:
    return ApiError(500, "internal error in the gateway; its log has the details", type="server_error")


def _reason(details: str) -> str | None:
    """The scheduler prefixes rejections with their reason: "queue_full: the queue holds ..."."""
    head, sep, _ = details.partition(":")
    return head if sep and head.replace("_", "").isalnum() and head.islower() else None


def from_grpc(error: grpc.aio.AioRpcError | grpc.RpcError, what: str = "the scheduler") -> ApiError:
    """Map a failed scheduler call to the HTTP error the client sees."""
    code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
    details: str = error.details() or code.name  # type: ignore[attr-defined]
    reason = _reason(details)
    # FAILED_PRECONDITION: the served model cannot do what was asked (no tokenizer to tokenize
    # with); the request is the thing to change, as with a bad argument.
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE):
        return ApiError(400, details, code=reason)
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return ApiError(403, details, type="permission_error", code=reason or "permission_denied")
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return unauthorized(details)
    if code is grpc.StatusCode.NOT_FOUND:
        return ApiError(404, details, code=reason)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        # The message keeps the scheduler's "reason: what to change" (queue_full, kv_budget).
        return ApiError(429, details, type="rate_limit_error", code=reason or "resource_exhausted", retry_after_s=1)
    if code is grpc.StatusCode.UNAVAILABLE:
        return ApiError(
            503, f"{what} is unavailable: {details}", type="server_error", code=reason or "unavailable", retry_after_s=1
        )
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, f"{what} did not answer in time: {details}", type="server_error", code="timeout")
    log.error("%s failed with %s: %s", what, code.name, details, exc_info=error)
    return ApiError(500, f"{what} failed ({code.name}); the gateway's log has the details", type="server_error")
