"""The Worker API as calls: what one call sees of its caller, how it refuses, and the one
adapter that serves the calls over gRPC.

Contract
--------
Each RPC of `prefixgate.v1.WorkerService` is a call-level method of the service
(workerapi/server.py `WorkerServiceBase`, engines/vllm.py), named in snake case after it
(`GetInfo` -> `get_info`, `Generate` -> `generate`): `async def get_info(request, scope)`
returns the response; `def generate(request, scope)` is an async generator of responses.
`scope` is a `CallScope` (the deadline, the caller's metadata and identity); a call that
will not answer raises `Refused(code, message, request_scoped)`, never touching a
transport's context. Two callers hold these methods:

- `grpc_servicer(service)` (here): the servicer the gRPC server registers
  (`rpc.add_service`), one handler per RPC of the descriptor. It builds the `CallScope`
  from the `grpc.aio.ServicerContext` (`CallScope.of`) and ends a refused call with
  `context.abort(code, message, trailing metadata)`, the trailing metadata marking a
  request-scoped refusal `prefixgate-error-scope: request` (wire/protocol.py
  REQUEST_SCOPED): the wire carries exactly what it carried when the methods aborted
  themselves.
- `InProcessWorkerClient` (workerapi/client.py): the gateway calling a service held in
  its own process, with no gRPC in between.

Status codes are `grpc.StatusCode`: the Worker API's vocabulary (INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, UNAVAILABLE, ...), torch-free like the rest of this package.
"""

from __future__ import annotations

import contextlib
import re
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor as _descriptor

from prefixgate.wire.protocol import REQUEST_SCOPED

__all__ = ["CallScope", "Refused", "call_name", "grpc_servicer"]


@dataclass(frozen=True)
class CallScope:
    """What one call knows of its caller, whatever carried it.

    deadline: `time.monotonic()` time by which the caller wants the answer (None: none).
    metadata: the caller's invocation metadata, (key, value) pairs: its credential, trace
              context (telemetry/tracing.py), and the like.
    peer: the caller's address as the transport names it ("in-process" for a call made
          in this process).
    caller_names: the names (common name, subject alternative names) in the caller's TLS
                  client certificate; empty without one (then not known)."""

    deadline: float | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    peer: str = "in-process"
    caller_names: frozenset[str] = frozenset()

    @classmethod
    def within(cls, timeout_s: float | None = None,
               metadata: Iterable[tuple[str, str]] | None = None) -> CallScope:
        """The scope of a call made in this process: answered within `timeout_s` seconds
        from now (None: no deadline), with `metadata`."""
        return cls(None if timeout_s is None else time.monotonic() + timeout_s,
                   tuple(metadata or ()))

    @classmethod
    def of(cls, context: grpc.aio.ServicerContext) -> CallScope:
        """The scope of a gRPC call, from its servicer context."""
        remaining = context.time_remaining()
        return cls(None if remaining is None else time.monotonic() + remaining,
                   tuple(context.invocation_metadata() or ()), context.peer() or "",
                   frozenset(_certificate_names(context)))

    def time_remaining(self) -> float | None:
        """Seconds left until the deadline (negative once past; None: no deadline)."""
        return None if self.deadline is None else self.deadline - time.monotonic()


def _certificate_names(context: grpc.aio.ServicerContext) -> set[str]:
    try:
        ctx = context.auth_context() or {}
    except Exception:  # noqa: BLE001 (no transport security context)
        return set()
    return {v.decode(errors="replace") for key in ("x509_common_name",
                                                  "x509_subject_alternative_name")
            for v in ctx.get(key, ())}


class Refused(Exception):
    """A call that will not answer: its status `code` and an actionable `message`.

    request_scoped: the failure belongs to this request (bad input, a limit it exceeds,
    an engine error bisected to it): the gateway returns it to its client as it is, never
    retries it on another worker and never holds it against the worker."""

    def __init__(self, code: grpc.StatusCode, message: str, request_scoped: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_scoped = request_scoped

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """What the call's trailing metadata carries (REQUEST_SCOPED or nothing)."""
        return REQUEST_SCOPED if self.request_scoped else ()


def call_name(rpc_name: str) -> str:
    """The call-level method that serves RPC `rpc_name` (`PullBlocks` -> `pull_blocks`)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", rpc_name).lower()


def _unary(call: Callable[[object, CallScope], Awaitable]) -> Callable:
    async def handler(request, context: grpc.aio.ServicerContext):
        try:
            return await call(request, CallScope.of(context))
        except Refused as exc:
            await context.abort(exc.code, exc.message, exc.trailing_metadata)
    return handler


def _stream(call: Callable[[object, CallScope], AsyncIterator]) -> Callable:
    async def handler(request, context: grpc.aio.ServicerContext):
        try:
            # aclosing: when gRPC closes this handler (the client went away), the call's
            # own clean-up (e.g. cancelling the request in the engine) runs now.
            async with contextlib.aclosing(call(request, CallScope.of(context))) as events:
                async for event in events:
                    yield event
        except Refused as exc:
            await context.abort(exc.code, exc.message, exc.trailing_metadata)
    return handler


def grpc_servicer(service: object, descriptor: _descriptor.ServiceDescriptor | None = None,
                  ) -> object:
    """The gRPC servicer of `service`'s call-level methods: one attribute per RPC of
    `descriptor` (default prefixgate.v1.WorkerService), named as in the proto, taking
    (request, grpc.aio.ServicerContext) as `rpc.add_service` expects. Only unary and
    server-streaming RPCs."""
    if descriptor is None:
        from prefixgate.v1 import worker_pb2

        descriptor = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]
    methods: Sequence = descriptor.methods
    return types.SimpleNamespace(**{
        m.name: (_stream if m.server_streaming else _unary)(getattr(service, call_name(m.name)))
        for m in methods})
