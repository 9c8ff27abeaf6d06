"""Worker membership and block ownership, shared by workers and gateways.

Contract
--------
`Registry` (base.py) is the interface: workers register under a lease and a fencing epoch;
gateways list the workers whose lease is current. Backends:
  EmbeddedRegistry  (embedded.py) in-process, for one machine with no Redis;
  RedisRegistry     (redis_registry.py) shared by any number of gateways and workers, and
                    the record of which worker owns which block (scripts in lua.py, wire
                    format in wire.py).
`make_registry(url)` picks one. The ownership event record itself is
`prefixgate.wire.events.OwnershipEvent` (re-exported here).
"""

from __future__ import annotations

from prefixgate.registry.base import Registry, WorkerRecord
from prefixgate.registry.embedded import EmbeddedRegistry
from prefixgate.registry.redis_registry import RedisRegistry, redact_url
from prefixgate.registry.wire import (
    StreamEntry,
    pack_hashes,
    stream_id_newer,
    unpack_hashes,
)
from prefixgate.security.identity import Keyring
from prefixgate.wire.events import OwnershipEvent

__all__ = ["EmbeddedRegistry", "OwnershipEvent", "RedisRegistry", "Registry", "StreamEntry",
           "WorkerRecord", "make_registry", "pack_hashes", "redact_url", "stream_id_newer",
           "unpack_hashes"]


def make_registry(redis_url: str | None, keyring: Keyring | None = None) -> Registry:
    """RedisRegistry when a URL is given (signing and verifying with `keyring` when
    given), else the embedded one."""
    return RedisRegistry(redis_url, keyring=keyring) if redis_url else EmbeddedRegistry()
