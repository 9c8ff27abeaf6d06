"""Block transfer between workers: move KV instead of work (torch-free).

Contract
--------
`BlockTransfer` is an engine's side of it (`Engine.transfer`; None: the engine cannot
transfer). Its methods take block-hash chains (`prefixgate.radix.BlockHasher` keys, what
gateways route on and KV events carry) and never block the engine loop: pins and cache
changes happen on the engine's thread between steps (callers wait for them off the event
loop, `asyncio.to_thread`), page copies happen on the caller's thread, on blocks nobody
else writes (pinned cached blocks are never rewritten; reserved blocks belong to the
import alone until it commits them).

  pin(chain, from_block)       lock the longest cached run of `chain` (evictions and
                               rewrites stay off it); None when it holds no block past
                               from_block. `unpin` when done.
  read(pin, start, count)      K and V bytes of the pin's blocks [start, start + count)
                               (counted from from_block), in `format`'s dtype and layout.
  reserve(chain)               lock the leading run of `chain` already cached here and
                               take fresh blocks (free, else evicting unlocked cached
                               ones; fewer when memory is short) for the blocks after it.
  write(reservation, start, k, v)  fill reserved blocks [start, start + n).
  commit(reservation, n)       store the first n reserved blocks in the prefix cache
                               (published as `stored`, like computed ones), give the rest
                               back, unlock; returns the chain's leading blocks cached now.
  hot_chains()                 every cached chain (root to leaf), the most reused first:
                               what a draining worker offers its peers (workerapi/handoff.py).
  digests(pin, start, count)   the page digests (security/kv_pages.py) recorded when those
                               blocks were computed; [] from an engine that records none.

The gRPC side lives here too, written against that contract only (so an emulated engine
transfers through the same code): `export_events` is WorkerService.ExportBlocks' stream
(header, then chunks of whole blocks of about `chunk_bytes`, the next chunk copied while
the current one is sent: at most two chunks in memory, and gRPC's flow control stops the
copying when the receiver stops reading; each chunk carries its blocks' recorded page
digests); `pull` is the receiving side (checks the header against its own format and
refuses a mismatch, checks each chunk's pages against their digests and stops at the
first block that does not match, writes chunks as they arrive, commits what arrived
whole and verified even when the stream breaks). A refusal is a `TransferError`
carrying the gRPC status to answer or log.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.internal.encoder import _VarintBytes

from prefixgate.radix import Hashers
from prefixgate.security.kv_pages import verify_chunk
from prefixgate.v1 import worker_pb2

LAYOUT = worker_pb2.KV_LAYOUT_LAYER_TOKEN_HEAD_DIM
CHUNK_BYTES = 4 << 20  # K + V bytes per chunk (at least one block): few messages, small memory
# Pull channels accept messages of this size (a chunk of one block must fit).
MAX_MESSAGE_BYTES = 256 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class TransferError(Exception):
    """A transfer refused or broken; `code` is the gRPC status to answer or log."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class KVFormat:
    """What one worker's KV pages are: two workers may exchange blocks iff equal."""

    model_fingerprint: str
    block_size: int
    dtype: str  # DTYPE_BYTES key
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: int = LAYOUT

    @property
    def bytes_per_token(self) -> int:
        """K and V: 2 x layers x kv_heads x head_dim x element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def header(self, worker_id: str, num_blocks: int) -> worker_pb2.KVBlocksHeader:
        return worker_pb2.KVBlocksHeader(
            worker_id=worker_id, model_fingerprint=self.model_fingerprint,
            block_size=self.block_size, dtype=self.dtype, layout=self.layout,
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            bytes_per_token=self.bytes_per_token, num_blocks=num_blocks)

    def mismatch(self, h: worker_pb2.KVBlocksHeader) -> str:
        """Why pages described by `h` cannot be stored here ('' when they can)."""
        for name in ("model_fingerprint", "block_size", "dtype", "layout", "num_layers",
                     "num_kv_heads", "head_dim", "bytes_per_token"):
            theirs, ours = getattr(h, name), getattr(self, name)
            if theirs != ours:
                return f"{name} {theirs!r} there, {ours!r} here"
        return ""


@dataclass
class Reservation:
    """Blocks an import may fill: the chain's first `num_cached` blocks are cached here
    (locked), `num_blocks` fresh blocks follow them. `handle` is the engine's."""

    chain: tuple[int, ...]
    num_cached: int
    num_blocks: int
    handle: Any


class BlockTransfer(ABC):
    """An engine's side of block transfer (see the module docstring). `clock` is the time
    transfers are measured in (monotonic seconds; an emulated engine's run faster)."""

    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, format: KVFormat) -> None:
        self.format = format
        self._hashers = Hashers(format.block_size, format.model_fingerprint)

    def chain(self, token_ids: Sequence[int], namespace: str) -> list[int]:
        """The block-hash chain of `token_ids`' full blocks in `namespace`."""
        return self._hashers.get(namespace).hash_blocks(token_ids)

    @abstractmethod
    def pin(self, chain: Sequence[int], from_block: int) -> Any | None: ...

    @abstractmethod
    def pinned_blocks(self, pin: Any) -> int:
        """Blocks of the pin after from_block (>= 1)."""

    @abstractmethod
    def read(self, pin: Any, start: int, count: int) -> tuple[bytes, bytes]: ...

    @abstractmethod
    def unpin(self, pin: Any) -> None: ...

    @abstractmethod
    def reserve(self, chain: Sequence[int]) -> Reservation: ...

    @abstractmethod
    def write(self, reservation: Reservation, start: int, k: bytes, v: bytes) -> None: ...

    @abstractmethod
    def commit(self, reservation: Reservation, num_blocks: int) -> int: ...

    @abstractmethod
    def hot_chains(self) -> list[list[int]]: ...

    def digests(self, pin: Any, start: int, count: int) -> list[bytes]:
        """Page digests of the pin's blocks [start, start + count) as recorded when they
        were computed (security/kv_pages.py); [] when this engine records none."""
        return []


@dataclass(frozen=True)
class PullResult:
    num_cached_before: int  # leading blocks of the chain cached here before the pull
    num_pulled: int  # blocks that came over the wire and were stored
    num_bytes: int
    seconds: float
    error: TransferError | None = None  # why the pull stopped short, if it did

    @property
    def num_cached(self) -> int:
        return self.num_cached_before + self.num_pulled


def encode_chunk(first_block: int, num_blocks: int, k: bytes, v: bytes,
                 digests: Sequence[bytes] = ()) -> bytes:
    """The wire form of ExportBlocksEvent(chunk=KVBlocksChunk(...)), built with one copy
    of the pages (protobuf's own building and serializing copied them twice, ~20x slower
    here); rpc.add_service sends bytes as they are."""
    head = worker_pb2.KVBlocksChunk(first_block=first_block, num_blocks=num_blocks,
                                    block_digests=digests).SerializeToString()
    k_field = _K_TAG + _VarintBytes(len(k))
    v_field = _V_TAG + _VarintBytes(len(v))
    size = len(head) + len(k_field) + len(k) + len(v_field) + len(v)
    return b"".join((_CHUNK_TAG, _VarintBytes(size), head, k_field, k, v_field, v))


# Field tags (field number << 3 | 2, length-delimited): ExportBlocksEvent.chunk = 2,
# KVBlocksChunk.k = 3, KVBlocksChunk.v = 4.
_CHUNK_TAG, _K_TAG, _V_TAG = bytes([2 << 3 | 2]), bytes([3 << 3 | 2]), bytes([4 << 3 | 2])


async def export_events(transfer: BlockTransfer, request: worker_pb2.ExportBlocksRequest,
                        worker_id: str, chunk_bytes: int = CHUNK_BYTES
                        ) -> AsyncIterator[worker_pb2.ExportBlocksEvent | bytes]:
    """WorkerService.ExportBlocks: header, then chunks in their wire form
    (`encode_chunk`); TransferError NOT_FOUND when nothing past from_block is cached here."""
    chain, start = list(request.block_hashes), request.from_block
    if request.max_blocks:
        chain = chain[:request.max_blocks]
    if start >= len(chain):
        raise TransferError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"from_block {start} is past the chain's {len(chain)} blocks")
    pinning = asyncio.ensure_future(asyncio.to_thread(transfer.pin, chain, start))
    try:
        pin = await asyncio.shield(pinning)
    except asyncio.CancelledError:
        # The call went away while the engine pinned: the pin lands all the same (a thread
        # once started runs on), so it is given back once it does.
        _in_background(_unpin_once_pinned(transfer, pinning))
        raise
    if pin is None:
        raise TransferError(grpc.StatusCode.NOT_FOUND,
                            f"worker {worker_id} holds none of blocks {start}.. of the chain "
                            "(evicted or never cached): compute them")
    reading: asyncio.Future | None = None
    try:
        total = transfer.pinned_blocks(pin)
        yield worker_pb2.ExportBlocksEvent(header=transfer.format.header(worker_id, total))
        per_chunk = max(1, chunk_bytes // transfer.format.bytes_per_block)
        first = 0
        # Copy chunk i+1 while chunk i is being sent: two chunks in memory at most.
        reading = asyncio.ensure_future(asyncio.to_thread(
            _read_pages, transfer, pin, 0, min(per_chunk, total)))
        while first < total:
            count = min(per_chunk, total - first)
            # Shielded: a call cancelled here leaves the copy to finish (its thread runs on
            # regardless) rather than marking it done while it still reads the pages.
            k, v, digests = await asyncio.shield(reading)
            nxt = first + count
            if nxt < total:
                reading = asyncio.ensure_future(asyncio.to_thread(
                    _read_pages, transfer, pin, nxt, min(per_chunk, total - nxt)))
            yield encode_chunk(start + first, count, k, v, digests)
            first = nxt
    finally:
        # After any copy in flight, in a task of its own: a cancelled await of a queued
        # `to_thread` never runs it, and under load the unpin used to be lost that way
        # (the blocks stayed pinned: never evicted, counted twice).
        await _settled(_unpin_after(transfer, pin, reading))


def _read_pages(transfer: BlockTransfer, pin: Any, start: int, count: int
                ) -> tuple[bytes, bytes, list[bytes]]:
    k, v = transfer.read(pin, start, count)
    return k, v, transfer.digests(pin, start, count)


@dataclass(frozen=True)
class PullAuth:
    """What a pull shows and asks of the holder: `ticket` (security/tickets.py) and the
    whole chain it covers (`ticket_chain`; the pulled chain is a leading run of it),
    and whether chunks must carry page digests (`require_digests`)."""

    ticket: bytes = b""
    ticket_chain: Sequence[int] = ()
    require_digests: bool = False


async def pull(stub: Any, transfer: BlockTransfer, chain: Sequence[int], peer: str,
               timeout_s: float | None = None,
               source_chain: Sequence[int] | None = None, keep: bool = True,
               auth: PullAuth = PullAuth()) -> PullResult:
    """Fetch the blocks of `chain` this worker lacks from `peer` (its WorkerServiceStub)
    and store them. Never raises for the peer's failures: the result's `error` says why
    fewer blocks came than asked (the caller computes the rest). `source_chain`: ask the
    peer for these hashes instead (the same tokens under another namespace, whose KV is
    the same: a worker's probe of its own copy path; default `chain`). `keep=False`:
    give the blocks back instead of storing them (the probe: only the time counts).
    `auth`: the ticket shown to the holder, and whether pages without digests are
    refused; a block whose pages do not match its digest is never stored."""
    began = transfer.clock()
    reserving = asyncio.ensure_future(asyncio.to_thread(transfer.reserve, list(chain)))
    try:
        res = await asyncio.shield(reserving)
    except asyncio.CancelledError:  # the reservation lands all the same: give it back
        _in_background(_give_back_once_reserved(transfer, reserving))
        raise
    got = _Received()
    try:
        if res.num_blocks:
            await _receive(stub, transfer, res, peer, timeout_s, got,
                           res.chain if source_chain is None else list(source_chain), auth)
        elif res.num_cached < len(chain):
            got.error = TransferError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      "no KV block could be made free for the pulled blocks")
    except TransferError as exc:
        got.error = exc
    except grpc.aio.AioRpcError as exc:
        got.error = TransferError(exc.code(), f"{peer}: {exc.details()}")
    finally:
        # Also on cancellation (the request went away): what arrived whole is stored,
        # the rest of the reservation given back; after a write in flight (never commit
        # blocks still being written), in a task of its own (so a cancellation loses
        # neither).
        await _settled(_commit_after(transfer, res, got, keep))
    return PullResult(res.num_cached, got.blocks, got.bytes, transfer.clock() - began,
                      got.error)


@dataclass
class _Received:
    blocks: int = 0  # written whole
    bytes: int = 0
    error: TransferError | None = None
    writing: asyncio.Future | None = None  # the write in flight: blocks it wrote, refusal
    writing_from: int = 0  # `blocks` before it

    async def settle_write(self, shielded: bool) -> None:
        """Wait for the write in flight and count what it wrote; a refusal (pages that
        do not match their digests) becomes `error`. `shielded`: a cancellation stops the
        wait, not the write (see _commit_after)."""
        if self.writing is None:
            return
        written, why = await (asyncio.shield(self.writing) if shielded else self.writing)
        self.blocks, self.writing = self.writing_from + written, None
        if why:
            self.error = TransferError(grpc.StatusCode.DATA_LOSS, why)


# Tasks that must run to their end although the call that started them was cancelled (a
# pin's release, a reservation's commit): held here, so that they are not collected.
_SETTLING: set[asyncio.Future] = set()


def _in_background(coro: Any) -> asyncio.Future:
    task = asyncio.ensure_future(coro)
    _SETTLING.add(task)
    task.add_done_callback(_SETTLING.discard)
    return task


async def _settled(coro: Any) -> Any:
    """`coro`'s result, run in a task of its own: cancelling the caller stops the wait,
    not the work."""
    return await asyncio.shield(_in_background(coro))


async def _unpin_after(transfer: BlockTransfer, pin: Any,
                       reading: asyncio.Future | None) -> None:
    if reading is not None:
        await asyncio.gather(reading, return_exceptions=True)  # its pages are in use
    await asyncio.to_thread(transfer.unpin, pin)


async def _unpin_once_pinned(transfer: BlockTransfer, pinning: asyncio.Future) -> None:
    pin = await pinning
    if pin is not None:
        await asyncio.to_thread(transfer.unpin, pin)


async def _give_back_once_reserved(transfer: BlockTransfer, reserving: asyncio.Future) -> None:
    await asyncio.to_thread(transfer.commit, await reserving, 0)


async def _commit_after(transfer: BlockTransfer, res: Reservation, got: _Received,
                        keep: bool) -> int:
    failed: BaseException | None = None
    if got.writing is not None:
        (done,) = await asyncio.gather(got.writing, return_exceptions=True)
        if isinstance(done, BaseException):
            failed = done
            got.writing = None
        else:
            await got.settle_write(shielded=False)
    cached = await asyncio.to_thread(transfer.commit, res, got.blocks if keep else 0)
    if failed is not None and not isinstance(failed, asyncio.CancelledError):
        raise failed  # a write that failed is a bug: said, after the reservation is settled
    return cached


def _verify_and_write(transfer: BlockTransfer, res: Reservation, start: int, k: bytes,
                      v: bytes, digests: Sequence[bytes], num_blocks: int, keep: int,
                      require: bool) -> tuple[int, str]:
    """Write the first `keep` blocks of a chunk of `num_blocks` into `res` from `start`,
    up to the first whose pages do not match their digest; (blocks written, why fewer
    than `keep` were, or ""). On a worker thread: hashing megabytes must not hold the
    event loop."""
    fmt = transfer.format
    ok, why = verify_chunk(k, v, digests, num_blocks, fmt.num_layers, require)
    n = min(ok, keep)
    if n:
        if n < num_blocks:  # the leading blocks' pages, per layer (wire layout)
            k, v = (_leading_blocks(k, num_blocks, n, fmt.num_layers),
                    _leading_blocks(v, num_blocks, n, fmt.num_layers))
        transfer.write(res, start, k, v)
    return n, why if n < keep else ""


def _leading_blocks(pages: bytes, num_blocks: int, keep: int, num_layers: int) -> bytes:
    """The first `keep` blocks of a chunk's K (or V) pages of `num_blocks` blocks."""
    per_layer = len(pages) // num_layers
    run = per_layer // num_blocks * keep
    m = memoryview(pages)
    return b"".join(m[i * per_layer:i * per_layer + run] for i in range(num_layers))


async def _receive(stub: Any, transfer: BlockTransfer, res: Reservation, peer: str,
                   timeout_s: float | None, got: _Received, source: Sequence[int],
                   auth: PullAuth) -> None:
    """Stream the reserved blocks from `peer` (which names them `source`) into `res`,
    counting them in `got`."""
    fmt = transfer.format
    want_to = res.num_cached + res.num_blocks
    if auth.ticket:  # the holder checks the whole ticketed chain; max_blocks limits it
        if list(auth.ticket_chain[:want_to]) != list(source[:want_to]):
            raise TransferError(grpc.StatusCode.INVALID_ARGUMENT,
                                "the pulled chain is not a leading run of the ticket's")
        request = worker_pb2.ExportBlocksRequest(
            block_hashes=auth.ticket_chain, from_block=res.num_cached, ticket=auth.ticket,
            max_blocks=want_to)
    else:
        request = worker_pb2.ExportBlocksRequest(block_hashes=source[:want_to],
                                                 from_block=res.num_cached)
    call = stub.ExportBlocks(request, timeout=timeout_s)
    try:
        first = await call.read()
        if first is grpc.aio.EOF or first.WhichOneof("event") != "header":
            raise TransferError(grpc.StatusCode.DATA_LOSS,
                                f"{peer}: the export stream did not start with a header")
        why = fmt.mismatch(first.header)
        if why:
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{peer}'s KV pages do not fit this worker: {why}")
        want = min(first.header.num_blocks, res.num_blocks)
        half = fmt.bytes_per_block // 2
        # Chunk i is written into the pool while chunk i + 1 is received; the last write
        # is waited for by `pull` (`_commit_after`), also when this ends early.
        received = 0
        while received < want:
            ev = await call.read()
            if ev is grpc.aio.EOF:
                raise TransferError(grpc.StatusCode.DATA_LOSS,
                                    f"{peer}: the export stream ended after {received} of "
                                    f"{want} blocks")
            c = ev.chunk
            if (c.first_block != res.num_cached + received or not c.num_blocks
                    or len(c.k) != c.num_blocks * half or len(c.v) != len(c.k)):
                raise TransferError(grpc.StatusCode.DATA_LOSS,
                                    f"{peer}: a malformed chunk (blocks {c.first_block}+"
                                    f"{c.num_blocks}, {len(c.k)} bytes) after {received} "
                                    "blocks")
            n = min(c.num_blocks, want - received)  # more than asked: the rest unused
            # Shielded: a cancelled pull leaves the write to finish (see _commit_after).
            await got.settle_write(shielded=True)
            if got.error is not None:
                raise got.error  # a block's pages did not match their digest
            got.writing = asyncio.ensure_future(asyncio.to_thread(
                _verify_and_write, transfer, res, received, c.k, c.v, list(c.block_digests),
                c.num_blocks, n, auth.require_digests))
            got.writing_from = received
            received += n
            got.bytes += 2 * n * half
    finally:
        call.cancel()  # a no-op once the stream ended; else the peer stops sending
