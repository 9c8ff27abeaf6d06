"""A small Chat API client (torch-free), used by `prefixgate chat`, the demo and replay.

Contract: `ChatClient(address).turn(...)` sends one turn and returns a `TurnResult` with
the whole reply text, its token ids and the figures of the final event; `on_text` is
called with each text delta as it arrives. `tls` (rpc.TLSConfig: the gateway's CA, a
client certificate for mutual TLS) and `token` (sent as `authorization: Bearer <token>`)
are for gateways that require them. gRPC errors propagate as grpc.aio.AioRpcError.
"""

from __future__ import annotations

import asyncio
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2
from prefixgate.wire import rpc

FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_CANCELLED: "cancelled"}


@dataclass
class TurnResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    transferred_tokens: int = 0  # prompt tokens the worker pulled from a peer
    completion_tokens: int = 0
    dropped_tokens: int = 0  # oldest turns dropped to fit the context (context_overflow)
    finish_reason: str = ""
    worker_id: str = ""
    queue_ms: float = 0.0
    ttft_ms: float = 0.0  # as reported by the gateway
    total_ms: float = 0.0
    client_ttft_ms: float = 0.0  # measured here, network included
    # The gateway's routing decision: cached tokens it predicted on the serving worker and
    # on the best-cached worker (their difference is the decision's regret).
    predicted_cached_tokens: int = 0
    best_predicted_cached_tokens: int = 0
    predicted_transferred_tokens: int = 0  # ... and predicted to arrive by a pull
    num_resumes: int = 0  # times the reply went on on another worker (gateway/resume.py)


class ChatClient:
    def __init__(self, address: str, tls: rpc.TLSConfig | None = None, token: str = "") -> None:
        self.channel = rpc.channel(address, tls,
                                   (("authorization", f"Bearer {token}"),) if token else ())
        self.stub = chat_pb2_grpc.ChatServiceStub(self.channel)

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the channel is connected; TimeoutError after `timeout_s`."""
        await asyncio.wait_for(self.channel.channel_ready(), timeout_s)

    async def list_models(self, timeout_s: float = 10.0) -> chat_pb2.ListModelsResponse:
        return await self.stub.ListModels(chat_pb2.ListModelsRequest(), timeout=timeout_s)

    async def turn(self, messages: Sequence[tuple[str, str]] | None = None, *,
                   prompt_token_ids: Sequence[int] | None = None, conversation_id: str = "",
                   namespace: str = "", sampling: common_pb2.SamplingParams | None = None,
                   timeout_s: float | None = None,
                   on_text: Callable[[str], None] | None = None,
                   no_resume: bool = False) -> TurnResult:
        request = chat_pb2.ChatRequest(conversation_id=conversation_id, namespace=namespace,
                                       sampling=sampling or common_pb2.SamplingParams(),
                                       no_resume=no_resume)
        if isinstance(prompt_token_ids, array) and prompt_token_ids.itemsize == 4 \
                and sys.byteorder == "little":
            # Packed: 4 bytes per id, little-endian, no per-id work on either side.
            request.packed_prompt_token_ids = prompt_token_ids.tobytes()
        elif prompt_token_ids is not None:
            request.prompt_token_ids.token_ids.extend(prompt_token_ids)
        else:
            request.messages.messages.extend(
                chat_pb2.ChatMessage(role=r, content=c) for r, c in messages or ())
        result = TurnResult()
        start = time.monotonic()
        async for ev in self.stub.Chat(request, timeout=timeout_s):
            if ev.HasField("delta"):
                if not result.client_ttft_ms:
                    result.client_ttft_ms = (time.monotonic() - start) * 1e3
                result.text += ev.delta.text
                result.token_ids.extend(ev.delta.token_ids)
                if on_text is not None and ev.delta.text:
                    on_text(ev.delta.text)
            else:
                f = ev.final
                result.prompt_tokens = f.usage.prompt_tokens
                result.cached_tokens = f.usage.cached_tokens
                result.transferred_tokens = f.usage.transferred_tokens
                result.completion_tokens = f.usage.completion_tokens
                result.dropped_tokens = f.usage.dropped_tokens
                result.finish_reason = FINISH_NAMES.get(f.finish_reason, "unspecified")
                result.worker_id = f.worker_id
                result.predicted_cached_tokens = f.predicted_cached_tokens
                result.best_predicted_cached_tokens = f.best_predicted_cached_tokens
                result.predicted_transferred_tokens = f.predicted_transferred_tokens
                result.num_resumes = f.num_resumes
                result.queue_ms, result.ttft_ms, result.total_ms = (
                    f.timings.queue_ms, f.timings.ttft_ms, f.timings.total_ms)
        return result

    async def close(self) -> None:
        await self.channel.close()

