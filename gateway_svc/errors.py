"""Errors in the OpenAI JSON shape, and the one place gRPC status codes become HTTP statuses."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
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


# The scheduler's rejections name the fields of its gRPC request; an HTTP client sent others.
# The body's names for the GenerateRequest fields whose names differ, each as a phrase for the
# message and the body field (the OpenAI error's param). The chat endpoint's max_tokens may be
# max_completion_tokens: GenerationRequest.http_names.
HTTP_NAMES: Mapping[str, tuple[str, str]] = {
    "max_new_tokens": ("max_tokens", "max_tokens"),
    "tools_json": ("tools", "tools"),
    "tool_calls_json": ("tool_calls", "messages"),
    "prompt_ids": ("token ids as the prompt", "prompt"),
}
_GRPC_NAME = re.compile(r"\b(" + "|".join(HTTP_NAMES) + r")\b")


def in_http_terms(details: str, names: Mapping[str, tuple[str, str]] = HTTP_NAMES) -> tuple[str, str | None]:
    """The scheduler's message with the gRPC field names it mentions in the body's terms, and
    the body field of the first of them (the OpenAI error's param), if any."""
    params: list[str] = []

    def rename(m: re.Match[str]) -> str:
        phrase, param = names.get(m.group(1)) or HTTP_NAMES[m.group(1)]
        params.append(param)
        return phrase

    return _GRPC_NAME.sub(rename, details), params[0] if params else None


def from_grpc(
    error: grpc.aio.AioRpcError | grpc.RpcError,
    what: str = "the scheduler",
    names: Mapping[str, tuple[str, str]] = HTTP_NAMES,
) -> ApiError:
    """Map a failed scheduler call to the HTTP error the client sees; ``names``: the request
    body's names for the gRPC fields a rejection may name (HTTP_NAMES)."""
    code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
    details: str = error.details() or code.name  # type: ignore[attr-defined]
    reason = _reason(details)
    details, param = in_http_terms(details, names)
    # FAILED_PRECONDITION: the served model cannot do what was asked (no tokenizer to tokenize
    # with); the request is the thing to change, as with a bad argument.
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE):
        return ApiError(400, details, param=param, code=reason)
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
