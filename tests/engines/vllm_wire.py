"""vLLM's KV event wire format, for tests: the msgspec structs as vLLM declares them
(vllm/distributed/kv_events.py; 0.32: the batch `array_like`, the tagged events maps;
older releases made the events arrays too), content-addressed block hashes (opaque bytes,
as vLLM's sha256-based ones are) and a publisher speaking vLLM 0.32's ZMQ protocol (PUB
frames `(topic, seq as 8 bytes big-endian, payload)`; a ROUTER replay socket that answers
a start sequence number with `(topic, seq, payload)` frames, then `(b"", -1, b"")`)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import msgspec
import zmq


def _structs(array_like: bool):
    """The structs; `array_like`: the events too are arrays (older vLLM)."""
    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False,
                       tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch


STRUCTS = {False: _structs(False), True: _structs(True)}
_encoder = msgspec.msgpack.Encoder()


def vhash(tokens: list[int], salt: str = "") -> bytes:
    """A content-addressed block hash (opaque to the mapper, like vLLM's)."""
    return hashlib.sha256(repr((salt, tuple(tokens))).encode()).digest()


def encode(events: list[tuple], array_like: bool = False, ts: float = 0.0) -> bytes:
    """A KVEventBatch of ("stored", hashes, parent, tokens, block_size, salt_or_None,
    with_keys) / ("removed", hashes) / ("cleared",) tuples."""
    stored_t, removed_t, cleared_t, batch_t = STRUCTS[array_like]
    out = []
    for ev in events:
        if ev[0] == "stored":
            _, hashes, parent, tokens, bs, salt, with_keys = ev
            keys = None
            if with_keys:  # vLLM keys only a sequence's first block with the salt
                keys = [((salt,) if salt and i == 0 and parent is None else None)
                        for i in range(len(hashes))]
            out.append(stored_t(list(hashes), parent, list(tokens), bs, None, "GPU", None,
                                keys))
        elif ev[0] == "removed":
            out.append(removed_t(list(ev[1]), "GPU"))
        else:
            out.append(cleared_t())
    return _encoder.encode(batch_t(ts, out))


def stored_chain(tokens: list[int], block_size: int, first: int, upto: int,
                 salt: str = "", with_keys: bool = True) -> tuple:
    """The BlockStored vLLM emits for blocks [first, upto) of a sequence `tokens`."""
    hashes = [vhash(tokens[:(i + 1) * block_size], salt) for i in range(first, upto)]
    parent = vhash(tokens[:first * block_size], salt) if first else None
    return ("stored", hashes, parent, tokens[first * block_size: upto * block_size],
            block_size, salt or None, with_keys)


class Publisher:
    """vLLM's ZMQ publisher protocol on loopback ports (bound; the adapter connects)."""

    def __init__(self, array_like: bool = False, replay: bool = True, topic: bytes = b"",
                 ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.router = None
        self.replay_endpoint = ""
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.array_like = array_like
        self.topic = topic
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []

    def publish(self, events: list[tuple], send: bool = True) -> int:
        """Publish one batch (or only buffer it for replay: a message lost on the way)."""
        payload = encode(events, self.array_like, ts=time.time())  # as vLLM stamps batches
        seq = self.seq
        self.seq += 1
        if send:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self.buffer.append((seq, payload))
        return seq

    def serve_replay(self, timeout_ms: int = 0) -> bool:
        """Answer one replay request if one is waiting (vLLM serves them in its publisher
        thread between batches)."""
        if self.router is None or not self.router.poll(timeout_ms):
            return False
        client, empty, start = self.router.recv_multipart()
        first = int.from_bytes(start, "big")
        for seq, payload in self.buffer:
            if seq >= first:
                self.router.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"),
                                            payload))
        self.router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True),
                                    b""))
        return True

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
