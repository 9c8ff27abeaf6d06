"""vLLM's KV cache events, decoded and mapped onto prefixgate's own block hashes (no I/O).

Contract
--------
`decode_batch(payload)` reads one message of vLLM's ZMQ publisher (the third frame of
`(topic, seq, payload)`): a msgpack `KVEventBatch` as vLLM's msgspec structs encode it,
either as maps (`{"type": "BlockStored", "block_hashes": ...}`) or as arrays (`["BlockStored",
hashes, parent, token_ids, block_size, ...]`, the `array_like` form of older releases).
It returns the batch's timestamp and its events as `Stored`, `Removed` and `Cleared`;
events of other kinds, and those of a KV cache group other than the first
(`group_idx` > 0: hybrid models' extra groups), are skipped and counted.

`VLLMEventMapper(hashers, sink)` turns those events into prefixgate's events on `sink`
(a `prefixgate.wire.events.KVEventSink`, normally the worker's `EventLog`), in
prefixgate's chained, salted block hashes (`prefixgate.radix.BlockHasher`) of the
gateway's block size, rebuilt from the token ids each `BlockStored` carries. vLLM's own
hash values are used only as opaque keys (bytes or ints): its hash function is never
reimplemented, so a vLLM upgrade that changes it changes nothing here.

Rules (why: a gateway must never route on a block vLLM no longer holds):
  - a gateway block is *held* when every vLLM block overlapping its tokens is cached; it
    is stored (`sink.stored`) when that becomes true and removed (`sink.removed`) as soon
    as any of them is removed. With vLLM's block size a multiple of the gateway's, one
    vLLM block yields several gateway blocks; with the gateway's a multiple of vLLM's, a
    gateway block needs several vLLM blocks; any other pair of sizes works the same way.
  - vLLM may cache the same content twice (it does not deduplicate blocks): stores and
    removals of one vLLM hash are counted, and the block leaves when the count is 0.
    vLLM 0.32 publishes one BlockStored and one BlockRemoved per physical copy, so a
    removal while another copy remains (vLLM pull 55092 would stop publishing it) leaves
    the block held. An entry whose count reaches 0 is dropped from the map at once: the
    map holds only what vLLM caches now.
  - a stored chain whose parent vLLM block is unknown here (it was stored before this
    process subscribed, or in a chain skipped below) cannot be placed: its tokens'
    position and prefix are unknown. It is skipped (`num_unplaced_blocks`): the index
    under-reports, never over-reports.
  - only chains whose KV prefixgate's hashes describe are placed; skipped and counted
    (`num_foreign_blocks`), never filed under another namespace:
      * chains of a LoRA adapter (`lora_id` / `lora_name`): the adapter's KV is not the
        base model's, and the gateway's hashes name no adapter;
      * chains of a KV cache group above 0 (hybrid models' other groups), and blocks of
        another medium than the GPU pool (an offloading tier): dropped in `decode_batch`;
      * blocks whose extra keys hold anything but the cache salt on the chain's first
        block (a multimodal item, prompt embeddings): the chain is placed up to them;
      * a chain whose salt is not one this process sent (`namespace_of_salt` answers
        None): another client's, or a namespace not seen since this process started.
  - the namespace (prefixgate's cache salt) of a chain from the root comes from the
    first block's `extra_keys`: no salt is namespace "", a salt is looked up with
    `namespace_of_salt(salt)` (the adapter sends a keyed digest of the namespace as
    vLLM's `cache_salt`); without `extra_keys` (older vLLM) it is asked of
    `namespace_of(first_block_token_ids)` (the adapter's record of what it sent). A chain
    whose namespace is unknown (None) is skipped. Children inherit their parent's.
  - memory is bounded by `max_blocks` vLLM blocks (least recently stored or named as a
    parent first); `set_engine_blocks(n)` makes it the server's own block count (vLLM's
    `num_gpu_blocks`): with zero-count entries dropped, the map never needs more than
    vLLM can cache. Forgetting a block that is cached would leave its gateway blocks
    with nothing to remove them later, so they are removed from the sink first.
  - `AllBlocksCleared` clears everything; `reset()` does the same for the caller (a gap
    in the event stream that could not be replayed: whatever vLLM dropped meanwhile is
    unknown, so nothing of this worker is kept).
  - `suspend()` / `resume()`: while suspended (the event stream stalled) the sink is
    told `cleared()` once and receives nothing; the mapper keeps following whatever
    events still arrive. `resume()` stores every block held now again, as chains.

The mapping keeps, per vLLM block, the chain state needed to continue hashing its
children (the namespace's hasher, the last full gateway block's hash and the tokens
after it), so a child event costs one hash per gateway block it completes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import msgspec

from prefixgate.radix import Hashers
from prefixgate.radix.hashing import packed, tokens_to_bytes
from prefixgate.wire.events import KVEventSink, chains

log = logging.getLogger(__name__)

__all__ = ["Cleared", "Removed", "Stored", "VLLMEventMapper", "decode_batch"]

VHash = Hashable  # a vLLM block hash: bytes (sha256-based) or int, opaque here


@dataclass(frozen=True, slots=True)
class Stored:
    """vLLM cached `block_hashes` as one chain after `parent` (None: from the root); the
    chain's tokens, `block_size` per block; `salt`: the first block's cache salt, if the
    event says (None: it does not carry extra keys)."""

    block_hashes: tuple[VHash, ...]
    parent: VHash | None
    token_ids: tuple[int, ...]
    block_size: int
    salt: str | None = None
    carries_keys: bool = False  # the event has vLLM's per-block extra keys
    lora: bool = False  # the chain is a LoRA adapter's
    # Index of the first block whose extra keys hold more than the chain's cache salt (a
    # multimodal item, prompt embeddings): its KV is not the tokens' alone (None: none).
    keyed_from: int | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[VHash, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared

# Field order of vLLM's structs (vllm/distributed/kv_events.py), for the array form.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_decoder = msgspec.msgpack.Decoder()


def _fields(raw: object, names: tuple[str, ...]) -> tuple[str, dict]:
    """(tag, fields) of one tagged struct in either encoding."""
    if isinstance(raw, dict):
        return str(raw.get("type", "")), raw
    if isinstance(raw, (list, tuple)) and raw:
        return str(raw[0]), dict(zip(names, raw[1:], strict=False))
    return "", {}


def _key(h: object) -> VHash:
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h  # type: ignore[return-value]


def _keys(keys: object, from_root: bool) -> tuple[str | None, int | None]:
    """(salt, keyed_from) of a BlockStored's per-block extra keys (vLLM orders each block's
    LoRA name, multimodal pairs, cache salt, prompt-embedding digests): the salt is the
    first block's only key, on a chain from the root (vLLM adds it there alone); any other
    key makes that block and those after it keyed by more than their tokens."""
    if not isinstance(keys, (list, tuple)):
        return None, None
    salt = None
    for i, k in enumerate(keys):
        if not k:
            continue
        if i == 0 and from_root and len(k) == 1 and isinstance(k[0], str):
            salt = k[0]
            continue
        return salt, i
    return salt, None


_MEDIA = (None, "GPU")  # vLLM's main KV pool (offloading tiers publish "CPU", ...)


def decode_batch(payload: bytes) -> tuple[float, list[Event], int]:
    """(timestamp, events, skipped) of one vLLM KVEventBatch message. ValueError when the
    payload is not one."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a msgpack KV event batch: {exc}") from None
    if isinstance(raw, dict):
        ts, events = raw.get("ts", 0.0), raw.get("events")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
    else:
        raise ValueError("not a KV event batch: expected [ts, events, ...] or a map")
    if not isinstance(events, (list, tuple)):
        raise ValueError("not a KV event batch: its events are not a list")
    out: list[Event] = []
    skipped = 0
    for ev in events:
        tag, f = _fields(ev, _STORED_FIELDS)
        if tag == "BlockRemoved" and isinstance(ev, (list, tuple)):
            f = dict(zip(_REMOVED_FIELDS, ev[1:], strict=False))
        if f.get("group_idx") not in (None, 0) or f.get("medium") not in _MEDIA:
            skipped += 1
            continue
        if tag == "BlockStored":
            parent = f.get("parent_block_hash")
            salt, keyed_from = _keys(f.get("extra_keys"), parent is None)
            out.append(Stored(tuple(_key(h) for h in f["block_hashes"]),
                              None if parent is None else _key(parent),
                              tuple(f["token_ids"]), int(f["block_size"]), salt,
                              f.get("extra_keys") is not None,
                              f.get("lora_id") is not None or f.get("lora_name") is not None,
                              keyed_from))
        elif tag == "BlockRemoved":
            out.append(Removed(tuple(_key(h) for h in f["block_hashes"])))
        elif tag == "AllBlocksCleared":
            out.append(Cleared())
        else:
            skipped += 1
    return float(ts or 0.0), out, skipped


@dataclass(eq=False, slots=True)
class _Block:
    """What is known of one vLLM block (by its hash)."""

    copies: int  # times vLLM holds it (stored minus removed; vLLM does not deduplicate)
    parent: VHash | None  # the vLLM block before it (None: the root)
    namespace: str
    end: int  # tokens from the root through this block
    last: int | None  # our hash of the last gateway block ending at or before `end`
    tail: bytes  # tokens (little-endian u32) after that gateway block, up to `end`
    done: tuple[int, ...]  # our hashes of the gateway blocks that end inside this block
    parents: tuple[int | None, ...]  # each one's parent among our hashes (None: root)
    # For each of `done`: the earlier vLLM blocks its tokens also overlap (must be held).
    deps: tuple[tuple[VHash, ...], ...]
    held: list[bool]  # whether each of `done` is counted as held through this block


class VLLMEventMapper:
    """See the module docstring."""

    def __init__(self, hashers: Hashers, sink: KVEventSink, max_blocks: int = 1 << 20,
                 namespace_of: Callable[[Sequence[int]], str | None] | None = None,
                 namespace_of_salt: Callable[[str], str | None] | None = None) -> None:
        self.hashers = hashers
        self.sink = sink
        self.max_blocks = max_blocks
        self.namespace_of = namespace_of
        self.namespace_of_salt = namespace_of_salt
        self._blocks: OrderedDict[VHash, _Block] = OrderedDict()  # copies > 0 only
        # vLLM hash -> (child vLLM hash, index into its `done`) of the gateway blocks that
        # overlap it but end in a later block: they are held only while it is cached. Kept
        # by hash, so a block dropped at 0 copies and stored again finds them.
        self._dependents: dict[VHash, set[tuple[VHash, int]]] = {}
        self._holds: dict[int, int] = {}  # our hash -> (vLLM block, index) pairs holding it
        self._parent: dict[int, int | None] = {}  # held our hash -> its parent
        self.suspended = False
        self.num_unplaced_blocks = 0  # vLLM blocks stored after an unknown parent
        self.num_foreign_blocks = 0  # LoRA, other extra keys, a salt not sent here
        self.num_unknown_removals = 0  # removals of vLLM blocks not known here
        self.engine_block_size = 0  # tokens per vLLM block, as its events say (0: none yet)

    # ------------------------------------------------------------------ queries

    @property
    def num_held_blocks(self) -> int:
        """Gateway blocks held now."""
        return len(self._holds)

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._holds

    def held_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """Leading blocks of `block_hashes` held now."""
        n = 0
        for h in block_hashes:
            if h not in self._holds:
                break
            n += 1
        return n

    # ------------------------------------------------------------------ events

    def apply(self, events: Sequence[Event]) -> None:
        for ev in events:
            if type(ev) is Stored:
                self._stored(ev)
            elif type(ev) is Removed:
                removed: list[int] = []
                for vh in ev.block_hashes:
                    self._removed(vh, removed)
                self._emit_removed(removed)
            else:
                self._clear()

    def set_engine_blocks(self, num_blocks: int) -> None:
        """Bound the map by the server's KV block count (0: unknown, bound unchanged)."""
        if num_blocks > 0 and num_blocks != self.max_blocks:
            self.max_blocks = num_blocks
            self._cap()

    def reset(self) -> None:
        """Forget what vLLM holds (events were lost): the sink is cleared."""
        self._clear()

    def suspend(self) -> None:
        if not self.suspended:
            self.suspended = True
            self.sink.cleared()

    def resume(self) -> None:
        if self.suspended:
            self.suspended = False
            for parent, hs in chains(self._parent):
                self.sink.stored(parent, hs)

    # ------------------------------------------------------------------ internals

    def _clear(self) -> None:
        self._blocks.clear()
        self._dependents.clear()
        self._holds.clear()
        self._parent.clear()
        if not self.suspended:
            self.sink.cleared()

    def _root_namespace(self, ev: Stored) -> str | None:
        """The namespace of a chain from the root; None: unknown (skipped)."""
        if ev.carries_keys:
            if not ev.salt:
                return ""
            return ev.salt if self.namespace_of_salt is None else self.namespace_of_salt(ev.salt)
        if self.namespace_of is not None:
            return self.namespace_of(ev.token_ids[: ev.block_size])
        return ""

    def _stored(self, ev: Stored) -> None:
        bs = ev.block_size
        n = len(ev.block_hashes)
        if bs < 1 or len(ev.token_ids) != n * bs:
            log.warning("vLLM BlockStored with %d tokens for %d blocks of %d: skipped",
                        len(ev.token_ids), n, bs)
            return
        self.engine_block_size = bs
        if ev.lora:
            self.num_foreign_blocks += n
            return
        if ev.keyed_from is not None:  # placed up to the first block keyed by more
            self.num_foreign_blocks += n - ev.keyed_from
            if not ev.keyed_from:
                return
            n = ev.keyed_from
        if ev.parent is None:
            namespace = self._root_namespace(ev)
            if namespace is None:
                if ev.carries_keys and ev.salt:
                    self.num_foreign_blocks += n
                else:
                    self.num_unplaced_blocks += n
                return
            prev = None
            end, last, tail = 0, None, b""
        else:
            prev = self._blocks.get(ev.parent)
            if prev is None:
                self.num_unplaced_blocks += n
                return
            self._blocks.move_to_end(ev.parent)
            namespace, end, last, tail = prev.namespace, prev.end, prev.last, prev.tail
        hasher = self.hashers.get(namespace)
        step = 4 * hasher.block_size
        data = tokens_to_bytes(ev.token_ids)
        stored: list[tuple[int | None, int]] = []  # (parent, hash) held after this event
        prev_hash: VHash | None = ev.parent
        for i, vh in enumerate(ev.block_hashes[:n]):
            b = self._blocks.get(vh)
            if b is None:
                chunk = tail + data[i * bs * 4:(i + 1) * bs * 4]
                full = len(chunk) // step
                done = tuple(hasher.hash_blocks(packed(chunk[: full * step]), last)) \
                    if full else ()
                parents = ((last, *done[:-1]) if done else ())
                deps = self._deps(prev_hash, end, len(tail) // 4, hasher.block_size, full)
                b = _Block(0, prev_hash, namespace, end + bs, done[-1] if done else last,
                           chunk[full * step:], done, parents, deps, [False] * full)
                self._blocks[vh] = b
                for k, dep_list in enumerate(deps):
                    for a in dep_list:
                        self._dependents.setdefault(a, set()).add((vh, k))
            else:
                self._blocks.move_to_end(vh)
            b.copies += 1
            self._hold_ready(b)
            # Re-stated even when already held: a chain the index dropped as an orphan
            # (its parent had left) is placed again once vLLM recomputes the parent.
            stored.extend((p, h) for p, h, on in zip(b.parents, b.done, b.held, strict=True) if on)
            for child, k in self._dependents.get(vh, ()):  # gateway blocks that waited
                c = self._blocks.get(child)
                if c is not None and not c.held[k]:
                    self._hold_ready(c)
                    if c.held[k]:
                        stored.append((c.parents[k], c.done[k]))
            namespace, end, last, tail = b.namespace, b.end, b.last, b.tail
            prev_hash = vh
        self._emit_stored(stored)
        self._cap()

    def _deps(self, parent: VHash | None, start: int, tail_tokens: int, gbs: int,
              full: int) -> tuple[tuple[VHash, ...], ...]:
        """For each of the `full` gateway blocks ending in a new vLLM block that starts at
        token `start` after `parent` (whose `tail_tokens` last tokens begin a gateway
        block), the earlier vLLM blocks its tokens overlap. An ancestor no longer known
        here is listed and never found cached: that gateway block is never held."""
        out = []
        for k in range(full):
            first_token = start - tail_tokens + k * gbs  # where gateway block k starts
            deps: list[VHash] = []
            a = parent
            while a is not None and first_token < start:
                blk = self._blocks.get(a)
                if blk is not None and blk.end <= first_token:
                    break
                deps.append(a)
                a = blk.parent if blk is not None else None
            out.append(tuple(deps))
        return tuple(out)

    def _hold_ready(self, b: _Block) -> None:
        """Count as held each gateway block ending in `b` whose vLLM blocks are all cached."""
        if b.copies <= 0:
            return
        blocks = self._blocks
        for k, (h, deps) in enumerate(zip(b.done, b.deps, strict=True)):
            if b.held[k] or not all(a in blocks and blocks[a].copies > 0 for a in deps):
                continue
            b.held[k] = True
            n = self._holds.get(h, 0)
            self._holds[h] = n + 1
            if not n:
                self._parent[h] = b.parents[k]

    def _unhold(self, b: _Block, k: int, removed: list[int]) -> None:
        if not b.held[k]:
            return
        b.held[k] = False
        h = b.done[k]
        n = self._holds[h] - 1
        if n:
            self._holds[h] = n
        else:
            del self._holds[h]
            del self._parent[h]
            removed.append(h)

    def _removed(self, vh: VHash, removed: list[int]) -> None:
        b = self._blocks.get(vh)
        if b is None or b.copies <= 0:
            self.num_unknown_removals += 1
            return
        b.copies -= 1
        if b.copies:  # another copy is still cached
            return
        self._release(vh, b, removed)
        self._drop(vh, b)

    def _release(self, vh: VHash, b: _Block, removed: list[int]) -> None:
        """`b` is no longer cached: what it held, and what overlaps it, leaves."""
        for k in range(len(b.done)):
            self._unhold(b, k, removed)
        for child, k in self._dependents.get(vh, ()):
            c = self._blocks.get(child)
            if c is not None:
                self._unhold(c, k, removed)

    def _drop(self, vh: VHash, b: _Block) -> None:
        """Forget `b` (released already), and its entries among its ancestors' dependents."""
        self._blocks.pop(vh, None)
        for k, deps in enumerate(b.deps):
            for a in deps:
                waiting = self._dependents.get(a)
                if waiting is not None:
                    waiting.discard((vh, k))
                    if not waiting:
                        del self._dependents[a]

    def _cap(self) -> None:
        if len(self._blocks) <= self.max_blocks:
            return
        removed: list[int] = []
        while len(self._blocks) > self.max_blocks:
            vh, b = next(iter(self._blocks.items()))
            self._release(vh, b, removed)
            self._drop(vh, b)
        self._emit_removed(removed)

    def _emit_stored(self, stored: list[tuple[int | None, int]]) -> None:
        if self.suspended or not stored:
            return
        # Consecutive blocks chain: one sink call per run.
        parent, run = stored[0][0], [stored[0][1]]
        for p, h in stored[1:]:
            if p == run[-1]:
                run.append(h)
            else:
                self.sink.stored(parent, run)
                parent, run = p, [h]
        self.sink.stored(parent, run)

    def _emit_removed(self, removed: list[int]) -> None:
        if removed and not self.suspended:
            self.sink.removed(removed)
