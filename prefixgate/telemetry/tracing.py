"""OpenTelemetry traces of turns: off unless configured, optional to install.

Contract
--------
`configure(exporter, service_name)` turns tracing on for this process: "console" (spans
as JSON on stderr), "otlp" (to an OpenTelemetry collector; the endpoint and headers come
from the standard OTEL_EXPORTER_OTLP_* variables; needs opentelemetry-exporter-otlp), or
a SpanExporter object (tests); "off" (the default) turns it off. It needs the `tracing`
extra (opentelemetry-api and -sdk): asked for without them it raises TracingUnavailable
saying what to install; never asked for, nothing of OpenTelemetry is imported, and every
call below is a no-op returning None or () (a gateway without the extra starts and
serves as before).

Spans (W3C Trace Context): a gateway turn is a SERVER span "prefixgate.turn", child of
the `traceparent` the client sent (gRPC metadata or HTTP header), with one CLIENT span
"prefixgate.worker_call" per worker tried; that call carries the span's `traceparent` in
its gRPC metadata, and the worker's SERVER span "prefixgate.worker.generate" continues it;
a vLLM worker passes it on to vLLM's HTTP API, where vLLM's own tracing continues it.
The gateway returns the turn span's `traceresponse` (HTTP header, gRPC initial metadata).

  incoming(pairs)        the trace headers (traceparent, tracestate) among `pairs`, the
                         metadata or headers of a call, as a tuple of (name, value)
  trace_context(pairs)   the same, also when tracing is off here (to pass them on)
  start(name, parent, kind, attributes)
                         a started span (None when off); `parent`: trace headers, or a
                         span of this process
  headers(span)          the trace headers to send on an outgoing call for `span` (())
  response_headers(span) the `traceresponse` header to return to the caller `span` serves
  end(span, error)       set attributes given at the end, an error status, end the span
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Iterable, Mapping
from typing import Any

TRACE_HEADERS = ("traceparent", "tracestate")
EXPORTERS = ("off", "console", "otlp")

_tracer: Any = None  # an opentelemetry Tracer while on


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but OpenTelemetry (or its OTLP exporter) is not installed."""


def enabled() -> bool:
    return _tracer is not None


def configure(exporter: Any, service_name: str = "prefixgate") -> None:
    """Turn tracing on with `exporter` ("console", "otlp" or a SpanExporter), or off."""
    global _tracer
    if exporter in (None, "", "off"):
        _tracer = None
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
    except ImportError:
        raise TracingUnavailable(
            "tracing needs OpenTelemetry: pip install 'prefixgate[tracing]' (or "
            "opentelemetry-api opentelemetry-sdk)") from None
    if exporter == "console":
        processor = SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr))
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError:
                raise TracingUnavailable(
                    "--otel-traces otlp needs an OTLP exporter: pip install "
                    "opentelemetry-exporter-otlp") from None
        # Batched, off the serving threads; what is left is flushed at exit.
        processor = BatchSpanProcessor(OTLPSpanExporter())
    else:
        processor = SimpleSpanProcessor(exporter)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(processor)
    atexit.register(provider.shutdown)
    # A provider of our own, not the global one: configuring again (tests) replaces it.
    _tracer = provider.get_tracer("prefixgate")


def incoming(pairs: Iterable[tuple[str, str]] | Mapping[str, str] | None
             ) -> tuple[tuple[str, str], ...]:
    """The W3C trace headers among a call's metadata or headers (() when off)."""
    return trace_context(pairs) if _tracer is not None else ()


def trace_context(pairs: Iterable[tuple[str, str]] | Mapping[str, str] | None
                  ) -> tuple[tuple[str, str], ...]:
    """The W3C trace headers among `pairs`, whether or not this process records spans: a
    hop that only passes the caller's context on (the vLLM adapter to vLLM) needs no
    tracer of its own."""
    if not pairs:
        return ()
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    return tuple((k.lower(), v) for k, v in items
                 if isinstance(v, str) and k.lower() in TRACE_HEADERS)


def start(name: str, parent: Any = (), kind: str = "server",
          attributes: Mapping[str, Any] | None = None) -> Any:
    """A started span, or None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if parent is None or isinstance(parent, tuple):
        context = TraceContextTextMapPropagator().extract(dict(parent)) if parent else None
    else:
        context = trace.set_span_in_context(parent)
    kinds = {"server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT,
             "internal": trace.SpanKind.INTERNAL}
    return _tracer.start_span(name, context=context, kind=kinds[kind],
                              attributes=dict(attributes or {}))


def headers(span: Any) -> tuple[tuple[str, str], ...]:
    """The traceparent (and tracestate) to send on a call made for `span`."""
    if span is None:
        return ()
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def response_headers(span: Any) -> tuple[tuple[str, str], ...]:
    """The `traceresponse` header (W3C Trace Context Level 2) naming `span`, for the
    reply to the call it serves: a client learns the trace id and the gateway's span of
    its turn, whether or not it sent a traceparent (() when off)."""
    if span is None:
        return ()
    ctx = span.get_span_context()
    return (("traceresponse",
             f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"),)


def end(span: Any, error: BaseException | str | None = None,
        attributes: Mapping[str, Any] | None = None) -> None:
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    if attributes:
        span.set_attributes(dict(attributes))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
    span.end()
