"""gRPC clients of the workers the scheduler dispatches to."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from kvfleet_common import grpcutil
from kvfleet_common.security import TlsConfig, aio_channel
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from scheduler_svc.core import WorkerSpec

log = logging.getLogger(__name__)


@dataclass
class WorkerClient:
    address: str
    channel: grpc.aio.Channel
    stub: wpb_grpc.WorkerStub
    info: wpb.WorkerInfo | None = None

    @classmethod
    def open(cls, address: str, tls: TlsConfig | None = None) -> "WorkerClient":
        channel = aio_channel(address, tls or TlsConfig(), options=grpcutil.CHANNEL_OPTIONS)
        return cls(address=address, channel=channel, stub=wpb_grpc.WorkerStub(channel))

    @property
    def worker_id(self) -> str:
        assert self.info is not None
        return self.info.worker_id

    def spec(self) -> WorkerSpec:
        assert self.info is not None
        i = self.info
        return WorkerSpec(worker_id=i.worker_id, capacity_tokens=i.kv_capacity_tokens,
                          block_size=i.block_size, kv_bytes_per_token=i.kv_bytes_per_token,
                          weight_bytes=i.weight_bytes)

    async def fetch_info(self, timeout: float = 5.0) -> wpb.WorkerInfo:
        self.info = await self.stub.GetInfo(wpb.GetInfoRequest(), timeout=timeout)
        return self.info

    async def wait_ready(self, deadline_s: float) -> wpb.WorkerInfo:
        """Retry GetInfo until the worker answers or the deadline passes."""
        end = time.monotonic() + deadline_s
        delay = 0.1
        while True:
            try:
                return await self.fetch_info()
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() + delay > end:
                    raise ConnectionError(f"worker at {self.address} did not answer within "
                                          f"{deadline_s:.0f}s: {exc.code().name} {exc.details()}") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def close(self) -> None:
        await self.channel.close()
