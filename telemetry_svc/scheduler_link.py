"""The live scheduler snapshot for the trace UI: the telemetry service, told where the scheduler
is (``--scheduler``), asks it for its telemetry and its workers when the UI's page asks, and
passes the answer on as JSON. Nothing is cached or stored: the store holds spans only."""

from __future__ import annotations

from typing import Any

import grpc

from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from kvfleet_common.security import TlsConfig, aio_channel, token_metadata


def _dict(message: Any) -> dict[str, Any]:
    """Every field, by its proto name, numbers as numbers (protobuf's JSON writes 64-bit
    integers as strings, which a page would then compare as text)."""
    out: dict[str, Any] = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = dict(value)
        elif f.message_type is not None and f.is_repeated:
            out[f.name] = [_dict(v) for v in value]
        elif f.message_type is not None:
            out[f.name] = _dict(value)
        elif f.is_repeated:
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out


class SchedulerUnreachable(Exception):
    """The scheduler did not answer (down, refused the token, timed out): the message says so."""


class SchedulerLink:
    def __init__(self, address: str, tls: TlsConfig | None = None, token: str | None = None) -> None:
        """token: the scheduler's client API token (None: $KVFLEET_API_TOKEN, as every client)."""
        self.address = address
        self._channel = aio_channel(address, tls or TlsConfig())
        self._stub = spb_grpc.SchedulerStub(self._channel)
        self._md = tuple(token_metadata(token))

    async def snapshot(self, timeout_s: float = 2.0) -> dict[str, Any]:
        """The scheduler's live telemetry (GetTelemetry) and workers (ListWorkers)."""
        try:
            snap = await self._stub.GetTelemetry(spb.TelemetryRequest(), timeout=timeout_s, metadata=self._md)
            workers = await self._stub.ListWorkers(spb.ListWorkersRequest(), timeout=timeout_s, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            raise SchedulerUnreachable(
                f"the scheduler at {self.address} did not answer: {exc.code().name} {exc.details() or ''}".strip()
            ) from exc
        return {"scheduler": self.address, "telemetry": _dict(snap), "workers": _dict(workers).get("workers", [])}

    async def close(self) -> None:
        await self._channel.close()
