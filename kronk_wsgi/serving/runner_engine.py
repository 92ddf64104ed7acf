"""The engine of a model its runner runs: the gRPC engine, its one worker the runner's socket, the runner started
again before a request if it has gone."""

import dataclasses
from pathlib import Path
from typing import Callable, Optional

from ..engine import grpc_engine
from ..engine.grpc_engine import GrpcOptions
from ..engine.grpc_remote import GrpcEngine, GrpcSlot
from .runners import RunnerLease


class RunnerEngine(GrpcEngine):
    """A front's engine for a model run by its runner (``lease``), which it starts again when it has gone."""

    kind = dataclasses.replace(grpc_engine.KIND, name="runner")  # made here, never by the registry

    def __init__(self, name: str, path: Path, context_length: Optional[int], lease: RunnerLease,
                 start_timeout: float) -> None:
        self.lease = lease
        self._start_timeout = start_timeout
        # vLLM's protocol: it carries a seed, SGLang's does not
        super().__init__(name, path, context_length, GrpcOptions(workers=[f"unix:{lease.files.socket}"],
                                                                 backend="vllm"))

    def start(self, slot: GrpcSlot, request, cancelled: Callable[[], bool]):
        self.lease.ensure(self._start_timeout, cancelled)  # at once while it runs: a few system calls
        return super().start(slot, request, cancelled)

    def close(self) -> None:
        super().close()
        self.lease.release()
