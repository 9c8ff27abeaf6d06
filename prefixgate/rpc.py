"""gRPC plumbing shared by the gateway and the worker (torch-free).

- `add_service` registers an asyncio servicer for a service of prefixgate.v1 from its
  descriptor. Unlike the generated `add_*_to_server`, a request that fails to parse (for
  example a string field that is not UTF-8) is answered with INVALID_ARGUMENT and a
  message, not with gRPC's INTERNAL "Exception deserializing request!".
- `add_health_and_reflection` adds the standard health service (grpc.health.v1) and
  server reflection; the returned servicer's statuses are the server's readiness.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


class _Malformed:
    def __init__(self, error: str) -> None:
        self.error = error


def _safe_deserializer(cls: type) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return _Malformed(str(exc))
    return deserialize


_MALFORMED_MESSAGE = ("the request is not a valid protobuf message ({}); check that every "
                      "string field is valid UTF-8")


def _unary(handler: Callable) -> Callable:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                _MALFORMED_MESSAGE.format(request.error))
        return await handler(request, context)
    return wrapped


def _stream(handler: Callable) -> Callable:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                _MALFORMED_MESSAGE.format(request.error))
        async for event in handler(request, context):
            yield event
    return wrapped


def add_service(server: grpc.aio.Server, service: _descriptor.ServiceDescriptor,
                servicer: object) -> None:
    """Register `servicer` (an object with one async method per RPC, named as in the
    proto) for `service`. Only unary and server-streaming methods are supported."""
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        impl = getattr(servicer, method.name)
        kwargs = dict(request_deserializer=_safe_deserializer(request_cls),
                      response_serializer=response_cls.SerializeToString)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(_stream(impl), **kwargs)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(_unary(impl), **kwargs)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))


def add_health_and_reflection(server: grpc.aio.Server,
                              service_names: Iterable[str]) -> health.aio.HealthServicer:
    """Add grpc.health.v1 and reflection; every named service starts NOT_SERVING."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: Iterable[str],
                      serving: bool) -> None:
    """Mark the overall server ("") and each named service SERVING or NOT_SERVING."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *service_names]:
        await servicer.set(name, status)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and `prefixgate up`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
