"""gRPC plumbing shared by the gateway and the worker (torch-free).

- `add_service` registers an asyncio servicer for a service of prefixgate.v1 from its
  descriptor. Unlike the generated `add_*_to_server`, a request that fails to parse (for
  example a string field that is not UTF-8) is answered with INVALID_ARGUMENT and a
  message, not with gRPC's INTERNAL "Exception deserializing request!".
  With a `guard`, every call is first checked with `guard(method_name, metadata)`
  (prefixgate.security.auth): `protocol.Unauthenticated` is answered UNAUTHENTICATED and
  `protocol.PermissionDenied` PERMISSION_DENIED, with the guard's message. The request is
  parsed only after the guard let the call in: gRPC hands the handler the raw bytes
  (bounded by the server's max receive size), so a caller without a credential costs no
  parsing, and nothing of its message reaches the service. What the guard returned (the
  caller's tenant) is `guarded()` in the handler of that call. A handler may return or
  yield a response as bytes already in its wire form (sent as they are).
- `add_health_and_reflection` adds the standard health service (grpc.health.v1) and
  server reflection; the returned servicer's statuses are the server's readiness.
- TLS (`TLSConfig`): `bind` adds a server's port (TLS when the config has a certificate;
  mutual TLS, client certificates required, when it also names a client CA) and `channel`
  opens a client channel (TLS when the config names a CA or a client certificate).
  Without TLS, binding a non-loopback address logs that traffic is in clear text.
- `start_health_port` serves only grpc.health.v1 on a plaintext port of its own, for
  probes that cannot speak TLS (Kubernetes' gRPC probes); the statuses are the same.
"""

from __future__ import annotations

import contextvars
import ipaddress
import logging
import random
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prefixgate.wire.protocol import AuthError, PermissionDenied

log = logging.getLogger(__name__)

# guard(method name, invocation metadata): raises protocol.AuthError to refuse the call.
Guard = Callable[[str, Sequence[tuple[str, Any]]], object]
# What the guard of the call being handled returned (each call runs in a task of its own).
_GUARDED: contextvars.ContextVar[object] = contextvars.ContextVar("guarded", default=None)


def guarded() -> Any:
    """In a handler: what its call's guard returned (None without a guard)."""
    return _GUARDED.get()


def _raw(data: bytes) -> bytes:
    """The request deserializer: the bytes as they came (parsed in `_admit`, after the
    guard)."""
    return data


_MALFORMED_MESSAGE = ("the request is not a valid protobuf message ({}); check that every "
                      "string field is valid UTF-8")


async def abort_refused(context: grpc.aio.ServicerContext, exc: AuthError) -> None:
    """End the call with the status of `exc` (UNAUTHENTICATED or PERMISSION_DENIED)."""
    await context.abort(grpc.StatusCode.PERMISSION_DENIED if isinstance(exc, PermissionDenied)
                        else grpc.StatusCode.UNAUTHENTICATED, str(exc))


async def _admit(name: str, guard: Guard | None, request_cls: type, data: bytes,
                 context: grpc.aio.ServicerContext) -> Any:
    """The parsed request, once `guard` let the call in (authentication comes before any
    parsing); aborts the call otherwise, or when `data` does not parse."""
    if guard is not None:
        try:
            _GUARDED.set(guard(name, context.invocation_metadata() or ()))
        except AuthError as exc:
            await abort_refused(context, exc)
    try:
        return request_cls.FromString(data)
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            _MALFORMED_MESSAGE.format(exc))


def _unary(name: str, handler: Callable, guard: Guard | None, request_cls: type) -> Callable:
    async def wrapped(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        request = await _admit(name, guard, request_cls, data, context)
        return await handler(request, context)
    return wrapped


def _stream(name: str, handler: Callable, guard: Guard | None, request_cls: type) -> Callable:
    async def wrapped(data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        request = await _admit(name, guard, request_cls, data, context)
        async for event in handler(request, context):
            yield event
    return wrapped


def _serializer(cls: type) -> Callable[[Any], bytes]:
    """`cls`'s serializer, passing bytes through: a handler may yield a response already
    in its wire form (workerapi/transfer.py builds KV chunks of megabytes that way, without
    protobuf's copies)."""
    serialize = cls.SerializeToString
    return lambda m: m if isinstance(m, bytes) else serialize(m)


def add_service(server: grpc.aio.Server, service: _descriptor.ServiceDescriptor,
                servicer: object, guard: Guard | None = None) -> None:
    """Register `servicer` (an object with one async method per RPC, named as in the
    proto) for `service`, every call checked by `guard` first when given. Only unary and
    server-streaming methods are supported."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming:  # would be registered as unary and fail at each call
            raise ValueError(f"{service.full_name}.{method.name}: client-streaming methods "
                             "are not supported by rpc.add_service")
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        impl = getattr(servicer, method.name)
        kwargs = dict(request_deserializer=_raw,
                      response_serializer=_serializer(response_cls))
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _stream(method.name, impl, guard, request_cls), **kwargs)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(method.name, impl, guard, request_cls), **kwargs)
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


async def start_health_port(servicer: health.aio.HealthServicer, host: str, port: int,
                            share_port: bool = False) -> grpc.aio.Server | None:
    """Serve `servicer` (and nothing else) in plain text on `port`; None when port is 0.
    `share_port`: other processes of this server listen there too (SO_REUSEPORT)."""
    if not port:
        return None
    server = grpc.aio.server(options=[("grpc.so_reuseport", int(share_port))])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server


async def set_serving(servicer: health.aio.HealthServicer, service_names: Iterable[str],
                      serving: bool) -> None:
    """Mark the overall server ("") and each named service SERVING or NOT_SERVING."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *service_names]:
        await servicer.set(name, status)


_PORTS_GIVEN: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and `prefixgate up`), never the
    same one twice in a process.

    Chosen below the kernel's ephemeral range where it can be: a port the kernel hands
    out (to outgoing connections, to any process binding port 0) can be taken by another
    process between this check and its use, and was: a vLLM server's events port went to
    the other server's internal socket, which started at the same moment."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(10000, low) if low > 11000 else 0
        if port in _PORTS_GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port
    raise RuntimeError(f"no free TCP port found on {host}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass(frozen=True)
class TLSConfig:
    """PEM files. A server needs cert_file and key_file; its ca_file, when set, is the CA
    its clients' certificates must chain to (mutual TLS). A client trusts ca_file (empty:
    the system's roots) and presents cert_file/key_file when set (for mutual TLS)."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file or self.key_file or self.ca_file)


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    if not (tls.cert_file and tls.key_file):
        raise ValueError("a TLS server needs both a certificate and its key "
                         "(--tls-cert and --tls-key)")
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file), _read(tls.cert_file))], root_certificates=_read(tls.ca_file),
        require_client_auth=bool(tls.ca_file))


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    if bool(tls.cert_file) != bool(tls.key_file):
        raise ValueError("a client certificate needs its key, and the key its certificate")
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file),
                                        private_key=_read(tls.key_file),
                                        certificate_chain=_read(tls.cert_file))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind(server: grpc.aio.Server, host: str, port: int, tls: TLSConfig | None, what: str) -> int:
    """Add the listening port (TLS per `tls`); returns the bound port."""
    address = f"{host}:{port}"
    try:
        return _bind(server, address, tls, what)
    except RuntimeError as exc:  # grpc's "Failed to bind to address ..."
        raise BindError(f"{what}: cannot listen on {address}: the port is in use, or the "
                        "address is not one of this machine's; choose another port or "
                        "host") from exc


class BindError(RuntimeError):
    """A server could not listen where it was told to (the message says what to do)."""


def _bind(server: grpc.aio.Server, address: str, tls: TLSConfig | None, what: str) -> int:
    host = address.rsplit(":", 1)[0]
    if tls is not None and tls.enabled:
        bound = server.add_secure_port(address, server_credentials(tls))
        log.info("%s: TLS on %s%s", what, address,
                 " (mutual: client certificates required)" if tls.ca_file else "")
        return bound
    if not is_loopback(host):
        log.warning("%s: listening on %s without TLS: traffic (prompts included) is in clear "
                    "text; pass --tls-cert/--tls-key", what, address)
    return server.add_insecure_port(address)


def _with_metadata(metadata: Sequence[tuple[str, str]]) -> list:
    """Client interceptors adding fixed metadata (a credential) to every unary-unary and
    unary-stream call (grpc.aio files an interceptor under one kind only: one of each)."""
    extra = tuple(metadata)

    def details_of(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, grpc.aio.Metadata(*(details.metadata or ()), *extra),
            details.credentials, details.wait_for_ready)

    class Unary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            return await continuation(details_of(details), request)

    class Stream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            return await continuation(details_of(details), request)

    return [Unary(), Stream()]


def channel(address: str, tls: TLSConfig | None = None,
            metadata: Sequence[tuple[str, str]] = (),
            options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A client channel to `address`, over TLS when `tls` says so, sending `metadata`
    (e.g. `auth.InternalCredential.metadata`) with every call."""
    interceptors = _with_metadata(metadata) if metadata else None
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(address, channel_credentials(tls), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
