"""A vLLM server as a prefixgate worker: the Worker API over vLLM's HTTP API and KV events.

Seam
----
`VLLMWorker` implements the Worker API (`prefixgate.v1.WorkerService`) the gateway already
speaks to its own workers, backed by one vLLM server: its OpenAI HTTP API for turns and
model checks (engines/vllm_http.py), its KV cache events over ZMQ mapped onto
prefixgate's block hashes (engines/vllm_events.py, engines/vllm_stream.py) into a
`workerapi/events.EventLog`, and its /metrics for load. Everything past the Worker API is
unchanged, so a fleet may mix vLLM servers and prefixgate workers, and routing, predicted
ownership, failover, limits, auth and namespaces apply to both. The one object serves two
ways:
  - in the gateway's process (`prefixgate gateway --vllm-worker URL,tcp://HOST:5557`):
    its call-level methods called directly through workerapi/client.py
    `InProcessWorkerClient`, which gateway/pool.py holds as the worker's client (no gRPC,
    no extra hop); the gateway follows its WatchEvents like any worker's;
  - as its own process (`prefixgate worker --engine vllm --vllm-url URL --vllm-events
    tcp://HOST:5557`, the Kubernetes form: a sidecar of the vLLM pod): served over gRPC
    by workerapi/server.serve like any worker, so it registers in Redis under a lease,
    publishes the mapped events there, and takes mTLS and the internal credential.

Contract
--------
- `start()` begins following the server (events, and /metrics every `metrics_interval_s`)
  and `close()` stops. Until the server answers and passed the model check, GetInfo is
  UNAVAILABLE (the pool keeps it down); `serving()` is whether it answers now.
- Model check (on each (re)connection): vLLM exposes no weights digest, so the check
  covers what it does expose: the chat template and tokenizer (the token ids of probe
  chats and texts through vLLM's /tokenize must equal the gateway's own), and, when the
  served model's `root` is a directory on this host, its tokenizer and config files
  (prefixgate's model fingerprint over them, weights aside). A mismatch is reported in
  GetInfo as another fingerprint, with the reason in `model_name`, so the gateway
  refuses the worker saying why. vLLM's `max_model_len` bounds the context if smaller.
- Generate: the request is validated as a prefixgate worker validates it (same limits,
  INVALID_ARGUMENT request-scoped), then sent to vLLM's /v1/completions as token ids
  (`return_token_ids`, streamed with usage; a namespace as vLLM's `cache_salt`, so
  tenants never share cache there either: an HMAC of it under `VLLMConfig.salt_key`
  (`cache_salt`), so that no other client of the server can compute a tenant's salt and
  probe its cache; the events' salt is mapped back through the salts of the namespaces
  sent recently). Chunks become GenerateChunks (ids and text),
  the usage (`prompt_tokens_details.cached_tokens`, which needs vLLM's
  `--enable-prompt-tokens-details`) the GenerateFinal. vLLM errors map as
  engines/vllm_http.py says: unreachable/503 is UNAVAILABLE (the gateway re-routes a turn
  that has not started), 400 is INVALID_ARGUMENT scoped to the request. A client that goes
  away closes the HTTP stream, which aborts the request in vLLM.
- Context overflow: a turn that does not fit vLLM's context is INVALID_ARGUMENT unless it
  asks for `context_overflow` keep-system-drop-oldest; then the adapter drops its oldest
  whole turns as a prefixgate worker does (model/overflow.py `plan_overflow`: preamble
  kept, the fewest oldest turns dropped so prompt + max_tokens fit; when even the preamble
  and the last turn fill the context, the turn ends at once with LENGTH) and sends vLLM
  the kept prompt; `Usage.dropped_tokens` says how many tokens were dropped. With the
  connector and `shifted_reuse` shift or blend (vLLM can only compute after a loaded
  prefix, so blend runs as shift there), the kept turns' cached KV is loaded moved back
  instead of recomputed: the request carries `ShiftParams` (the chains of the earlier
  layouts the connector's host store may hold them under, model/overflow.py
  `shift_layouts`), a cache salt of its own (so vLLM's cache never serves what is
  computed after moved K/V to an exact request; that salt is not mapped back, so those
  blocks never enter the gateway's index) and salted block hashes (docs/reindex.md), and
  `cached_tokens` counts the moved tokens. `recompute` sends the kept prompt as any turn.
- GetInfo's `reuse_block_tokens` is vLLM's block size: vLLM reuses only whole blocks of
  its own size, so the gateway rounds what it predicts cached there down to them.
- Status: running and waiting requests and KV use from vLLM's /metrics (all clients of
  the server; polled at the gateway's status interval, or less often if a poll costs over
  1 % of the time between polls), the KV capacity from its cache configuration; queued prefill from the
  turns sent through this object not yet at their first token, less what the event-fed
  mapping says vLLM holds of their prompts; service rates measured on finished turns
  (a turn's time to first token covers the prefill queued ahead of it here as well as its
  own), the prefill rate probed at start-up until a turn measures it (`_probe_prefill`).
- Log probabilities (`sampling.top_logprobs`) come from vLLM's `logprobs` (its raw mode:
  the model's distribution before sampling parameters), tokens named by id.
- Block transfer goes through prefixgate's KV connector inside vLLM
  (prefixgate/vllm_connector/), when the server runs it (`VLLMConfig.export`: its
  ExportBlocks address). Every turn then carries its prompt's prefixgate block hashes in
  vLLM's per-request `kv_transfer_params`, under which the connector keeps the blocks vLLM
  computes (so peers can pull them); a Generate's pull spec becomes the pull the connector
  makes before vLLM prefills the rest: the holder's ExportBlocks address (`peers` maps the
  registry address of a vLLM peer to its connector's; a prefixgate worker's address is its
  own), the chain, the leading blocks to load, the ticket unchanged. Usage splits vLLM's
  cached tokens (it counts loaded ones as cached) into cached and transferred: those past
  what vLLM held here (its events say), up to what the pull offered. The status reports
  `kv_bytes_per_token` (the model's layers, KV heads and head dim at `kv_dtype`) and the
  transfer rate: declared (`transfer_bytes_per_s`) until pulls measure it (the set-up and
  rate the connector fitted to its own loads, read from its export's GetStatus after a
  pulled turn). An export served over mutual TLS (`grpcs://`, as `up --secure` starts
  them) is called with `VLLMConfig.export_client_tls`, its certificate checked against
  this worker's id. ExportBlocks
  relays the connector's stream (a prefixgate worker may pull from vLLM through this
  adapter's gRPC server, the sidecar form).
- Drain hand-off (workerapi/handoff.py; the sidecar form, which drains on SIGTERM): as a
  holder, this worker offers the prompts it served whose blocks vLLM still holds (its
  events say), the most recent first, each as its chain with its token ids and
  namespace (remembered for up to `HANDOFF_MEMORY_TOKENS` prompt tokens); peers pull
  them through ExportBlocks. As a receiver, PullBlocks needs the chain's token ids
  (PullBlocksRequest.token_ids, FAILED_PRECONDITION without them): vLLM loads KV only
  for a request, so the pull is a one-token request over those tokens with the pull in
  its `kv_transfer_params` (the connector loads the chain from the holder before vLLM
  prefills; what it cannot load is computed), answered once vLLM has them cached.
  Without a connector, ExportBlocks is
  UNIMPLEMENTED, `kv_bytes_per_token` 0 (routing never plans a transfer with it), a
  pull spec is ignored (vLLM computes what it does not hold), PullBlocks is UNIMPLEMENTED
  and the drain hands nothing off.
- FlushCache: vLLM's /reset_prefix_cache (offered by vLLM only in its dev mode:
  UNIMPLEMENTED otherwise, saying so).
- Events: a turn that must have cached new blocks starts the event stream's stall clock
  (engines/vllm_stream.py); with vLLM's prefix caching off, no events are expected. A
  server whose process start time (in /metrics) changed was restarted: its blocks are
  forgotten at once (its new event stream may stay silent until a turn comes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from prefixgate.engines.vllm_events import VLLMEventMapper
from prefixgate.engines.vllm_http import VLLMClient, VLLMError, VLLMMetrics
from prefixgate.engines.vllm_stream import VLLMEventStream
from prefixgate.model.catalog import ModelSpec, _fingerprint
from prefixgate.model.overflow import (
    OverflowPlan,
    layout_hashes,
    plan_overflow,
    shift_layouts,
    user_turn_prefix,
)
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.radix import Hashers, HashMemo
from prefixgate.radix import packed as packed_ids
from prefixgate.telemetry.tracing import trace_context
from prefixgate.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from prefixgate.vllm_connector.params import PullParams, ShiftParams, TransferParams
from prefixgate.wire.protocol import InvalidRequest, clip
from prefixgate.wire.rpc import TLSConfig, channel_credentials
from prefixgate.wire.token_ids import repeated_token_ids
from prefixgate.workerapi.api import FinalEvent, FinishReason
from prefixgate.workerapi.calls import CallScope, Refused
from prefixgate.workerapi.handoff import HandoffChain
from prefixgate.workerapi.rates import ServiceRates, TransferRate
from prefixgate.workerapi.server import FINISH_TO_PROTO, WorkerConfig, WorkerServiceBase
from prefixgate.workerapi.transfer import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

__all__ = ["PrefillQueue", "VLLMConfig", "VLLMWorker"]

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
PROBE_TOKENS = (32, 544)  # the prefill probe's two prompt lengths (tokens)
# Probes of the model check: a chat with the template's roles, and text with multi-byte
# characters and digits (where tokenizers differ first).
_PROBE_CHAT = (("system", "You are a helpful assistant."),
               ("user", "What is the capital of France? Answer briefly, please."),
               ("assistant", "Paris."), ("user", "Et le musée le plus célèbre ? 🙂 2024-11-26"))
_PROBE_TEXTS = ("Hello, world! The quick brown fox jumps over 13 lazy dogs.",
                "  naïve café — 東京 Zürich\n\tdef f(x): return x**2  ")
_NAMESPACE_PREFIX_TOKENS = 16  # tokens of a prompt remembered with its namespace
MAX_SHIFT_LAYOUTS = 8  # earlier layouts a shifted load names (the undropped, recent drops)
METRICS_BUDGET = 0.01  # most share of the time spent polling one server's /metrics
MAX_POLL_GAP_S = 1.0  # longest wait between two /metrics polls (seconds)
# Prompt tokens of the turns served here remembered for the drain hand-off (4 bytes each).
HANDOFF_MEMORY_TOKENS = 1 << 20


@dataclass(frozen=True)
class VLLMConfig:
    """One vLLM server: its HTTP API and KV event endpoints (units: seconds)."""

    url: str  # e.g. http://vllm-0:8000
    events: str  # vLLM's kv-events `endpoint` as seen from here, e.g. tcp://vllm-0:5557
    replay: str = ""  # its `replay_endpoint`, e.g. tcp://vllm-0:5558 ("": none)
    topic: str = ""  # its kv-events `topic`
    api_key: str = ""  # vLLM's --api-key, if set
    metrics_interval_s: float = 0.05  # /metrics polls (the gateway's status interval)
    stall_s: float = 5.0  # no event this long after a turn that cached blocks: stale
    max_mapped_blocks: int = 1 << 20  # vLLM blocks remembered (until its count is known)
    export: str = ""  # host:port of its prefixgate KV connector's ExportBlocks ("": none)
    # The export is served over mutual TLS (the form's `grpcs://`): called with
    # `export_client_tls` (the gateway's --worker-tls-* files: its CA, its client
    # certificate), the server's certificate checked against its worker id.
    export_tls: bool = False
    export_client_tls: TLSConfig = TLSConfig()
    kv_dtype: str = "float32"  # its KV cache's element type (its --dtype)
    transfer_bytes_per_s: float = 1e9  # the link rate declared until pulls measure it
    # The key of the namespaces' cache salts (`cache_salt`), the same at every gateway
    # sending to this server (`cache_salt_key` of the gateways' shared key); b"": a random
    # key of this adapter's own (salts then differ per process: no cache shared across
    # gateways, none kept across a restart of this process).
    salt_key: bytes = field(default=b"", repr=False)

    @classmethod
    def parse(cls, text: str, **kw) -> VLLMConfig:
        """`URL,EVENTS[,REPLAY][,grpc://HOST:PORT][,key-file:PATH]` (the --vllm-worker
        form: its prefixgate KV connector's ExportBlocks, `grpcs://` when served over TLS;
        a file holding its --api-key, read now); ValueError saying what is wrong."""
        parts = [p.strip() for p in text.split(",")]
        if len(parts) > 2 and parts[-1].startswith("key-file:"):
            path = parts.pop().removeprefix("key-file:")
            try:
                kw["api_key"] = Path(path).read_text().strip()
            except OSError as exc:
                raise ValueError(f"{text!r}: cannot read the API key file {path}: "
                                 f"{exc.strerror}") from None
        export = ""
        if len(parts) > 2 and parts[-1].startswith(("grpc://", "grpcs://")):
            kw["export_tls"] = parts[-1].startswith("grpcs://")
            export = parts.pop().split("://", 1)[1]
        if not 2 <= len(parts) <= 3 or not parts[0].startswith(("http://", "https://")) \
                or not all(p.startswith(("tcp://", "ipc://")) for p in parts[1:]) \
                or (export and ":" not in export):
            raise ValueError(f"{text!r}: give a vLLM server as URL,EVENTS[,REPLAY][,EXPORT], "
                             "e.g. http://127.0.0.1:8000,tcp://127.0.0.1:5557 (its HTTP API and "
                             "its --kv-events-config endpoint, replay_endpoint if set, and "
                             "grpc://HOST:PORT of its prefixgate KV connector if it runs one, "
                             "grpcs:// if over TLS)")
        return cls(parts[0], parts[1], parts[2] if len(parts) == 3 else "", export=export, **kw)

    @property
    def address(self) -> str:
        """How the gateway's registry lists it (never a gRPC address)."""
        return f"vllm+{self.url}"


class _Sent:
    """One turn in a `PrefillQueue`: its tokens still to prefill and its block hashes."""

    __slots__ = ("pending_tokens", "block_hashes")

    def __init__(self, pending_tokens: int, block_hashes: Sequence[int]) -> None:
        self.pending_tokens = pending_tokens
        self.block_hashes = block_hashes


class PrefillQueue:
    """The prefill one vLLM server has been sent and not yet done, in prompt tokens, as its
    adapter reports it (`WorkerStatus.num_queued_prefill_tokens`) and measures its rate by.

    `admit(num_prompt_tokens, held_tokens, block_hashes)` counts a turn sent: its prompt
    less what it will not prefill, the larger of `held_tokens` (vLLM's events say the
    server holds them) and the prefix it shares with a prompt sent here earlier and not
    ended (its `block_hashes`, chained, in `block_size`-token blocks), at most all but its
    last token. `first_token` takes a turn's pending tokens off (its prefill is done),
    `end` takes off what is left and forgets its blocks; each is safe to call twice.

    Why the in-flight prefix counts: vLLM reuses the blocks an earlier prompt computes
    before a later one sharing them is scheduled (waiting prefill goes in arrival order),
    so the later one prefills only the rest. Counting its whole prompt made a server
    still prefilling a shared document read as twice the queue it had, and a second
    question about the document went to compute it again on another server."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.num_queued_tokens = 0
        self._blocks: Counter[int] = Counter()  # hash -> turns in flight whose prompt has it

    def admit(self, num_prompt_tokens: int, held_tokens: int,
              block_hashes: Sequence[int] = ()) -> _Sent:
        shared = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            shared += 1
        reused = max(held_tokens, min(num_prompt_tokens - 1, shared * self.block_size))
        sent = _Sent(max(0, num_prompt_tokens - reused), block_hashes)
        self.num_queued_tokens += sent.pending_tokens
        self._blocks.update(block_hashes)
        return sent

    def first_token(self, sent: _Sent) -> None:
        self.num_queued_tokens -= sent.pending_tokens
        sent.pending_tokens = 0

    def end(self, sent: _Sent) -> None:
        self.first_token(sent)
        blocks = self._blocks
        for h in sent.block_hashes:
            blocks[h] -= 1
            if blocks[h] <= 0:
                del blocks[h]
        sent.block_hashes = ()


class VLLMWorker(WorkerServiceBase):
    def __init__(self, spec: ModelSpec, tokenizer: ChatTokenizer, config: WorkerConfig,
                 vllm: VLLMConfig) -> None:
        super().__init__(spec, config)
        self.tokenizer = tokenizer
        self.vllm = vllm
        self.client = VLLMClient(vllm.url, api_key=vllm.api_key)
        self.hashers = Hashers(config.block_size, spec.fingerprint)
        # First tokens of recent prompts -> namespaces they were sent in (for vLLM
        # releases whose events do not carry the cache salt).
        self._namespaces: OrderedDict[tuple[int, ...], set[str]] = OrderedDict()
        self._salts: dict[str, str] = {}  # cache_salt sent -> its namespace
        self._salt_key = vllm.salt_key or secrets.token_bytes(32)
        self.mapper = VLLMEventMapper(self.hashers, self.events, vllm.max_mapped_blocks,
                                      namespace_of=self._namespace_of,
                                      namespace_of_salt=self._salts.get)
        self.stream = VLLMEventStream(vllm.events, self.mapper, vllm.replay, vllm.topic,
                                      stall_s=vllm.stall_s, name=config.worker_id)
        self.rates = ServiceRates()
        self.metrics = VLLMMetrics()
        self.reachable = False
        self._polled = False  # the server was asked at least once
        self.refusal = ""  # why the served model is not the gateway's ("": it is)
        self.served_model = ""
        self.max_context_tokens = spec.max_context_tokens
        self.turn_prefix = user_turn_prefix(tokenizer)  # opens a user turn (overflow)
        self._memo = HashMemo(8 << 20)
        self._in_flight = 0
        self._queue = PrefillQueue(self.config.block_size)  # turns sent here, their prefill
        self._tasks: list[asyncio.Task] = []
        # Registry address (or worker id) of each vLLM peer -> its connector's ExportBlocks.
        self.peers: dict[str, str] = {}
        self.kv_bytes_per_token = kv_bytes_per_token(spec.model_dir, vllm.kv_dtype) \
            if vllm.export else 0
        self.transfer_rate = TransferRate()
        if vllm.export and vllm.transfer_bytes_per_s > 0:
            self.transfer_rate.assume(vllm.transfer_bytes_per_s, 0.0, "declared")
        self._export_channel: grpc.aio.Channel | None = None
        # Prompts served here, for the drain hand-off: last full block's hash -> (the
        # prompt's block hashes, its full blocks' token ids packed, namespace).
        self._served: OrderedDict[int, tuple[tuple[int, ...], bytes, str]] = OrderedDict()
        self._served_tokens = 0
        self._probe: asyncio.Task | None = None  # the start-up prefill probe
        self._link_refresh: asyncio.Task | None = None  # reading the connector's link

    # ------------------------------------------------------------------ lifecycle

    async def start(self, wait_s: float = 5.0) -> None:
        """Follow the server; wait up to `wait_s` for it to answer and pass the model check
        (a gateway starting beside its vLLM servers then routes from its first turn)."""
        self._tasks = [asyncio.create_task(self.stream.run(), name="vllm-events"),
                       asyncio.create_task(self._follow_server(), name="vllm-metrics")]
        deadline = time.monotonic() + wait_s
        while not self._polled and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        self.close_watchers()
        extra = [t for t in (self._probe, self._link_refresh) if t is not None]
        for t in self._tasks + extra:
            t.cancel()
        await asyncio.gather(*self._tasks, *extra, return_exceptions=True)
        await self.client.close()
        await self.close_peers()
        if self._export_channel is not None:
            await self._export_channel.close()

    async def shutdown(self) -> None:
        await self.close()

    async def serving(self) -> bool:
        return self.reachable

    async def _follow_server(self) -> None:
        """Poll /metrics; on each (re)connection check the model first. Polls come every
        `metrics_interval_s`, or less often when one costs more than
        `METRICS_BUDGET` of the time between them: vLLM renders ~56 KB of Prometheus
        text per poll (about 1 ms here, on its side and again on ours), and this
        gateway's own turns count at once without it (its in-flight figures). Only a
        poll that answered counts as cost, and polls are never more than
        `MAX_POLL_GAP_S` apart: a poll that waited out its 2 s timeout (a server paused
        by SIGSTOP) once counted as 2 s of work, and the next came 200 s later, so the
        server was listed again ~170 s after it answered."""
        while True:
            cost_s = 0.0
            try:
                started = time.perf_counter()
                metrics = await self.client.metrics()
                cost_s = time.perf_counter() - started
                self._restarted(metrics)
                self.mapper.set_engine_blocks(metrics.num_blocks)
                if not self.reachable:
                    await self._check_model()
                self.metrics, self.reachable = metrics, True
            except VLLMError as exc:
                if self.reachable or not self._polled:  # once per outage
                    log.warning("vLLM worker %s at %s is down: %s", self.config.worker_id,
                                self.vllm.url, exc.message)
                self.reachable = False
            except Exception:  # never let one server's oddity stop following it
                log.exception("vLLM worker %s: following %s failed", self.config.worker_id,
                              self.vllm.url)
                self.reachable = False
            self._polled = True
            await asyncio.sleep(min(MAX_POLL_GAP_S, max(
                self.vllm.metrics_interval_s if self.reachable else 0.5,
                cost_s / METRICS_BUDGET)))

    def _restarted(self, metrics: VLLMMetrics) -> None:
        """A server process that started anew (maybe while unreachable) has an empty cache:
        forget its blocks now, before the gateway routes to it again, rather than when
        (if ever) its new event stream says so."""
        before = self.metrics.start_time
        if before and metrics.start_time and metrics.start_time != before:
            log.warning("vLLM worker %s at %s restarted: its cache is empty", self.config.worker_id,
                        self.vllm.url)
            self.mapper.reset()

    async def _check_model(self) -> None:
        models = await self.client.models()
        if not models:
            self.refusal = "serves no model"
            return
        entry = next((m for m in models if m.get("id") == self.spec.name), models[0])
        self.served_model = str(entry.get("id", ""))
        limit = entry.get("max_model_len")
        self.max_context_tokens = min(self.spec.max_context_tokens, int(limit)) \
            if isinstance(limit, int) and limit > 0 else self.spec.max_context_tokens
        self.refusal = await self._model_difference(entry)
        if self.refusal:
            log.error("vLLM worker %s at %s serves %s, not the gateway's %s: %s",
                      self.config.worker_id, self.vllm.url, self.served_model, self.spec.name,
                      self.refusal)
        else:
            log.info("vLLM worker %s at %s serves %s (tokenizer and chat template checked; "
                     "context %d tokens)", self.config.worker_id, self.vllm.url,
                     self.served_model, self.max_context_tokens)
            if not self.rates.prefill_tokens_per_s and self._probe is None:
                self._probe = asyncio.create_task(self._probe_prefill(), name="vllm-probe")

    async def _probe_prefill(self) -> None:
        """Time two uncached prompts (`PROBE_TOKENS`) and take the prefill rate from their
        difference, so that the router prices this server's prefill from its first turn.
        Until a turn measures it, a vLLM worker would otherwise be priced at the router's
        default rate, which on a CPU server is about 50 times too fast: its queues then
        look free, and a long document is recomputed next to the server that holds it
        rather than pulled or waited for. The difference cancels what any request costs
        whatever its length (the HTTP round trip, scheduling, the first decode step). Each
        probe runs under a fresh cache salt: it never hits a cached prefix, and its blocks
        are never mapped to a namespace. Both are points of the rate's fit
        (workerapi/rates.py), which the finished turns then extend."""
        short, long = PROBE_TOKENS
        words = self.tokenizer.encode_text(" ".join(f"probe {i} of the prefill rate."
                                                    for i in range(long)))
        seconds = []
        try:
            for n in (short, long):
                body = {"model": self.served_model, "max_tokens": 1, "prompt": words[:n],
                        "cache_salt": secrets.token_hex(16), "stream": True}
                started = time.monotonic()
                async with contextlib.aclosing(self.client.completions(body, 120.0)) as chunks:
                    async for _ in chunks:
                        pass
                seconds.append(time.monotonic() - started)
        except Exception as exc:  # best effort: a failed probe only leaves the default
            log.info("vLLM worker %s: no prefill probe (%s): priced at the router's default "
                     "until a turn measures it", self.config.worker_id,
                     getattr(exc, "message", None) or repr(exc))
            return
        for n, s in zip((short, long), seconds, strict=True):  # two points of its fit
            self.rates.observe_prefill(n, s)
        log.info("vLLM worker %s: prefill probed at %.0f tokens/s", self.config.worker_id,
                 self.rates.prefill_tokens_per_s)

    async def _model_difference(self, entry: dict) -> str:
        """Why the served model is not the gateway's ("" when every check passes)."""
        model = self.served_model
        for messages in (_PROBE_CHAT, _PROBE_CHAT[:2]):
            ours = self.tokenizer.encode_messages(messages)
            theirs = await self.client.tokenize({
                "model": model, "messages": [{"role": r, "content": c} for r, c in messages],
                "add_generation_prompt": True, "add_special_tokens": False})
            if ours != theirs:
                return "its chat template or tokenizer gives other token ids " + \
                    _first_difference(ours, theirs)
        for text in _PROBE_TEXTS:
            ours = self.tokenizer.encode_text(text)
            theirs = await self.client.tokenize({"model": model, "prompt": text,
                                                 "add_special_tokens": False})
            if ours != theirs:
                return "its tokenizer gives other token ids " + _first_difference(ours, theirs)
        root = Path(str(entry.get("root") or ""))
        if entry.get("root") and (root / "config.json").is_file():
            try:
                same = _fingerprint(root, "") == _fingerprint(self.spec.model_dir, "")
            except (OSError, ValueError) as exc:
                log.info("vLLM worker %s: cannot compare %s: %s", self.config.worker_id,
                         root, exc)
                same = True
            if not same:
                return (f"its model directory {root} has another config or tokenizer than "
                        f"the gateway's {self.spec.model_dir}")
        return ""

    # ------------------------------------------------------------------ Worker API

    async def get_info(self, request: worker_pb2.GetInfoRequest,
                       scope: CallScope) -> worker_pb2.WorkerInfo:
        if not self.reachable:
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          f"vLLM at {self.vllm.url} is not reachable (yet)")
        refused = bool(self.refusal)
        return worker_pb2.WorkerInfo(
            worker_id=self.config.worker_id,
            model_name=(f"vLLM serving {self.served_model}: {self.refusal}" if refused
                        else self.spec.name),
            model_fingerprint="vllm:" + self.served_model if refused else self.spec.fingerprint,
            block_size=self.config.block_size, max_context_tokens=self.max_context_tokens,
            kv_capacity_tokens=self.metrics.kv_capacity_tokens,
            reuse_block_tokens=self.reuse_block_tokens)

    @property
    def reuse_block_tokens(self) -> int:
        """vLLM reuses a cached prefix only in whole blocks of its own size (its config in
        /metrics, else its events; 0 until either says): a turn whose match ends inside
        one of its blocks is served that block's tokens anew, so the gateway must not
        count them as cached (gateway/routing.reusable_tokens)."""
        return self.metrics.block_size or self.mapper.engine_block_size

    def _status(self) -> worker_pb2.WorkerStatus:
        m = self.metrics
        return worker_pb2.WorkerStatus(
            num_running_requests=max(m.num_running_requests, self._in_flight),
            num_waiting_requests=m.num_waiting_requests,
            num_queued_prefill_tokens=self._queue.num_queued_tokens,
            kv_used_tokens=int(m.kv_usage * m.kv_capacity_tokens),
            kv_capacity_tokens=m.kv_capacity_tokens,
            prefill_tokens_per_s=self.rates.prefill_tokens_per_s,
            decode_step_s=self.rates.decode_step_s,
            kv_bytes_per_token=self.kv_bytes_per_token,
            transfer_bytes_per_s=self.transfer_rate.bytes_per_s if self.kv_bytes_per_token else 0,
            transfer_setup_s=self.transfer_rate.setup_s if self.kv_bytes_per_token else 0,
            transfer_rate_source=self.transfer_rate.source if self.kv_bytes_per_token else "")

    async def flush_cache(self, request: worker_pb2.FlushCacheRequest,
                          scope: CallScope) -> worker_pb2.FlushCacheResponse:
        held = self.mapper.num_held_blocks * self.config.block_size
        try:
            done = await self.client.reset_prefix_cache()
        except VLLMError as exc:
            raise Refused(exc.code, exc.message) from None
        if not done:
            raise Refused(grpc.StatusCode.UNIMPLEMENTED,
                          f"vLLM at {self.vllm.url} does not offer /reset_prefix_cache: "
                          "start it with VLLM_SERVER_DEV_MODE=1 to let prefixgate flush it")
        return worker_pb2.FlushCacheResponse(num_flushed_tokens=held)

    async def export_blocks(self, request: worker_pb2.ExportBlocksRequest, scope: CallScope):
        """The connector's export stream, relayed as it comes."""
        if not self.vllm.export:
            raise Refused(grpc.StatusCode.UNIMPLEMENTED,
                          f"vLLM at {self.vllm.url} runs no prefixgate KV connector, so it "
                          "cannot export KV blocks; the caller computes them")
        stub = worker_pb2_grpc.WorkerServiceStub(self._export())
        call = stub.ExportBlocks(request, timeout=scope.time_remaining())
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            raise Refused(exc.code(), f"{self.config.worker_id}: {exc.details()}") from None

    def _export(self) -> grpc.aio.Channel:
        """The channel to this server's connector export (opened on first use): over TLS
        when it is served so, its certificate checked against this worker's id (the name
        the connector's certificate carries: security/local.py `tls_name`)."""
        if self._export_channel is None:
            options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
            if self.vllm.export_tls:
                from prefixgate.security.local import tls_name

                self._export_channel = grpc.aio.secure_channel(
                    self.vllm.export, channel_credentials(self.vllm.export_client_tls),
                    options=[*options, ("grpc.ssl_target_name_override",
                                        tls_name(self.config.worker_id))])
            else:
                self._export_channel = grpc.aio.insecure_channel(self.vllm.export,
                                                                 options=options)
        return self._export_channel

    # ------------------------------------------------------------------ drain hand-off

    @property
    def hands_off(self) -> bool:
        return bool(self.vllm.export)

    def _remember_served(self, hashes: Sequence[int], prompt: memoryview, namespace: str
                         ) -> None:
        """Keep a served prompt's chain and tokens for the drain hand-off (bounded: the
        oldest are forgotten past HANDOFF_MEMORY_TOKENS)."""
        if not self.vllm.export or not hashes:
            return
        num_tokens = len(hashes) * self.config.block_size
        old = self._served.pop(hashes[-1], None)
        if old is not None:
            self._served_tokens -= len(old[1]) // 4
        self._served[hashes[-1]] = (tuple(hashes), prompt[:num_tokens].tobytes(), namespace)
        self._served_tokens += num_tokens
        while self._served_tokens > HANDOFF_MEMORY_TOKENS and len(self._served) > 1:
            _, (_, data, _) = self._served.popitem(last=False)
            self._served_tokens -= len(data) // 4

    async def handoff_chains(self) -> list[HandoffChain]:
        """The prompts served here whose leading blocks vLLM still holds, the most recent
        first, each cut to what it holds; a chain inside one already offered is left out
        (a conversation's earlier turns are prefixes of its latest)."""
        bs = self.config.block_size
        offered: set[int] = set()
        chains = []
        for hashes, data, namespace in reversed(self._served.values()):
            held = self.mapper.held_prefix_blocks(hashes)
            if not held or hashes[held - 1] in offered:
                continue
            offered.update(hashes[:held])
            chains.append(HandoffChain(hashes[:held], tuple(packed_ids(data[:4 * held * bs])),
                                       namespace))
        return chains

    async def pull_blocks(self, request: worker_pb2.PullBlocksRequest,
                          scope: CallScope) -> worker_pb2.PullBlocksResponse:
        """Load a peer's chain into vLLM's cache: vLLM loads KV only for a request, so
        this is a one-token request over the chain's tokens with the pull attached (the
        connector loads what the holder exports; vLLM computes the rest)."""
        if not self.vllm.export:
            raise Refused(grpc.StatusCode.UNIMPLEMENTED,
                          f"vLLM at {self.vllm.url} runs no prefixgate KV connector, so it "
                          "cannot load KV blocks from peers")
        if not request.peer_address or not request.block_hashes:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          "PullBlocks needs peer_address and block_hashes")
        bs = self.config.block_size
        num_blocks = len(request.block_hashes)
        if len(request.token_ids) < num_blocks * bs:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a vLLM worker loads KV only for a request: PullBlocks needs the chain's "
                f"token ids (token_ids: {bs} per block hash, {num_blocks * bs} here; "
                f"{len(request.token_ids)} sent)")
        try:
            tokens = repeated_token_ids(request.token_ids[:num_blocks * bs],
                                        self.tokenizer.vocab_size, "token_ids")
        except InvalidRequest as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        namespace = request.namespace
        hashes = self._memo.hash_blocks(self.hashers.get(namespace), tokens)
        if list(request.block_hashes) != hashes:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          "the token ids do not hash to the chain's block hashes (another "
                          "namespace, block size or model?)")
        if not self.reachable or self.refusal:
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          f"vLLM worker {self.config.worker_id} at {self.vllm.url} is not "
                          "serving")
        held = self.mapper.held_prefix_blocks(hashes)
        if held >= num_blocks:
            return worker_pb2.PullBlocksResponse(num_cached_blocks=num_blocks)
        peer = self.peers.get(request.peer_address) or self.peers.get(request.peer_worker_id) \
            or ("" if request.peer_address.startswith("vllm+") else request.peer_address)
        if not peer:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"no ExportBlocks address for {request.peer_worker_id}")
        prompt = tokens.tolist()
        self._remember_namespace(prompt, namespace)
        params = TransferParams(bs, self.spec.fingerprint, tuple(hashes), PullParams(
            peer, request.peer_worker_id, num_blocks, request.ticket))
        body = {"model": self.served_model, "prompt": prompt, "max_tokens": 1,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "kv_transfer_params": params.to_json()}
        if namespace:
            body["cache_salt"] = self._salt(namespace)
        started = time.monotonic()
        usage: dict = {}
        self._in_flight += 1
        try:
            async with contextlib.aclosing(self.client.completions(
                    body, scope.time_remaining(), trace_context(scope.metadata))) as chunks:
                async for chunk in chunks:
                    usage = chunk.get("usage") or usage
        except VLLMError as exc:
            raise Refused(exc.code, exc.message) from None
        finally:
            self._in_flight -= 1
        seconds = time.monotonic() - started
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        _, transferred = self._split_cached(len(prompt), cached, held * bs, params)
        if transferred:
            self._refresh_link()
        self._expect_events(len(prompt), cached, started)
        return worker_pb2.PullBlocksResponse(
            num_cached_blocks=num_blocks, num_pulled_blocks=transferred // bs,
            num_bytes=transferred * self.kv_bytes_per_token, seconds=seconds)

    def _pull_params(self, request: worker_pb2.GenerateRequest, hashes: Sequence[int]
                     ) -> TransferParams | None:
        """What the connector gets for this turn (None: the server runs no connector)."""
        if not self.vllm.export:
            return None
        pull = None
        spec = request.pull if request.HasField("pull") else None
        if spec is not None and spec.num_blocks:
            peer = self.peers.get(spec.peer_address) or self.peers.get(spec.peer_worker_id) \
                or ("" if spec.peer_address.startswith("vllm+") else spec.peer_address)
            if peer:
                pull = PullParams(peer, spec.peer_worker_id, spec.num_blocks, spec.ticket)
            else:
                log.info("vLLM worker %s: no ExportBlocks address for %s; computing instead",
                         self.config.worker_id, spec.peer_worker_id)
        return TransferParams(self.config.block_size, self.spec.fingerprint, tuple(hashes), pull)

    def _overflow_params(self, plan: OverflowPlan, namespace: str, mode: str
                         ) -> tuple[TransferParams | None, str]:
        """What the connector gets for an overflowing turn, and its cache salt ("": the
        namespace's): with the connector and a shifting mode, a shifted load under a salt
        of its own and salted hashes; else the kept prompt's exact hashes (recomputed)."""
        bs, kept = self.config.block_size, plan.kept
        hasher = self.hashers.get(namespace)
        if not self.vllm.export:
            return None, ""
        if (mode or "blend") == "recompute":
            return TransferParams(bs, self.spec.fingerprint,
                                  tuple(hasher.hash_blocks(kept))), ""
        hashes = layout_hashes(hasher, kept, len(kept) // bs, plan.n_keep // bs, salted=True)
        layouts = shift_layouts(plan, hasher, len(kept) - 1, MAX_SHIFT_LAYOUTS)
        shift = ShiftParams(plan.n_keep, tuple((d, tuple(c)) for d, c in layouts))
        salt = cache_salt(self._salt_key, "\x00shifted\x00" + namespace)
        return TransferParams(bs, self.spec.fingerprint, tuple(hashes), shift=shift), salt

    def _split_cached(self, prompt_tokens: int, cached: int, held_tokens: int,
                      params: TransferParams | None) -> tuple[int, int]:
        """vLLM's cached tokens (local hits and loaded ones together) as (cached here,
        transferred): transferred are those past what vLLM held here (`held_tokens`, its
        events say; in whole vLLM blocks) up to what the pull offered."""
        if params is None or params.pull is None:
            return cached, 0
        vbs = self.reuse_block_tokens or 1
        local = min(held_tokens, prompt_tokens - 1) // vbs * vbs
        offered = min(params.pull.num_blocks * params.block_size, prompt_tokens - 1) // vbs * vbs
        transferred = max(0, min(cached - local, offered - local))
        return cached - transferred, transferred

    def _namespace_of(self, first_block: Sequence[int]) -> str | None:
        seen = self._namespaces.get(tuple(first_block[:_NAMESPACE_PREFIX_TOKENS]))
        if not seen:
            return ""
        return next(iter(seen)) if len(seen) == 1 else None

    def _remember_namespace(self, prompt: Sequence[int], namespace: str) -> None:
        if len(prompt) < _NAMESPACE_PREFIX_TOKENS:
            return
        key = tuple(prompt[:_NAMESPACE_PREFIX_TOKENS])
        self._namespaces.setdefault(key, set()).add(namespace)
        self._namespaces.move_to_end(key)
        if len(self._namespaces) > 65536:
            self._namespaces.popitem(last=False)

    def _body(self, prompt: list[int], sampling, namespace: str,
              params: TransferParams | None = None, salt: str = "") -> dict:
        body: dict = {
            "model": self.served_model, "prompt": prompt, "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "n": sampling.n, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "skip_special_tokens": True,
        }
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.seed is not None:
            body["seed"] = continuation_seed(sampling.seed, sampling.seed_offset_tokens)
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.top_logprobs is not None:
            # vLLM's raw log probabilities (its default logprobs mode: before temperature,
            # top-k and top-p, as the Worker API defines them), tokens named by id.
            body["logprobs"] = sampling.top_logprobs
            body["return_tokens_as_token_ids"] = True
        if salt:  # a salt of its own (a shifted prompt): never mapped back to a namespace
            body["cache_salt"] = salt
        elif namespace:
            body["cache_salt"] = self._salt(namespace)
        if params is not None:
            body["kv_transfer_params"] = params.to_json()
        return body

    def _salt(self, namespace: str) -> str:
        salt = cache_salt(self._salt_key, namespace)
        if salt not in self._salts:
            if len(self._salts) >= 65536:  # client-chosen: bounded (forgotten: not placed)
                self._salts.clear()
            self._salts[salt] = namespace
        return salt

    async def generate(self, request: worker_pb2.GenerateRequest, scope: CallScope):
        packed, sampling = self._checked_generate(
            request, vocab_size=self.tokenizer.vocab_size,
            max_context_tokens=self.max_context_tokens, context_overflow="fail")
        plan = None
        if len(packed) + sampling.max_tokens > self.max_context_tokens:
            if sampling.context_overflow != "keep-system-drop-oldest":
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the prompt is {len(packed)} tokens and max_tokens {sampling.max_tokens}, "
                    f"over the context window of {self.max_context_tokens}: shorten the "
                    "conversation, or ask for context_overflow keep-system-drop-oldest to "
                    "drop its oldest turns", request_scoped=True)
            plan = plan_overflow(packed.tolist(), sampling.max_tokens,
                                 self.max_context_tokens, self.turn_prefix)
        if not self.reachable or self.refusal:
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          f"vLLM worker {self.config.worker_id} at {self.vllm.url} is not "
                          "serving; retrying on another worker is safe")
        prompt = packed.tolist()
        namespace = request.namespace
        self._remember_namespace(prompt, namespace)
        salt = ""  # "": the namespace's
        hashes: Sequence[int] = ()  # the gateway's blocks of it (an overflow's: not tracked)
        if plan is not None:
            if len(plan.kept) >= self.max_context_tokens:  # not even the last turn fits
                log.warning("request %s: the system prompt and the last turn alone (%d "
                            "tokens) fill the context of %d", clip(request.request_id),
                            len(plan.kept), self.max_context_tokens)
                yield _length_final(sampling.n, len(plan.kept), plan.dropped_tokens)
                return
            prompt = list(plan.kept)
            sampling = dataclasses.replace(sampling, max_tokens=min(
                sampling.max_tokens, self.max_context_tokens - len(prompt)))
            params, salt = self._overflow_params(plan, namespace, sampling.shifted_reuse)
            held_tokens = 0 if salt else self.mapper.held_prefix_blocks(
                self.hashers.get(namespace).hash_blocks(prompt)) * self.config.block_size
            log.info("request %s: dropped %d of %d prompt tokens to fit vLLM's context of "
                     "%d (%s)", clip(request.request_id), plan.dropped_tokens, len(plan.full),
                     self.max_context_tokens, "kept turns moved" if salt else "recomputed")
        else:
            hashes = self._memo.hash_blocks(self.hashers.get(namespace), packed)
            held_tokens = self.mapper.held_prefix_blocks(hashes) * self.config.block_size
            self._remember_served(hashes, packed, namespace)
            params = self._pull_params(request, hashes)
        # Prefill sent here earlier and not yet at its first token: this turn's first token
        # waits for it (vLLM schedules waiting prefill in arrival order), so its time to
        # first token measures the prefill of ahead + its own uncached tokens.
        ahead = self._queue.num_queued_tokens
        started = time.monotonic()
        ttft_ms = 0.0
        finish: dict[int, str] = {}
        usage: dict = {}
        self._in_flight += 1
        sent = self._queue.admit(len(prompt), held_tokens, hashes)
        try:
            # aclosing: a client that went away closes the HTTP stream at once (vLLM aborts).
            async with contextlib.aclosing(self.client.completions(
                    self._body(prompt, sampling, namespace, params, salt),
                    scope.time_remaining(), trace_context(scope.metadata))) as chunks:
                async for chunk in chunks:
                    for choice in chunk.get("choices") or ():
                        ids = choice.get("token_ids") or ()
                        text = choice.get("text") or ""
                        if ids and not ttft_ms:
                            ttft_ms = (time.monotonic() - started) * 1e3
                            self._queue.first_token(sent)
                        if ids or text:
                            yield worker_pb2.GenerateEvent(chunk=worker_pb2.GenerateChunk(
                                token_ids=ids, text=text, index=choice.get("index", 0),
                                logprobs=_logprobs(choice.get("logprobs"), len(ids),
                                                   sampling.top_logprobs)))
                        if choice.get("finish_reason"):
                            finish[choice.get("index", 0)] = choice["finish_reason"]
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        except VLLMError as exc:
            raise Refused(exc.code, exc.message,
                          request_scoped=exc.code == grpc.StatusCode.INVALID_ARGUMENT) from None
        finally:
            self._in_flight -= 1
            self._queue.end(sent)
        if not usage:
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          f"vLLM at {self.vllm.url} ended request {clip(request.request_id)} "
                          "without its usage (is it a vLLM OpenAI server?)")
        total_ms = (time.monotonic() - started) * 1e3
        prompt_tokens = int(usage.get("prompt_tokens") or len(prompt))
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        completion = int(usage.get("completion_tokens") or 0)
        reasons = [_FINISH.get(finish.get(i, ""), FinishReason.CANCELLED)
                   for i in range(sampling.n)]
        here, transferred = self._split_cached(prompt_tokens, cached, held_tokens, params)
        ttft_ms = ttft_ms or total_ms
        if transferred:
            self._refresh_link()
        else:
            # The share of the wait that was others' prefill counts as queue, so the rate is
            # the server's prefill throughput, not this turn's tokens over its whole wait.
            uncached = prompt_tokens - cached
            queue_ms = ttft_ms * ahead / (ahead + uncached) if ahead + uncached else 0.0
            self.rates.observe(FinalEvent(reasons[0], prompt_tokens, cached, completion // max(
                1, sampling.n), queue_ms, ttft_ms, total_ms))
        self._expect_events(prompt_tokens, cached, started)
        yield worker_pb2.GenerateEvent(final=worker_pb2.GenerateFinal(
            usage=common_pb2.Usage(prompt_tokens=prompt_tokens, cached_tokens=here,
                                   completion_tokens=completion,
                                   transferred_tokens=transferred,
                                   dropped_tokens=plan.dropped_tokens if plan else 0),
            finish_reason=FINISH_TO_PROTO[reasons[0]],
            sample_finish_reasons=[FINISH_TO_PROTO[r] for r in reasons],
            timings=common_pb2.Timings(ttft_ms=ttft_ms, total_ms=total_ms)))

    def _refresh_link(self) -> None:
        """After a pull into this server, read the link its connector measured on its own
        loads (the export's GetStatus: bytes and seconds of each load, where they moved) in
        the background. A pulled turn's time to first token cannot measure it: on a busy
        server it is mostly other requests' prefill and decode steps, and read as a link it
        came out at a few MB/s with seconds of set-up (the connector moved 93 MB in 0.53 s
        meanwhile), after which no pull was offered again."""
        if self._link_refresh is None or self._link_refresh.done():
            self._link_refresh = asyncio.create_task(self._read_link(), name="vllm-link")

    async def _read_link(self) -> None:
        stub = worker_pb2_grpc.WorkerServiceStub(self._export())
        try:
            status = await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            log.debug("vLLM worker %s: no link figures from its connector: %s",
                      self.config.worker_id, exc.details())
            return
        if status.transfer_rate_source == "measured" and status.transfer_bytes_per_s > 0:
            self.transfer_rate.adopt(status.transfer_bytes_per_s, status.transfer_setup_s)

    def _expect_events(self, prompt_tokens: int, cached_tokens: int, since: float) -> None:
        """A turn that filled new vLLM blocks makes vLLM publish: start the stall clock
        unless an event batch already came since the turn was sent."""
        vbs = self.metrics.block_size
        if not vbs or self.metrics.prefix_caching is False:
            return
        if prompt_tokens // vbs > cached_tokens // vbs and self.stream.last_batch_at < since:
            self.stream.expect_events(since)


def _length_final(n: int, prompt_tokens: int, dropped_tokens: int) -> worker_pb2.GenerateEvent:
    """The final of a turn the context cannot hold even after dropping (no tokens)."""
    length = FINISH_TO_PROTO[FinishReason.LENGTH]
    return worker_pb2.GenerateEvent(final=worker_pb2.GenerateFinal(
        usage=common_pb2.Usage(prompt_tokens=prompt_tokens, dropped_tokens=dropped_tokens),
        finish_reason=length, sample_finish_reasons=[length] * n))


def cache_salt(key: bytes, namespace: str) -> str:
    """vLLM's `cache_salt` for `namespace`: HMAC-SHA256 under `key` (128 bits, hex; vLLM
    takes up to 128 characters without '/', '@' or '\\'). Without the key, knowing the
    namespace's name does not give its salt."""
    mac = hmac.new(key, namespace.encode(), hashlib.sha256).hexdigest()[:32]
    return "prefixgate-" + mac


def cache_salt_key(gateway_key: bytes) -> bytes:
    """The salt key of the gateways' shared key (the keyring's '@gateways' line, which
    every gateway holds and no worker does): derived, never the key itself."""
    return hmac.new(gateway_key, b"prefixgate vLLM cache_salt", hashlib.sha256).digest()


def _logprobs(lp: dict | None, num_tokens: int, top: int | None
              ) -> list[common_pb2.TokenLogprob]:
    """vLLM's completion `logprobs` of a chunk (tokens as "token_id:N") as the Worker API's
    TokenLogprob per token: the sampled token's, and the `top` most likely, most likely
    first (vLLM adds the sampled token to its top dict when it is not among them)."""
    if top is None or not lp:
        return []
    out = []
    for i in range(num_tokens):
        alts = sorted(((v, int(k.rsplit(":", 1)[1])) for k, v in
                       ((lp.get("top_logprobs") or [None] * num_tokens)[i] or {}).items()
                       if v is not None), reverse=True)[:top]
        out.append(common_pb2.TokenLogprob(
            logprob=(lp.get("token_logprobs") or [0.0] * num_tokens)[i] or 0.0,
            top_token_ids=[t for _, t in alts], top_logprobs=[v for v, _ in alts]))
    return out


def _first_difference(ours: list[int], theirs: list[int]) -> str:
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
             min(len(ours), len(theirs)))
    return (f"(first difference at token {i}: gateway {ours[i:i + 4]}, vLLM "
            f"{theirs[i:i + 4]}; {len(ours)} vs {len(theirs)} tokens)")


def worker_id_of(url: str) -> str:
    """A worker id for the vLLM server at `url` (its host and port)."""
    return "vllm-" + url.split("://", 1)[-1].strip("/").replace("/", "-")


async def start_local_workers(spec: ModelSpec, tokenizer: ChatTokenizer,
                              configs: Sequence[VLLMConfig], block_size: int
                              ) -> dict[str, VLLMWorker]:
    """Start one `VLLMWorker` per config in this process (all at once: each waits a few
    seconds for its server): registry address -> worker."""
    workers = {cfg.address: VLLMWorker(spec, tokenizer, WorkerConfig(
        worker_id_of(cfg.url), block_size=block_size), cfg) for cfg in configs}
    exports = {address: w.vllm.export for address, w in workers.items() if w.vllm.export}
    exports.update({w.config.worker_id: w.vllm.export for w in workers.values() if w.vllm.export})
    for w in workers.values():  # each one's pulls reach its peers' connectors
        w.peers = exports
    await asyncio.gather(*(w.start() for w in workers.values()))
    return workers


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """KV bytes one token takes in vLLM: 2 x layers x KV heads x head dim x element size
    (the model's config.json; 0 when it cannot say)."""
    import json

    from prefixgate.workerapi.transfer import DTYPE_BYTES

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        return 2 * int(cfg["num_hidden_layers"]) * heads * dim * DTYPE_BYTES[dtype]
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def continuation_seed(seed: int, offset_tokens: int) -> int:
    """The seed vLLM gets for a reply that continues after `offset_tokens` tokens another
    worker already sent (a resume). vLLM seeds a request's generator once and offers no way
    to skip draws, so the continuation cannot take up the interrupted stream where it
    stopped (prefixgate workers do: worker/sampling.py). Sending the same seed would replay
    the draws already spent on the sent tokens; a seed derived from (seed, offset) starts a
    stream of its own instead. Without an offset the seed is the caller's."""
    if not offset_tokens:
        return seed
    digest = hashlib.blake2b(f"{seed}:{offset_tokens}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
