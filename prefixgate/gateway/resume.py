"""Mid-stream resume: a reply whose worker is lost after its first token goes on, on
another worker, as one unbroken stream.

Contract: `Reply(resumer, worker, gen, remaining_s, opt_out)` is the worker event stream
(GenerateEvent: chunks, then one final) of one turn attempt, as the turn path relays it
(gateway/turn.py), plus the resume: iterate it like `worker.client.Generate(gen)`.
`Resumer` is what a resume needs of the gateway, typed: the turn core's `Placer`
(gateway/placement.py: route, place, mark down, the very step the turn path takes), the
tokenizer the seam is decoded with, and the model's context window.

* While the first worker streams, its events pass through unchanged.
* When that worker is **lost** (the call fails with UNAVAILABLE, the transport's code,
  or its stream ends without a final event) after at least one token was relayed, the
  worker is marked down (as the turn path does: health comes from transport errors) and
  the reply continues: the prompt plus the token ids already relayed is placed like a
  new turn (`Placer.route` and `Placer.place`: whatever of it is cached or transferable
  is reused) on the best other healthy worker, asking for the tokens left
  (max_tokens - relayed). Its token ids follow the relayed ones with nothing missing or
  repeated; their text is decoded here (`StreamDecoder`, fed the relayed ids first), so
  a character or a stop string that spans the seam comes out as one uninterrupted run
  would give it. The final event is the continuation's, with usage counted for the
  original prompt: prompt tokens as first sent, completion = relayed + continued,
  cached/transferred = what the continuation found of the original prompt.
* What holds: with greedy sampling (temperature 0) the continuation's tokens are those
  of an uninterrupted run (the same model on the same prefix picks the same tokens,
  within the engines' numerics: tests/faults/test_resume.py compares them). With seeded
  sampling the continuation is sent the request's seed and `seed_offset_tokens` = the
  tokens already relayed: a prefixgate worker draws one value set per sampled token from
  the seed's stream, so it skips that many draws and samples on from where the
  interrupted reply stood (the same tokens as an uninterrupted run, within the numerics),
  never repeating the draws already spent. A vLLM server takes no offset (its seed
  restarts its stream). Unseeded sampling continues as a new sample.
* It does not resume (the loss reaches the turn path as before: UNAVAILABLE, "retry is
  safe") when the client opted out (`ChatRequest.no_resume`, HTTP `"resume": false`),
  for several samples (n > 1), before the first token (the turn path's failover covers
  that), more than `MAX_RESUMES` times in one turn, for any failure that is not the
  worker's loss (a request's own error is never retried on another worker), or when no
  other worker is up. The continuation worker failing ends the stream the same way.
* `worker` is the worker serving the reply now (the continuation's after a resume);
  `num_resumes` counts resumes (the fronts tell clients: ChatFinal.num_resumes, the HTTP
  finishing chunk's / reply's `prefixgate_resumed`). Counted in
  `prefixgate:router_resumes_total{outcome}`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from prefixgate.gateway import metrics
from prefixgate.gateway.placement import Placer
from prefixgate.gateway.pool import WorkerHandle

# The incremental detokenizer the workers use (torch-free): the seam is decoded exactly
# as the worker would have decoded an uninterrupted reply.
from prefixgate.model.detokenizer import StreamDecoder
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.radix import packed, tokens_to_bytes
from prefixgate.v1 import common_pb2, worker_pb2
from prefixgate.wire.protocol import sampling_from_proto

log = logging.getLogger(__name__)

__all__ = ["MAX_RESUMES", "Reply", "Resumer"]

# Continuations of one turn. A worker's loss is not the request's doing, but a request
# that crashes workers looks the same from here: like failover before the first token
# (turn.MAX_RETRIES), one more worker at most, never a walk through the fleet.
MAX_RESUMES = 1


def _lost(code: grpc.StatusCode) -> bool:
    """A transport failure: the worker, not the request."""
    return code == grpc.StatusCode.UNAVAILABLE


class _StreamLost(Exception):
    """A worker stream that ended without its final event (the worker went away)."""


@dataclass(frozen=True, slots=True)
class Resumer:
    """What resuming a reply needs of the gateway (module docstring)."""

    placer: Placer
    tokenizer: ChatTokenizer  # the seam's text is decoded with it
    max_context_tokens: int


class Reply:
    def __init__(self, resumer: Resumer, worker: WorkerHandle,
                 gen: worker_pb2.GenerateRequest, remaining_s: Callable[[], float | None],
                 opt_out: bool = False, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.resumer = resumer
        self.worker = worker
        self.gen = gen
        self.remaining_s = remaining_s
        self.opt_out = opt_out
        self.metadata = metadata  # sent with every Generate call (trace context)
        self.num_resumes = 0
        self._sent: list[int] = []  # token ids relayed to the client so far

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateEvent]:
        return self._events()

    async def _stream(self, worker: WorkerHandle, gen: worker_pb2.GenerateRequest):
        extra = {"metadata": self.metadata} if self.metadata else {}
        call = worker.client.Generate(gen, timeout=self.remaining_s(), **extra)
        try:
            # read(), not `async for`: grpc.aio's iterator is one more async generator a
            # call, left suspended after the final event (closed later by the loop's
            # finalizer, a task a turn).
            while (ev := await call.read()) is not grpc.aio.EOF:
                yield ev
                if ev.HasField("final"):
                    return
        finally:
            call.cancel()  # a no-op once the call ended; else the worker stops generating
        raise _StreamLost()

    async def _events(self):
        try:
            async with contextlib.aclosing(self._stream(self.worker, self.gen)) as events:
                async for ev in events:
                    if ev.HasField("chunk"):
                        self._sent.extend(ev.chunk.token_ids)
                    yield ev
            return
        except (grpc.aio.AioRpcError, _StreamLost) as exc:
            lost = isinstance(exc, _StreamLost) or _lost(exc.code())
            why = self._why_not(lost)
            if why:
                if lost and self._sent:
                    metrics.RESUMES.labels(why).inc()
                if isinstance(exc, _StreamLost):  # the turn path's own wording for it
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                        "stream ended without a final event") from None
                raise
            detail = "stream ended" if isinstance(exc, _StreamLost) else exc.details()
        lost_worker = self.worker
        self.resumer.placer.mark_down(lost_worker, f"lost mid-stream: {detail}")
        async for ev in self._continue(lost_worker):
            yield ev

    def _why_not(self, lost: bool) -> str:
        """Why this failure is not resumed ("" when it is)."""
        if not lost or not self._sent:
            return "not_lost"
        if self.opt_out:
            return "opted_out"
        if self.gen.sampling.n > 1:
            return "samples"
        if self.num_resumes >= MAX_RESUMES:
            return "budget"
        return ""

    async def _continue(self, lost_worker: WorkerHandle):
        resumer, gen = self.resumer, self.gen
        sent = list(self._sent)
        prompt = packed(gen.packed_prompt_token_ids)  # the turn path always sends it packed
        asked = sampling_from_proto(gen.sampling, len(prompt), resumer.max_context_tokens)
        left = asked.max_tokens - len(sent)
        ids = packed(gen.packed_prompt_token_ids + tokens_to_bytes(sent))
        turn, decision = resumer.placer.route(ids, gen.namespace, exclude=lost_worker,
                                              memo=False)
        if left <= 0 or not decision.ranked:
            metrics.RESUMES.labels("no_worker" if left > 0 else "not_lost").inc()
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(),
                                       f"worker {lost_worker.worker_id} was lost mid-reply "
                                       "and no other worker is up")
        worker = decision.ranked[0]
        self.num_resumes += 1
        cont = worker_pb2.GenerateRequest(
            request_id=f"{gen.request_id}.r{self.num_resumes}",
            packed_prompt_token_ids=ids.obj, sampling=gen.sampling,
            namespace=gen.namespace)
        cont.sampling.max_tokens = left
        if cont.sampling.HasField("seed"):  # the seed's stream goes on past what was sent
            cont.sampling.seed_offset_tokens += len(sent)
        placed = resumer.placer.place(turn, decision, worker, cont)
        log.info("request %s: worker %s lost after %d tokens; resuming on %s (%d prompt + "
                 "%d sent tokens, %d expected cached)", gen.request_id,
                 lost_worker.worker_id, len(sent), worker.worker_id, len(prompt), len(sent),
                 decision.cached_tokens_of(worker.worker_id))
        metrics.RESUMES.labels("resumed").inc()
        self.worker = worker
        # The seam's text: decode the relayed ids first (their text went out already).
        decoder = StreamDecoder(resumer.tokenizer, asked.stop)
        for t in sent:
            decoder.push(t)
        started = time.monotonic()
        try:
            async with contextlib.aclosing(self._stream(worker, cont)) as events:
                async for ev in events:
                    if ev.HasField("chunk"):
                        if ev.chunk.token_ids:
                            placed.first_token()
                        text = "".join(decoder.push(t) for t in ev.chunk.token_ids)
                        if decoder.stopped:  # a stop string across the seam, or within
                            yield _chunk(ev.chunk, text)
                            yield _final(ev_final=None, prompt=len(prompt), sent=len(sent),
                                         completion=len(decoder.token_ids) - len(sent),
                                         reason=common_pb2.FINISH_REASON_STOP, started=started)
                            return
                        yield _chunk(ev.chunk, text)
                        continue
                    rest = decoder.flush()
                    if rest:
                        yield _chunk(None, rest)
                    yield _final(ev.final, prompt=len(prompt), sent=len(sent),
                                 completion=ev.final.usage.completion_tokens,
                                 reason=ev.final.finish_reason, started=started)
                    return
        except _StreamLost:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(),
                                       f"worker {worker.worker_id} (resuming) ended its "
                                       "stream without a final event") from None
        finally:
            placed.close()


def _chunk(chunk: worker_pb2.GenerateChunk | None, text: str) -> worker_pb2.GenerateEvent:
    """The continuation's chunk (its token ids and log probabilities) with the text decoded
    here; no chunk: text alone (what the decoder held back, at the end)."""
    out = worker_pb2.GenerateChunk()
    if chunk is not None:
        out.CopyFrom(chunk)
    out.text = text
    return worker_pb2.GenerateEvent(chunk=out)


def _final(ev_final: worker_pb2.GenerateFinal | None, *, prompt: int, sent: int,
           completion: int, reason: int, started: float) -> worker_pb2.GenerateEvent:
    """The continuation's final event, counted for the original prompt (module
    docstring)."""
    final = worker_pb2.GenerateFinal()
    if ev_final is not None:
        final.CopyFrom(ev_final)
    usage = final.usage
    cached = min(usage.cached_tokens, prompt)
    transferred = min(usage.transferred_tokens, prompt - cached)
    usage.prompt_tokens = prompt
    usage.cached_tokens = cached
    usage.transferred_tokens = transferred
    usage.completion_tokens = sent + completion
    final.finish_reason = reason
    del final.sample_finish_reasons[:]
    final.sample_finish_reasons.append(reason)
    if ev_final is None:
        final.timings.total_ms = (time.monotonic() - started) * 1e3
    return worker_pb2.GenerateEvent(final=final)
