"""The registry interface: which workers exist, where, and under which epoch.

Contract
--------
A `Registry` records `WorkerRecord`s. Workers `register` themselves (getting a new epoch,
a fencing token that increases on every registration of the same id), `renew` their
lease while alive, and `deregister` on graceful shutdown. Gateways call `list_workers`,
which returns only workers whose lease is current. Every method is a coroutine; none
blocks the event loop.

Epochs fence everything keyed by a worker: a record, a lease renewal, a deregistration
or (Redis) a batch of ownership events carrying an older epoch than the current one
changes nothing. A restarted worker therefore never inherits, and its predecessor never
removes, what belongs to the other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    address: str  # host:port of its WorkerService
    model_fingerprint: str = ""
    epoch: int = 0
    capacity_blocks: int = 0  # KV blocks the worker can hold (0: unknown)
    signature: str = ""  # the worker's signed registration (prefixgate.security.identity), if any


class Registry(ABC):
    @abstractmethod
    async def register(self, record: WorkerRecord, lease_ms: int) -> WorkerRecord:
        """Record the worker under a fresh lease; returns it with its new epoch."""

    @abstractmethod
    async def renew(self, record: WorkerRecord, lease_ms: int) -> bool:
        """Extend the lease; False when the lease was lost (expired or superseded)."""

    @abstractmethod
    async def deregister(self, record: WorkerRecord) -> None:
        """Remove the worker if `record.epoch` is still its current epoch."""

    @abstractmethod
    async def list_workers(self) -> list[WorkerRecord]:
        """Workers whose lease is current, sorted by worker id."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections."""
