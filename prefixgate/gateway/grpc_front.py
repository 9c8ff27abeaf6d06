"""The Chat gRPC front of the gateway (prefixgate.v1.ChatService).

Contract: `ChatService(core)` holds one turn core (gateway/turn.py: admit, place, relay,
account; its docstring holds the turn's rules, failure handling included). `Chat` runs one
turn with the call's tenant (authenticated once, by the call guard `guard()` that
`rpc.add_service` runs before the request is parsed: a caller without a credential costs
no parsing) and deadline, and ends the call with the gRPC status of the core's `TurnError`
(`GRPC_STATUS`; its message as the core says it, whose field names are the proto's);
`ListModels` describes the served model. It knows nothing of the HTTP front
(gateway/http.py), which holds the same core; gateway/server.py assembles both.
"""

from __future__ import annotations

import time
import uuid

import grpc

from prefixgate.gateway import metrics
from prefixgate.gateway.turn import Caller, Failure, TurnCore, TurnError
from prefixgate.security import auth
from prefixgate.telemetry import tracing
from prefixgate.v1 import chat_pb2
from prefixgate.wire import rpc

__all__ = ["ChatService", "GRPC_STATUS", "SERVICE"]

SERVICE = chat_pb2.DESCRIPTOR.services_by_name["ChatService"]

# The gRPC status of each way a turn fails (gateway/turn.py Failure).
GRPC_STATUS = {
    Failure.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Failure.UNKNOWN_MODEL: grpc.StatusCode.NOT_FOUND,
    Failure.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Failure.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Failure.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Failure.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.FAILED: grpc.StatusCode.INTERNAL,
}


class ChatService:
    """The Chat gRPC service: each call is one turn of the core it holds, its TurnError
    the call's status (message as the core says it: its field names are the proto's)."""

    def __init__(self, core: TurnCore) -> None:
        self.core = core

    def guard(self) -> rpc.Guard | None:
        """The call guard `rpc.add_service` runs before parsing a request: the bearer
        token, when the core has tokens (the tenant it returns reaches `Chat`)."""
        return None if self.core.tokens is None else auth.tokens_guard(self.core.tokens)

    async def Chat(self, request: chat_pb2.ChatRequest, context: grpc.aio.ServicerContext):
        """The gRPC entry: `chat_events`, observed (request metrics, one log line per turn)."""
        request_id = uuid.uuid4().hex
        async for ev in metrics.observe_turn(
                "grpc:Chat", self.chat_events(request, context, request_id),
                request_id=request_id, conversation_id=request.conversation_id,
                status_of=metrics.grpc_status_of(context)):
            yield ev

    async def chat_events(self, request: chat_pb2.ChatRequest,
                          context: grpc.aio.ServicerContext, request_id: str):
        """One turn's ChatEvents for a gRPC call: the core's turn with the call's tenant
        and deadline; a TurnError aborts the call with its status."""
        remaining = context.time_remaining()
        caller = Caller(rpc.guarded(),  # the guard's tenant (None when tokens are off)
                        None if remaining is None else time.monotonic() + remaining,
                        tracing.incoming(context.invocation_metadata())
                        if tracing.enabled() else ())
        try:
            first = True
            async for ev in self.core.turn(request, caller, request_id):
                if first and caller.trace_reply:  # the turn span's traceresponse
                    await context.send_initial_metadata(tuple(caller.trace_reply))
                first = False
                yield ev
        except TurnError as exc:
            await context.abort(GRPC_STATUS[exc.kind], exc.message)

    async def ListModels(self, request, context) -> chat_pb2.ListModelsResponse:
        core = self.core
        return chat_pb2.ListModelsResponse(models=[chat_pb2.ModelInfo(
            name=core.spec.name, fingerprint=core.spec.fingerprint,
            max_context_tokens=core.spec.max_context_tokens,
            max_completion_tokens=core.spec.max_context_tokens - 1,
            block_size=core.config.block_size, num_workers=len(core.pool.healthy()))])
