"""A worker's start-up around its WorkerService: listening, and the registry lease.

Contract: `await serve_worker(service, stop, lease, capacity_blocks)` serves `service`
(workerapi/server.py) until `stop` is set. With `lease.redis_url` it also registers the
worker in that Redis under a lease of `lease.lease_ms`, renews it and publishes the
service's KV event log (workerapi/events.py RedisPublisher), signing with the worker's key
when `service.config.auth.worker_keyring_file` is set; gateways then reach it at
`lease.advertise_address` (default host:bound port), and on the drain it hands its most
reused chains off to the registry's other workers of its model (workerapi/handoff.py).
Without, gateways list it by address.
Real and emulated workers (prefixgate/emulate) start through here alike.

`passive_omp_wait()` sets the OpenMP wait policy a worker runs under; call it before
torch is imported. Torch-free.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from prefixgate.launch.serving import start_server

__all__ = ["RegistryLease", "passive_omp_wait", "serve_worker", "worker_keyring"]


@dataclass(frozen=True)
class RegistryLease:
    """Where and how a worker registers ("" redis_url: it does not)."""

    redis_url: str = ""
    lease_ms: int = 10_000  # renewed every third of it
    advertise_address: str = ""  # host:port gateways use (default: host:bound port)


def worker_keyring(path: str, worker_id: str):
    """The worker's keyring (prefixgate.security.identity.Keyring) from `path`, or None
    without one; it must hold this worker's own private key and no other (checked at
    start, rather than at each registration attempt)."""
    from prefixgate.security.identity import Keyring

    if not path:
        return None
    try:
        return Keyring.from_file(path).for_worker(worker_id, path)
    except ValueError as exc:
        raise SystemExit(f"prefixgate worker: --worker-keyring: {exc}") from None


async def serve_worker(service, stop: asyncio.Event, lease: RegistryLease,
                       capacity_blocks: int) -> None:
    """Serve `service` until `stop` (module docstring)."""
    from prefixgate.registry import RedisRegistry, WorkerRecord
    from prefixgate.workerapi.events import RedisPublisher
    from prefixgate.workerapi.server import serve

    registry: RedisRegistry | None = None

    async def peers() -> list[tuple[str, str]]:
        """The fleet's workers of this model, for the drain hand-off (workerapi/handoff.py)."""
        if registry is None:
            return []
        return [(r.worker_id, r.address) for r in await registry.list_workers()
                if r.model_fingerprint == service.spec.fingerprint]

    server, port = await start_server(lambda started: serve(
        service, stop, started, peers=peers, advertise_address=lease.advertise_address))
    if not lease.redis_url:
        await server
        return
    config = service.config  # its worker_id is known once bound (workerapi/server.py)
    registry = RedisRegistry(lease.redis_url, keyring=worker_keyring(
        config.auth.worker_keyring_file, config.worker_id))
    address = lease.advertise_address or f"{config.host}:{port}"
    publisher = RedisPublisher(service.events, registry, WorkerRecord(
        config.worker_id, address, service.spec.fingerprint, capacity_blocks=capacity_blocks),
        lease.lease_ms)
    await publisher.run(stop)
    await server
    await registry.close()


def passive_omp_wait() -> None:
    """Make torch's OpenMP threads sleep, not spin, while they wait for work: call before
    torch is imported. Why: a worker shares its host with the gateway, other workers and
    its own gRPC threads; with more runnable threads than cores, spinning threads burn
    the slices the working ones need (measured here, 2 threads on 2 busy cores, SmolLM2
    int8 decode: 2.8 s per token spinning, 48 ms passive). The cost of passive waiting is
    a wake-up per parallel operator: it hurt when every decode operator went through
    OpenMP, but q4_1 decode steps now run on the CPU kernels' own pool (bounded spin,
    never waits for an unscheduled thread; worker/kernels/) and OpenMP serves prefill
    GEMMs of milliseconds each (docs/benchmarks.md, weight formats: threads).
    An OMP_WAIT_POLICY the user set wins."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
