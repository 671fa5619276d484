"""POST /tokenize and /detokenize, as vLLM's server names and shapes them, over the scheduler's
Tokenize and Detokenize RPCs: the bodies in, the scheduler's requests out, and back."""

from __future__ import annotations

from typing import Any

from gateway_svc.openai_schema import MAX_PROMPT_IDS, UINT32_MAX, SchemaError, check_count, parse_messages, unicode_text
from kvfleet.v1 import scheduler_pb2 as spb

_PROMPT_KEYS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT_KEYS = {"model", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs"}
_DETOKENIZE_KEYS = {"model", "tokens"}


def _object(body: Any, keys: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise SchemaError("the request body must be a JSON object")
    for key in body:
        if key not in keys:
            raise SchemaError(f"unknown field {key!r}: this route takes {', '.join(sorted(keys))}", key)
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SchemaError(f"{name} must be a boolean", name)
    return value


def tokenize_request(body: Any) -> spb.TokenizeRequest:
    """{"prompt": text} or {"messages": [...]} (rendered with the chat template, generation
    prompt added). Special tokens are added by default for a prompt, not for messages (the
    template writes its own), as vLLM does."""
    if isinstance(body, dict) and "messages" in body:
        body = _object(body, _CHAT_KEYS)
        if not _flag(body, "add_generation_prompt", True):
            raise SchemaError(
                "add_generation_prompt=false is not supported: the scheduler renders chats for generation",
                "add_generation_prompt",
            )
        messages = parse_messages(body)
        return spb.TokenizeRequest(
            chat=spb.ChatMessages(
                messages=[
                    spb.ChatMessage(
                        role=m.role, content=m.content, tool_call_id=m.tool_call_id, tool_calls_json=m.tool_calls_json
                    )
                    for m in messages
                ]
            ),
            add_special_tokens=_flag(body, "add_special_tokens", False),
        )
    body = _object(body, _PROMPT_KEYS)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise SchemaError('send {"prompt": "text"} or {"messages": [...]}', "prompt")
    return spb.TokenizeRequest(
        text=unicode_text(prompt, "prompt"), add_special_tokens=_flag(body, "add_special_tokens", True)
    )


def tokenize_response(body: dict[str, Any], resp: spb.TokenizeResponse, max_model_len: int | None) -> dict[str, Any]:
    return {
        "count": len(resp.token_ids),
        "max_model_len": resp.max_context_length or max_model_len,
        "tokens": list(resp.token_ids),
        "token_strs": list(resp.tokens) if body.get("return_token_strs") else None,
    }


def detokenize_request(body: Any) -> spb.DetokenizeRequest:
    body = _object(body, _DETOKENIZE_KEYS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise SchemaError("tokens must be an array of integer token ids", "tokens")
    check_count(tokens, MAX_PROMPT_IDS, "tokens", "token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise SchemaError("tokens must be an array of integer token ids", "tokens")
    if any(t < 0 or t > UINT32_MAX for t in tokens):
        raise SchemaError(f"tokens must be token ids in 0..{UINT32_MAX}", "tokens")
    return spb.DetokenizeRequest(token_ids=tokens)
