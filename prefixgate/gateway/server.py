"""`serve`: the gateway process's main loop, which assembles the gateway.

Contract
--------
`serve` builds the gateway complete (the worker pool, the routing index and its feed,
the tokens, the turn core (gateway/turn.py), and the fronts that each hold it: the Chat
gRPC service (gateway/grpc_front.py) and the OpenAI-compatible HTTP front
(gateway/http.py), which know nothing of each other) and runs it: the pool's probes, the index feed,
status pushes, health and the gRPC (and optional HTTP) servers, until `stop` is set.

Index feeds (gateway/feeds.py): with Redis, the gateway follows the shared event stream
(gateway/redis_feed.py) and reaps expired workers on each refresh; without, it follows
each worker's WatchEvents stream. A Redis outage leaves routing on the last known index and
workers, reported by the health service "prefixgate.registry" (NOT_SERVING while degraded;
the gateway itself stays SERVING) and the `prefixgate:registry_degraded` gauge.

Request fields are bounded (`GatewayConfig.limits`, protocol.RequestLimits): the server
refuses a message over `max_request_bytes` before parsing it, and identifiers, message
count and stop lists are checked before tokenizing.
"""

from __future__ import annotations

import asyncio
import gc
import logging

import grpc
from grpc_health.v1 import health_pb2

from prefixgate.gateway import metrics
from prefixgate.gateway.config import GatewayConfig
from prefixgate.gateway.feeds import EventFeed, WorkerStreamFeed
from prefixgate.gateway.grpc_front import SERVICE, ChatService
from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.pool import WorkerPool
from prefixgate.gateway.status import StatusFollower
from prefixgate.gateway.turn import TurnCore, new_index
from prefixgate.model.catalog import ModelSpec
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.registry import Registry, WorkerRecord
from prefixgate.security import auth, identity
from prefixgate.wire import rpc

__all__ = ["GatewayConfig", "serve", "make_feed"]

log = logging.getLogger(__name__)

REGISTRY_HEALTH = "prefixgate.registry"  # health name: NOT_SERVING while Redis is unreachable

async def serve(spec: ModelSpec, registry: Registry, config: GatewayConfig, stop: asyncio.Event,
                started: asyncio.Future[int] | None = None,
                index: PrefixIndex | None = None) -> None:
    """Run the gateway until `stop` is set. `started` receives the bound port. `index`:
    the routing index to fill and route by (default: a new one, from `config`)."""
    tokenizer = ChatTokenizer(spec)
    for address in config.static_workers:
        # Static workers stay listed; the pool's probes decide whether they are up.
        await registry.register(WorkerRecord(address, address), lease_ms=2**62)
    local = await _start_vllm_workers(spec, tokenizer, registry, config)
    internal = (auth.InternalCredential.from_file(config.auth.internal_token_file)
                if config.auth.internal_token_file else None)
    keyring = _worker_keyring(registry, config.auth)
    pool = WorkerPool(registry, spec.fingerprint, block_size=config.block_size,
                      tls=config.worker_tls, credential=internal, keyring=keyring, local=local,
                      local_tickets=_local_ticket_signer(config) if local else None)
    index = index if index is not None else new_index(config)
    feed = make_feed(registry, index)
    core = TurnCore(spec, tokenizer, pool, config, index=index, feed=feed,
                    tokens=auth.load_tokens(config.auth, "gateway"))
    service = ChatService(core)
    status = StatusFollower(config.status_interval_ms)
    server = grpc.aio.server(options=[
        *config.limits.server_options(config.limits.max_request_bytes),
        ("grpc.so_reuseport", int(config.share_port))])
    rpc.add_service(server, SERVICE, service, service.guard())
    health = rpc.add_health_and_reflection(server, [SERVICE.full_name])
    port = rpc.bind(server, config.host, config.port, config.tls, "gateway")
    _freeze_startup()
    await server.start()
    health_server = await rpc.start_health_port(health, config.host, config.health_port,
                                                share_port=config.share_port)
    http = None
    if config.http_port >= 0:
        from prefixgate.gateway.http import HTTPFront

        http = HTTPFront(core)
        try:
            http_port = await http.start(config.host, config.http_port, config.tls,
                                         share_port=config.share_port)
        except rpc.BindError:
            await server.stop(0)
            raise
        log.info("gateway serving the OpenAI-compatible HTTP API on %s:%d", config.host,
                 http_port)
    log.info("gateway serving %s on %s:%d (policy %s)", spec.name, config.host, port,
             config.routing.policy)
    if started is not None:
        started.set_result(port)
    frozen_blocks = 0
    try:
        while not stop.is_set():
            try:
                await pool.refresh()
            except Exception as exc:  # a registry outage degrades service; it never stops it
                log.warning("worker refresh failed: %s", exc)
            try:
                await feed.sync(pool.healthy())
            except Exception:
                log.exception("index feed sync failed")
            status.sync(pool.healthy())
            await rpc.set_serving(health, [SERVICE.full_name], bool(pool.healthy()))
            # Not set_serving: that would also flip the gateway's overall status.
            await health.set(REGISTRY_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING
                             if feed.degraded else health_pb2.HealthCheckResponse.SERVING)
            metrics.REGISTRY_DEGRADED.set(1 if feed.degraded else 0)
            metrics.INDEX_BLOCKS.set(index.num_blocks)
            _drop_predictions_of_lost_workers(index, pool.healthy())
            metrics.EXPECTED_BLOCKS.set(index.num_expected_blocks())
            metrics.PREDICTION_CONFIDENCE.set(index.prediction_confidence)
            frozen_blocks = _freeze_long_lived(index.num_blocks, frozen_blocks)
            try:
                await asyncio.wait_for(stop.wait(), config.refresh_interval_s)
            except TimeoutError:
                pass
    finally:
        await rpc.set_serving(health, [SERVICE.full_name], False)
        await feed.close()
        await status.close()
        # One drain for both fronts, at once: turns on either get the same drain_seconds.
        await asyncio.gather(server.stop(config.drain_seconds),
                             *([http.stop(config.drain_seconds)] if http is not None else []))
        if health_server is not None:
            await health_server.stop(0)
        if core.recorder is not None:
            await asyncio.to_thread(core.recorder.close)
        core.close()
        await pool.close()
        await asyncio.gather(*(w.service.close() for w in local.values()))
        await registry.close()


async def _start_vllm_workers(spec: ModelSpec, tokenizer: ChatTokenizer, registry: Registry,
                              config: GatewayConfig) -> dict:
    """The vLLM servers of `config.vllm_workers`, each behind an in-process adapter
    (engines/vllm.py), listed in the registry like static workers: address -> the
    workerapi/client.py InProcessWorkerClient the pool holds as its client."""
    if not config.vllm_workers:
        return {}
    from prefixgate.engines.vllm import VLLMConfig, cache_salt_key, start_local_workers
    from prefixgate.workerapi.client import InProcessWorkerClient

    # Tenants' cache salts keyed by the gateways' shared key when there is one (every
    # gateway sending to a server then salts alike); else each adapter draws its own.
    path = config.auth.worker_keyring_file
    keyring = identity.Keyring.from_file(path).for_gateway(path) if path else None
    salt_key = cache_salt_key(keyring.gateway_key) if keyring and keyring.gateway_key else b""
    workers = await start_local_workers(
        spec, tokenizer, [VLLMConfig.parse(text, metrics_interval_s=config.status_interval_ms / 1e3,
                                           salt_key=salt_key,
                                           export_client_tls=config.worker_tls)
                          for text in config.vllm_workers], config.block_size)
    for address in workers:
        await registry.register(WorkerRecord(address, address), lease_ms=2**62)
    return {address: InProcessWorkerClient(w) for address, w in workers.items()}


def _local_ticket_signer(config: GatewayConfig) -> identity.TicketSigner | None:
    """The pull-ticket signer for the vLLM servers this process follows: from the
    `@gateways` line of --worker-keyring (their connectors check tickets with its public
    half, the `@tickets` line); None without one."""
    path = config.auth.worker_keyring_file
    return identity.Keyring.from_file(path).for_gateway(path).ticket_signer() if path else None


def _drop_predictions_of_lost_workers(index: PrefixIndex, healthy: list) -> None:
    """Workers that are down or gone keep no predictions (their events will not come)."""
    for wid in index.expected_workers() - {w.worker_id for w in healthy}:
        index.drop_predictions(wid)


def _freeze_long_lived(num_blocks: int, frozen_blocks: int) -> int:
    """Keep the routing index out of the cyclic garbage collector's full scans.

    A 1M-block index is ~250k GC-tracked objects; a full collection walks them all
    (~180 ms here) and blocks the event loop, i.e. every stream and routing decision. Once
    the index has doubled since the last time, `gc.freeze()` what is alive: frozen objects
    are never scanned again, so later collections cost what is new. Freed index nodes are
    still reclaimed (the tree unlinks them, so reference counting frees them).

    Only the young generations are collected first, never a full collection: that walks
    every object not yet frozen with the event loop stopped, each turn in flight waiting
    (in a fleet replay at 80 turns/s, 6 % of the gateway's profile samples: 270 ms in 25 s
    on a busy host, seconds of emulated TTFT at time scale 20). The price: cyclic
    garbage already in the oldest generation at that moment is frozen with the rest and
    never freed, once per doubling of the index. Returns the index size at the last
    freeze."""
    if num_blocks < max(10_000, 2 * frozen_blocks):
        return frozen_blocks
    gc.collect(1)
    gc.freeze()
    return num_blocks


def _freeze_startup() -> None:
    """Before serving: collect once and freeze the start-up heap (modules, gRPC, protobuf,
    the tokenizer), so that no full collection while serving walks it again. A pause here
    delays no turn."""
    gc.collect()
    gc.freeze()


def _worker_keyring(registry: Registry, config: auth.AuthConfig) -> identity.Keyring | None:
    """The keyring registered workers must sign with (Redis only: static workers are
    trusted by configuration). The Redis registry verifies ownership with it too."""
    from prefixgate.registry import RedisRegistry

    if not isinstance(registry, RedisRegistry):
        return None
    if not config.worker_keyring_file:
        log.warning("gateway: no --worker-keyring: worker registrations and block ownership "
                    "in Redis are not verified (anyone who can write to Redis can register a "
                    "worker and receive turns)")
        return None
    keyring = identity.Keyring.from_file(config.worker_keyring_file).for_gateway(
        config.worker_keyring_file)
    registry.keyring = keyring  # the feed reads only ownership signed by its worker
    log.info("gateway: registered workers must prove their identity (%d public keys)",
             len(keyring))
    if keyring.gateway_key is None:
        log.warning("gateway: --worker-keyring has no '%s' line: this gateway's routing "
                    "predictions and reaps are unsigned, and other gateways ignore them "
                    "(`prefixgate token --gateway-key` prints one; give every gateway the "
                    "same)", identity.GATEWAYS)
    return keyring


def make_feed(registry: Registry, index: PrefixIndex) -> EventFeed:
    """The index feed for `registry`: the Redis event stream, else the workers' streams."""
    from prefixgate.registry import RedisRegistry

    if isinstance(registry, RedisRegistry):
        from prefixgate.gateway.redis_feed import RedisStreamFeed

        return RedisStreamFeed(index, registry)
    return WorkerStreamFeed(index)
