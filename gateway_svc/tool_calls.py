"""Tool calls in a model's text, pure: the Hermes/Qwen convention, turned into OpenAI `tool_calls`.

A tool-capable chat template asks the model to answer a call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call. The gateway
reads those blocks out of a finished choice's text; anything it cannot read as a call of a
declared tool stays in the content, word for word, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def declared_tool_names(tools_json: str) -> frozenset[str]:
    """The function names of a request's tools array (as JSON; "" when it sent none)."""
    if not tools_json:
        return frozenset()
    return frozenset(t["function"]["name"] for t in json.loads(tools_json))


def _call(body: str, names: Collection[str]) -> ToolCall | None:
    """The call one block's JSON makes, or None when it is not a call of a declared tool."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    elif not isinstance(args, str):
        return None
    return ToolCall(name=obj["name"], arguments=args, id="call_" + secrets.token_hex(12))


def parse_tool_calls(text: str, names: Collection[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a finished assistant text. With no call found the text comes back as
    it is; otherwise the text outside the call blocks, stripped, or None when nothing is left.
    A last block without its closing tag counts when its JSON is whole: a stop sequence may
    have cut the tag off."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        stop = len(text) if end < 0 else end + len(CLOSE)
        call = _call(text[start + len(OPEN) : len(text) if end < 0 else end], names)
        kept.append(text[pos:start] if call else text[pos:stop])
        if call:
            calls.append(call)
        pos = stop
    kept.append(text[pos:])
    if not calls:
        return text, []
    content = "".join(kept).strip()
    return content or None, [c.to_dict() for c in calls]


def held_from(text: str) -> int:
    """Where a streamed text must be held back from: its first `<tool_call>`, or else a tail
    that could be the start of one (a block cannot be streamed as content and then taken back)."""
    start = text.find(OPEN)
    if start >= 0:
        return start
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return len(text) - k
    return len(text)
