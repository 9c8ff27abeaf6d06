"""The drain hand-off's vLLM parts without a vLLM server: which chains a draining vLLM
worker offers (the prompts it served, cut to what vLLM's events say it holds, a
conversation's earlier turns left out), and a PullBlocks a vLLM worker refuses before any
call to vLLM (no token ids; token ids that are not the chain's). With real vLLM servers:
tests/e2e/test_up_vllm_drain.py."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from prefixgate.engines.vllm import VLLMConfig, VLLMWorker
from prefixgate.engines.vllm_events import decode_batch
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.radix import packed, tokens_to_bytes
from prefixgate.v1 import worker_pb2
from prefixgate.wire.rpc import free_port
from prefixgate.workerapi.client import InProcessWorkerClient
from prefixgate.workerapi.server import WorkerConfig
from tests.engines.vllm_wire import encode, stored_chain, vhash

BS = 16  # the gateway's block size
VBS = 32  # vLLM's


def _worker(spec, export: str = "127.0.0.1:1") -> VLLMWorker:
    return VLLMWorker(spec, ChatTokenizer(spec), WorkerConfig("v", block_size=BS), VLLMConfig(
        f"http://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", export=export))


def _serve(w: VLLMWorker, tokens: list[int], namespace: str = "") -> list[int]:
    """What Generate keeps of a served prompt; its block hashes."""
    ids = packed(tokens_to_bytes(tokens))
    hashes = w.hashers.get(namespace).hash_blocks(ids)
    w._remember_served(hashes, ids, namespace)
    return hashes


def _vllm_stores(w: VLLMWorker, tokens: list[int], upto: int) -> None:
    _, events, _ = decode_batch(encode([stored_chain(tokens, VBS, 0, upto)]))
    w.mapper.apply(events)


def test_a_draining_vllm_worker_offers_what_it_served_and_still_holds(tiny_spec) -> None:
    rnd = random.Random(5)
    turn1 = [rnd.randrange(1000) for _ in range(4 * VBS + 5)]
    turn2 = turn1 + [rnd.randrange(1000) for _ in range(3 * VBS)]  # the same conversation
    other = [rnd.randrange(1000) for _ in range(3 * VBS)]
    w = _worker(tiny_spec)
    h1, h2, h3 = _serve(w, turn1), _serve(w, turn2), _serve(w, other)
    assert asyncio.run(w.handoff_chains()) == []  # vLLM holds none of it (no events)
    _vllm_stores(w, turn2, 7)
    _vllm_stores(w, other, 2)  # of its 3 vLLM blocks, 2 are held
    chains = asyncio.run(w.handoff_chains())
    # The most recent first; turn 1 is inside turn 2's chain; `other` cut to what is held.
    assert [c.block_hashes for c in chains] == [tuple(h3[:4]), tuple(h2)]
    assert [c.token_ids for c in chains] == [tuple(other[:4 * BS]), tuple(turn2[:len(h2) * BS])]
    assert h1 == h2[:len(h1)]
    # vLLM evicted turn 2's last block: its chain shrinks to what is left.
    _, removed, _ = decode_batch(encode([("removed", [vhash(turn2[:7 * VBS])])]))
    w.mapper.apply(removed)
    assert [len(c.block_hashes) for c in asyncio.run(w.handoff_chains())] == [4, 12]
    # Without a connector there is no ExportBlocks to pull from: nothing is offered.
    assert not _worker(tiny_spec, export="").hands_off and w.hands_off


@pytest.mark.parametrize("case", ["no tokens", "other tokens", "no connector"])
def test_a_vllm_worker_refuses_a_pull_it_cannot_make(tiny_spec, case: str) -> None:
    tokens = list(range(10, 10 + 2 * BS))

    async def main() -> grpc.aio.AioRpcError:
        w = _worker(tiny_spec, export="" if case == "no connector" else "127.0.0.1:1")
        hashes = w.hashers.get("").hash_blocks(packed(tokens_to_bytes(tokens)))
        sent = {"no tokens": [], "other tokens": tokens[::-1]}.get(case, tokens)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await InProcessWorkerClient(w).PullBlocks(worker_pb2.PullBlocksRequest(
                peer_address="127.0.0.1:2", peer_worker_id="p", block_hashes=hashes,
                token_ids=sent), timeout=5)
        await w.close()
        return info.value

    err = asyncio.run(main())
    want = {"no tokens": (grpc.StatusCode.FAILED_PRECONDITION, "token ids"),
            "other tokens": (grpc.StatusCode.INVALID_ARGUMENT, "do not hash"),
            "no connector": (grpc.StatusCode.UNIMPLEMENTED, "no prefixgate KV connector")}[case]
    assert err.code() == want[0] and want[1] in err.details()
