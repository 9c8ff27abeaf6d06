"""prefixgate's KV connector for vLLM, the parts that run without vLLM: the per-request
parameters, the host store, the ExportBlocks server and the pulling client over real gRPC
on loopback, the adapter's `--vllm-worker` form and its split of vLLM's cached tokens; and,
with a vLLM environment, the page layout probed against vLLM's own cache writer. (Two real
vLLM servers moving a conversation: tests/e2e/test_up_vllm_transfer.py.)"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import grpc
import pytest
import torch

from prefixgate.engines.vllm import VLLMConfig
from prefixgate.vllm_connector.export import ExportServer, pull_chain
from prefixgate.vllm_connector.params import PullParams, TransferParams
from prefixgate.vllm_connector.store import HostStore, Page
from prefixgate.wire.rpc import free_port
from prefixgate.workerapi.transfer import KVFormat, TransferError

LAYERS, HEADS, DIM, B = 2, 3, 4, 16


def _page(seed: int) -> Page:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, B, HEADS, DIM, generator=g)
    return Page("fp", B, k, k + 1000)


def test_params_round_trip_and_malformed_ones_are_none() -> None:
    params = TransferParams(16, "fp", (1, 2, (1 << 64) - 1),
                            PullParams("127.0.0.1:7", "w", 2, b"\x00ticket"))
    assert TransferParams.from_json(params.to_json()) == params
    assert TransferParams.from_json({"prefixgate": {"block_size": 16, "fingerprint": "f",
                                                    "block_hashes": [-1]}}) is None
    assert TransferParams.from_json({"other": {}}) is None
    assert TransferParams.from_json(None) is None


def test_store_keeps_runs_and_evicts_least_recent() -> None:
    one = _page(0).num_bytes
    store = HostStore(3 * one)
    for h in (10, 11, 12):
        store.put(h, _page(h))
    assert len(store.run([10, 11, 12, 13], 0)) == 3
    store.run([12], 0)  # touched: 10 and 11 are older
    store.put(13, _page(13))
    assert 10 not in store and 13 in store
    assert store.run([10, 11], 0) == []
    assert len(store.run([10, 11, 12, 13], 1)) == 3


def test_pull_gets_the_holders_pages_bit_for_bit_and_refuses_another_format() -> None:
    store = HostStore(64 << 20)
    chain = list(range(100, 110))
    for i, h in enumerate(chain[:7]):  # the holder has 7 of the 10 blocks
        store.put(h, _page(i))
    port = free_port()
    server = ExportServer(store, "holder", "127.0.0.1", port, (LAYERS, HEADS, DIM, "float32"),
                          chunk_bytes=3 * _page(0).num_bytes)  # several chunks
    server.start()
    try:
        got: dict[int, tuple[bytes, bytes]] = {}

        def on_chunk(first: int, n: int, k: bytes, v: bytes) -> None:
            kt = torch.frombuffer(bytearray(k), dtype=torch.float32).view(LAYERS, n * B,
                                                                          HEADS, DIM)
            vt = torch.frombuffer(bytearray(v), dtype=torch.float32).view(LAYERS, n * B,
                                                                          HEADS, DIM)
            for j in range(n):
                got[first + j] = (kt[:, j * B:(j + 1) * B], vt[:, j * B:(j + 1) * B])

        fmt = KVFormat("fp", B, "float32", LAYERS, HEADS, DIM)
        n = pull_chain(f"127.0.0.1:{port}", chain, 2, b"", fmt, on_chunk, 10)
        assert n == 5 and sorted(got) == [2, 3, 4, 5, 6]
        for i in got:
            assert torch.equal(got[i][0], _page(i).k) and torch.equal(got[i][1], _page(i).v)
        with pytest.raises(TransferError) as refused:
            pull_chain(f"127.0.0.1:{port}", chain, 0, b"",
                       KVFormat("fp", B, "bfloat16", LAYERS, HEADS, DIM), on_chunk, 10)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(TransferError) as missing:
            pull_chain(f"127.0.0.1:{port}", chain, 7, b"", fmt, on_chunk, 10)
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop()


def test_the_export_serves_only_with_a_ticket_naming_it(tmp_path: Path) -> None:
    """With the gateways' ticket key (a keyring's `@tickets` line), the connector's
    ExportBlocks serves a chain only with a ticket that names this server, that chain and
    has not expired (the check a prefixgate worker makes): a missing, foreign-signed,
    expired or other holder's or chain's ticket is PERMISSION_DENIED and no page leaves.
    A valid one is served as asked: the whole ticketed chain, cut at max_blocks."""
    import time

    from prefixgate.security.identity import Keyring, new_gateway_key, new_worker_key
    from prefixgate.security.tickets import TicketSigner, ticket_key, ticket_public_line
    from prefixgate.vllm_connector.export import ticket_keys_of

    holder = "vllm-127.0.0.1:8001"  # the adapter's id for the server (worker_id_of)
    gateways = bytes.fromhex(new_gateway_key().split(":", 1)[1])
    private, _ = new_worker_key(holder)
    keyring = tmp_path / "vllm.keyring"
    keyring.write_text(f"{private}\n{ticket_public_line(gateways)}\n")
    no_tickets = tmp_path / "plain.keyring"
    no_tickets.write_text(f"{private}\n")
    with pytest.raises(ValueError, match="@tickets"):
        ticket_keys_of(str(no_tickets), holder)
    keys = ticket_keys_of(str(keyring), holder)
    assert len(keys) == 2  # the gateways' key and this server's own

    store = HostStore(64 << 20)
    chain = list(range(200, 210))
    for i, h in enumerate(chain[:7]):
        store.put(h, _page(i))
    port = free_port()
    server = ExportServer(store, holder, "127.0.0.1", port, (LAYERS, HEADS, DIM, "float32"),
                          chunk_bytes=2 * _page(0).num_bytes, ticket_keys=keys)
    server.start()
    gateway = TicketSigner(ticket_key(gateways))
    fmt = KVFormat("fp", B, "float32", LAYERS, HEADS, DIM)
    ticketed = chain[:8]  # the gateway planned a pull of 8 blocks
    try:
        got: list[int] = []

        def on_chunk(first: int, n: int, k: bytes, v: bytes) -> None:
            kt = torch.frombuffer(bytearray(k), dtype=torch.float32).view(LAYERS, n * B,
                                                                          HEADS, DIM)
            for j in range(n):
                assert torch.equal(kt[:, j * B:(j + 1) * B], _page(first + j).k)
                got.append(first + j)

        ok = gateway.sign("vllm-127.0.0.1:8002", holder, "ns", ticketed)
        assert pull_chain(f"127.0.0.1:{port}", ticketed, 2, ok, fmt, on_chunk, 10,
                          max_blocks=6) == 4
        assert got == [2, 3, 4, 5]
        # Tickets this server signed itself with its own worker key pass too.
        own = TicketSigner(Keyring.parse(private).private_key(holder)).sign(
            "r", holder, "", ticketed)
        assert pull_chain(f"127.0.0.1:{port}", ticketed, 0, own, fmt, on_chunk, 10) == 7
        stranger = TicketSigner(ticket_key(b"s" * 32))
        refused = {  # what the refusal says -> (chain asked for, ticket)
            "signed by a gateway": (ticketed, b""),
            "signature does not verify": (ticketed, stranger.sign("r", holder, "ns",
                                                                  ticketed)),
            "for holder": (ticketed, gateway.sign("r", "vllm-127.0.0.1:9", "ns", ticketed)),
            "another chain": (chain[:7], ok),
            "expired": (ticketed, gateway.sign("r", holder, "ns", ticketed,
                                               now=time.time() - 600)),
            "does not parse": (ticketed, b"pgt1garbage"),
        }
        got.clear()
        for why, (asked, ticket) in refused.items():
            with pytest.raises(TransferError) as exc:
                pull_chain(f"127.0.0.1:{port}", asked, 0, ticket, fmt, on_chunk, 10)
            assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED, why
            assert why in str(exc.value)
        assert got == []  # not a page of any
    finally:
        server.stop()


def test_the_connector_pulls_a_ticketed_run_from_a_prefixgate_holder(
        loop_thread, tiny_spec, tiny_model, tmp_path: Path) -> None:
    """The connector's pull from a prefixgate worker that checks tickets: it sends the
    whole ticketed chain with max_blocks (the holder checks the ticket against the whole
    chain), so a load shorter than the gateway planned is served, with the holder's
    digests checked on the way in; asking for the cut chain is PERMISSION_DENIED."""
    from prefixgate.security.auth import AuthConfig
    from prefixgate.security.identity import new_gateway_key, new_worker_key
    from prefixgate.security.tickets import TicketSigner, ticket_key, ticket_public_line
    from prefixgate.v1 import worker_pb2_grpc
    from tests.helpers import start_worker
    from tests.worker.test_transfer import _generate, _service_engine

    gateways = bytes.fromhex(new_gateway_key().split(":", 1)[1])
    private, _ = new_worker_key("holder")
    ring = tmp_path / "holder.keyring"
    ring.write_text(f"{private}\n{ticket_public_line(gateways)}\n")
    address, stop = start_worker(loop_thread, tiny_spec, tiny_model, "holder", worker_config=dict(
        auth=AuthConfig(worker_keyring_file=str(ring))))
    try:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            prompt = [(i * 11) % 250 + 3 for i in range(130)]
            _generate(stub, prompt)
            transfer = _service_engine(stub).transfer
            chain = transfer.chain(prompt[:128], "")
            assert len(chain) == 8
            ticket = TicketSigner(ticket_key(gateways)).sign("vllm-127.0.0.1:8002", "holder",
                                                             "", chain)
            got: list[tuple[int, int]] = []
            n = pull_chain(address, chain, 1, ticket, transfer.format,
                           lambda first, num, k, v: got.append((first, num)), 30,
                           max_blocks=5)
            assert n == 4 and sum(num for _, num in got) == 4 and got[0][0] == 1
            with pytest.raises(TransferError) as exc:
                pull_chain(address, chain[:5], 1, ticket, transfer.format,
                           lambda *a: None, 30)
            assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_pull_from_nobody_is_unavailable() -> None:
    fmt = KVFormat("fp", B, "float32", LAYERS, HEADS, DIM)
    with pytest.raises(TransferError) as exc:
        pull_chain(f"127.0.0.1:{free_port()}", [1, 2], 0, b"", fmt, lambda *a: None, 5)
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE


def test_the_vllm_worker_form_names_the_connector() -> None:
    cfg = VLLMConfig.parse("http://h:8000,ipc:///d/e,ipc:///d/r,grpc://127.0.0.1:7100")
    assert (cfg.events, cfg.replay, cfg.export) == ("ipc:///d/e", "ipc:///d/r",
                                                     "127.0.0.1:7100")
    assert VLLMConfig.parse("http://h:8000,tcp://h:5557").export == ""
    with pytest.raises(ValueError, match="EXPORT"):
        VLLMConfig.parse("http://h:8000,tcp://h:1,tcp://h:2,tcp://h:3")


def test_vllm_cached_tokens_split_into_cached_and_transferred(smollm2_spec) -> None:
    """vLLM counts loaded tokens as cached: those past what it held here (in whole vLLM
    blocks), up to what the pull offered, are the transferred ones."""
    from prefixgate.engines.vllm import VLLMWorker, kv_bytes_per_token
    from prefixgate.engines.vllm_http import VLLMMetrics
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.workerapi.server import WorkerConfig

    w = VLLMWorker(smollm2_spec, ChatTokenizer(smollm2_spec), WorkerConfig("w", block_size=16),
                   VLLMConfig("http://127.0.0.1:1", "tcp://127.0.0.1:2", export="127.0.0.1:3"))
    w.metrics = VLLMMetrics(block_size=32)
    assert w.kv_bytes_per_token == kv_bytes_per_token(smollm2_spec.model_dir, "float32") \
        == 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32
    pulled = TransferParams(16, "fp", tuple(range(250)), PullParams("p", "w", 250))
    # 4,000-token prompt, 64 tokens held here, 4,000 cached in all: 3,936 came over.
    assert w._split_cached(4000, 3968, 64, pulled) == (64, 3904)
    assert w._split_cached(4000, 64, 64, pulled) == (64, 0)  # the load failed: computed
    assert w._split_cached(4000, 64, 64, TransferParams(16, "fp", ())) == (64, 0)


def test_pages_are_where_vllms_cache_writer_puts_them(tmp_path: Path) -> None:
    """Against vLLM's own `cpu_attn_reshape_and_cache` (float32 and bfloat16): what the
    layout reads is what vLLM wrote, and what it writes is byte for byte what vLLM would."""
    from prefixgate.launch.vllm import connector_path
    from tests.engines.vllm_server import vllm_python

    python = vllm_python()
    code = textwrap.dedent("""
        import torch, vllm._custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        from prefixgate.vllm_connector.pages import PagedLayout
        nb, H, bs, hd = 6, 3, 32, 64
        ids = torch.tensor([4, 1, 3])
        slots = (ids.view(-1, 1) * bs + torch.arange(bs)).view(-1)
        for dtype in (torch.float32, torch.bfloat16):
            isa = _get_attn_isa(dtype, bs, hd)
            cache = torch.zeros(nb, H, bs, 2 * hd, dtype=dtype)
            kc, vc = cache.view(nb, H, 2 * bs, hd).chunk(2, dim=2)
            key = torch.randn(3 * bs, H, hd).to(dtype)
            value = torch.randn(3 * bs, H, hd).to(dtype)
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
            layout = PagedLayout.of(cache, isa)
            k, v = layout.read(cache, ids)
            assert torch.equal(k, key) and torch.equal(v, value), (dtype, isa)
            again = torch.zeros_like(cache)
            layout.write(again, ids, key, value)
            assert torch.equal(again, cache), (dtype, isa)
            # Any other placement is read through its gather, with the same result.
            generic = layout.__class__(**{**layout.__dict__, "key_order": "gather",
                                          "value_order": "gather"})
            k, v = generic.read(cache, ids)
            assert torch.equal(k, key) and torch.equal(v, value), (dtype, isa)
            again = torch.zeros_like(cache)
            generic.write(again, ids, key, value)
            assert torch.equal(again, cache), (dtype, isa)
        print("pages ok")
    """)
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(connector_path(tmp_path / "path")),
                              "PATH": "/usr/bin:/bin"})
    assert "pages ok" in out.stdout, out.stderr[-2000:]


def test_the_adapter_relays_its_connectors_export(smollm2_spec) -> None:
    """ExportBlocks on the adapter (what a prefixgate worker calls on the sidecar) is the
    connector's stream, page for page; without a connector it is UNIMPLEMENTED."""
    import asyncio

    async def main() -> None:
        from prefixgate.engines.vllm import VLLMWorker
        from prefixgate.model.tokenizer import ChatTokenizer
        from prefixgate.v1 import worker_pb2
        from prefixgate.workerapi.client import InProcessWorkerClient
        from prefixgate.workerapi.server import WorkerConfig

        store = HostStore(64 << 20)
        for i, h in enumerate((7, 8, 9)):
            store.put(h, _page(i))
        port = free_port()
        server = ExportServer(store, "holder", "127.0.0.1", port, (LAYERS, HEADS, DIM, "float32"))
        server.start()
        tokenizer = ChatTokenizer(smollm2_spec)
        with_connector = VLLMWorker(smollm2_spec, tokenizer, WorkerConfig("w", block_size=16),
                                    VLLMConfig("http://127.0.0.1:1", "tcp://127.0.0.1:2",
                                               export=f"127.0.0.1:{port}"))
        without = VLLMWorker(smollm2_spec, tokenizer, WorkerConfig("w", block_size=16),
                             VLLMConfig("http://127.0.0.1:1", "tcp://127.0.0.1:2"))
        try:
            request = worker_pb2.ExportBlocksRequest(block_hashes=[7, 8, 9], from_block=1)
            events = [e async for e in InProcessWorkerClient(with_connector).ExportBlocks(request)]
            assert events[0].header.num_blocks == 2 and events[0].header.worker_id == "holder"
            chunks = [e.chunk for e in events[1:]]
            assert [c.first_block for c in chunks][0] == 1
            k = b"".join(c.k for c in chunks)
            expected = torch.cat([_page(1).k, _page(2).k], dim=1).numpy().tobytes()
            assert k == expected
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [e async for e in InProcessWorkerClient(without).ExportBlocks(request)]
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await with_connector.close()
            await without.close()
            server.stop()

    asyncio.run(main())


def test_status_prices_transfers_declared_then_measured(smollm2_spec) -> None:
    """With a connector the adapter's status says what the router prices a pull into it
    with: KV bytes per token, and a rate declared until pulls measure it (after a pulled
    turn, the figures its connector fitted to its own loads, read from the export's
    GetStatus). Without one: zeros (never planned)."""
    import asyncio

    from prefixgate.engines.vllm import VLLMWorker
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.workerapi.rates import TransferRate
    from prefixgate.workerapi.server import WorkerConfig

    tokenizer = ChatTokenizer(smollm2_spec)
    link, port = TransferRate(), free_port()
    server = ExportServer(HostStore(1 << 20), "w", "127.0.0.1", port,
                          (LAYERS, HEADS, DIM, "float32"), link=link)
    server.start()
    w = VLLMWorker(smollm2_spec, tokenizer, WorkerConfig("w", block_size=16),
                   VLLMConfig("http://127.0.0.1:1", "tcp://127.0.0.1:2",
                              export=f"127.0.0.1:{port}", transfer_bytes_per_s=5e8))
    status = w._status()
    assert status.kv_bytes_per_token == 46080
    assert (status.transfer_bytes_per_s, status.transfer_rate_source) == (5e8, "declared")

    async def refreshed() -> None:
        w._refresh_link()
        await w._link_refresh

    async def main() -> None:
        try:
            await refreshed()  # the connector has loaded nothing: still declared
            assert w._status().transfer_rate_source == "declared"
            link.observe(4000 * 46080, 1.0)  # 4,000 tokens in 1 s
            await refreshed()
        finally:
            await w._export().close()

    try:
        asyncio.run(main())
    finally:
        server.stop()
    status = w._status()
    assert status.transfer_rate_source == "measured"
    assert status.transfer_bytes_per_s == pytest.approx(4000 * 46080 / 1.0)
    plain = VLLMWorker(smollm2_spec, tokenizer, WorkerConfig("w", block_size=16),
                       VLLMConfig("http://127.0.0.1:1", "tcp://127.0.0.1:2"))
    status = plain._status()
    assert (status.kv_bytes_per_token, status.transfer_bytes_per_s,
            status.transfer_rate_source) == (0, 0, "")


def test_a_chunk_whose_pages_miss_their_holders_digests_is_refused() -> None:
    """Pages from a prefixgate holder come with the digests it recorded when it computed
    them: the connector writes a chunk only when every block matches (else DATA_LOSS, and
    vLLM computes those blocks); pages with no digests (a vLLM holder) pass on size."""
    from prefixgate.security.kv_pages import chunk_digests
    from prefixgate.v1 import worker_pb2
    from prefixgate.vllm_connector.export import accept_chunk

    pages = [_page(i) for i in range(3)]
    k = torch.cat([p.k for p in pages], dim=1).contiguous().numpy().tobytes()
    v = torch.cat([p.v for p in pages], dim=1).contiguous().numpy().tobytes()
    header = worker_pb2.KVBlocksHeader(block_size=B, num_layers=LAYERS, num_kv_heads=HEADS,
                                       head_dim=DIM, dtype="float32", num_blocks=3,
                                       bytes_per_token=2 * LAYERS * HEADS * DIM * 4)
    digests = chunk_digests(k, v, 3, LAYERS)
    accept_chunk(header, worker_pb2.KVBlocksChunk(first_block=0, num_blocks=3, k=k, v=v,
                                                  block_digests=digests))
    accept_chunk(header, worker_pb2.KVBlocksChunk(first_block=0, num_blocks=3, k=k, v=v))
    poisoned = bytearray(v)
    poisoned[-1] ^= 0x40  # one bit of the last block's values
    with pytest.raises(TransferError) as refused:
        accept_chunk(header, worker_pb2.KVBlocksChunk(first_block=0, num_blocks=3, k=k,
                                                      v=bytes(poisoned), block_digests=digests))
    assert refused.value.code == grpc.StatusCode.DATA_LOSS
    assert "digest" in str(refused.value)


def test_export_reports_the_link_its_loads_measured() -> None:
    """GetStatus on a connector's export carries the set-up and rate fitted to the loads
    that server made (bytes and seconds where they moved), zeros before any; the adapter
    in front of the server takes them as measured (TransferRate.adopt)."""
    from prefixgate.v1 import worker_pb2, worker_pb2_grpc
    from prefixgate.workerapi.rates import TransferRate

    link = TransferRate()
    port = free_port()
    server = ExportServer(HostStore(1 << 20), "holder", "127.0.0.1", port,
                          (LAYERS, HEADS, DIM, "float32"), link=link)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            before = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
            assert before.transfer_bytes_per_s == 0 and before.transfer_rate_source == ""
            # Loads of 1.5 MB in 0.05 s and 93 MB in 0.53 s: 0.0411 s of set-up, then
            # ~190 MB/s (a busy server's time to first token once read ~6 MB/s here).
            link.observe(1_474_560, 0.05)
            link.observe(92_897_280, 0.534)
            status = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
    finally:
        server.stop()
    assert status.transfer_rate_source == "measured"
    assert status.transfer_bytes_per_s == pytest.approx(
        (92_897_280 - 1_474_560) / (0.534 - 0.05), rel=1e-6)
    assert status.transfer_setup_s == pytest.approx(
        0.05 - 1_474_560 / status.transfer_bytes_per_s, rel=1e-6)
    adopted = TransferRate()
    adopted.assume(1e9, 0.0, "declared")
    adopted.adopt(status.transfer_bytes_per_s, status.transfer_setup_s)
    assert (adopted.bytes_per_s, adopted.source) == (status.transfer_bytes_per_s, "measured")
    adopted.assume(1e9, 0.0, "declared")  # a declaration never outranks a measurement
    assert adopted.source == "measured"
