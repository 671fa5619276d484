"""A protobuf message as the CLI prints it: JSON with 64-bit integers as numbers.

protobuf's JSON mapping writes int64 / uint64 fields as strings (JavaScript's numbers lose
precision past 2**53), so `jq '.rss_bytes > 1e9'` compares a string. The counts and byte sizes
the CLI prints are far below 2**53: here they are plain numbers, at any depth (nested messages,
repeated fields, map values). Field names stay the proto's own (snake_case).
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

_INT64 = frozenset({FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64})


def message_dict(message: Message) -> dict[str, Any]:
    """Every field (defaults included), proto names, 64-bit integers as JSON numbers."""
    d = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _numbers(message.DESCRIPTOR, d)


def _numbers(descriptor: Descriptor, d: dict[str, Any]) -> dict[str, Any]:
    for field in descriptor.fields:
        if field.name in d:
            d[field.name] = _value(field, d[field.name])
    return d


def _value(field: FieldDescriptor, value: Any) -> Any:
    kind = field.message_type
    if kind is not None and kind.GetOptions().map_entry:
        entry = kind.fields_by_name["value"]
        return {k: _one(entry, v) for k, v in value.items()}
    if _repeated(field):
        return [_one(field, v) for v in value]
    return _one(field, value)


def _repeated(field: FieldDescriptor) -> bool:
    # `is_repeated` is protobuf 6's; older releases (the pin allows 5) have only `label`.
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _one(field: FieldDescriptor, value: Any) -> Any:
    kind = field.message_type
    if kind is not None:
        # Well-known types (Timestamp, Duration, Struct ...) have JSON forms of their own.
        return value if kind.full_name.startswith("google.protobuf.") else _numbers(kind, value)
    return int(value) if field.cpp_type in _INT64 else value
