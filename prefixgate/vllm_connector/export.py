"""prefixgate's block transfer from inside vLLM: the ExportBlocks server over the connector's
host store, and the client that pulls a chain from any holder (a vLLM server with this
connector, or a prefixgate worker).

Contract
--------
`ExportServer(store, worker_id, host, port, dims, ticket_keys, link, tls).start()` serves
WorkerService.ExportBlocks and GetStatus (the rest of the Worker API is UNIMPLEMENTED there)
on its own gRPC threads. GetStatus carries only the link this server's own loads measured
(`link`, a workerapi/rates.TransferRate the connector feeds with each load's bytes and
seconds: `transfer_bytes_per_s`, `transfer_setup_s`, `transfer_rate_source`; zeros before
a load): the figures the adapter in front of this server reports for routing, measured
where the bytes move, not inferred from a turn's time to first token (which, on a busy
server, is mostly other requests' work). ExportBlocks runs so an export never waits for vLLM's engine steps: header, then chunks of
whole blocks of about `CHUNK_BYTES`, as prefixgate's workers send them
(workerapi/transfer.py `export_events`: the same `KVFormat` header and `encode_chunk` wire
form), of blocks [from_block, max_blocks) of the chain (max_blocks 0: to its end).
NOT_FOUND when the store holds none of them.

Pull tickets: with `ticket_keys` (the gateways' `@tickets` key, and this server's own
worker key when its keyring has one: `ticket_keys_of`), a request is served only when its
ticket passes security/tickets.py `check_ticket` (the check a prefixgate worker's
ExportBlocks makes), PERMISSION_DENIED saying which check failed otherwise, before any
page is read. The ticket must name `worker_id` as its holder: the id the gateway knows
this server by, i.e. its adapter's (engines/vllm.py: `worker_id_of(url)`, `vllm-HOST:PORT`
of its HTTP API, when the gateway follows the server itself; the sidecar's --worker-id in
the `prefixgate worker --engine vllm` form); launch/vllm.py passes that id. The ticket's
receiver is checked only under TLS (below), where the caller's certificate names it.
Without keys nothing is checked (bind the server to loopback, as `up` does, or to a
network only workers reach).

TLS (`tls`, an `ExportTLS` of PEM files: this server's certificate and key, and the CA
its callers' certificates must chain to): the export is served over mutual TLS, so only
callers with a certificate from that CA connect, and a pull ticket's receiver must be
among the names of the caller's certificate (`check_ticket`'s caller_names: its common
name and subject alternative names), so a ticket copied off a request is of no use to
another caller. `up --secure` gives each server a certificate of its own from its local
CA (security/local.py `issue_worker`), naming its worker id. Without `tls` the export
is plain gRPC: a ticket's receiver is not checked (a ticket copied off a request admits
its chain, from this holder, until it expires).

`held_blocks(channel, chain, timeout_s, ticket)` -> how many leading blocks of a chain an
export holds (its header's count, nothing read past it; None when it cannot say, e.g.
refused without a valid ticket).

`export_channel(peer, tls, peer_worker_id)` -> a channel to the export at `peer`: with
`tls`, over TLS presenting this server's certificate, the holder's certificate checked
against `peer_worker_id` (`security/local.py` `tls_name` of it: the CA issues every
worker's, so the address alone would accept any of them); TransferError UNAUTHENTICATED
without a worker id to check. Plain text without `tls`.

`ticket_keys_of(keyring_path, worker_id)` -> the keys above, read from a keyring file
(security/identity.py; ValueError when it has no `@tickets` line).

`StoreProbe(address, worker_id, tls, keyring_path)`: how vLLM's scheduler asks this
server's own export what its host store holds (the store lives in vLLM's worker process;
context overflow's shifted loads, connector.py): `held(chain, timeout_s)` is
`held_blocks` over `export_channel` with this server's TLS, each ask carrying a ticket
this server signs for itself (receiver and holder `worker_id`) with its own key, the
keyring's private line, which its export accepts (`ticket_keys_of`). `usable` is False
when the export checks tickets (a keyring) and the keyring holds no key of its own: then
nothing can be asked, and nothing is claimed.

`pull_chain(peer, chain, from_block, ticket, format, on_chunk, timeout_s, max_blocks,
tls, peer_worker_id)` asks `peer` (over `export_channel`) for
`chain[from_block:max_blocks or None]` (with a ticket, `chain` is the whole ticketed
chain: the holder checks its digest), checks its header against `format` (any
difference: TransferError FAILED_PRECONDITION), passes each chunk through `accept_chunk`
(the one place a received chunk is accepted) and hands its pages to
`on_chunk(first_block, num_blocks, k, v)` (raw bytes in the wire layout) in chain order;
returns the blocks handed over. A broken stream raises TransferError after the chunks
that arrived whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from prefixgate.security.auth import PermissionDenied
from prefixgate.security.kv_pages import verify_chunk
from prefixgate.security.tickets import check_ticket
from prefixgate.v1 import worker_pb2, worker_pb2_grpc
from prefixgate.vllm_connector.store import HostStore, Page
from prefixgate.workerapi.rates import TransferRate
from prefixgate.workerapi.transfer import (
    CHUNK_BYTES,
    MAX_MESSAGE_BYTES,
    KVFormat,
    TransferError,
    encode_chunk,
)

log = logging.getLogger("vllm.prefixgate_connector.export")

_SERVICE = "prefixgate.v1.WorkerService"
_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def page_bytes(t) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (any dtype, bfloat16 included)."""
    import torch

    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def ticket_keys_of(keyring_path: str, worker_id: str) -> tuple:
    """The keys a pull ticket must verify with at `worker_id`: the gateways' ticket key
    (the keyring's `@tickets` line) and `worker_id`'s own public key when the keyring holds
    its private line (as a prefixgate worker's do: workerapi/server.py `PeerTrust.of`).
    ValueError (saying what is missing) when the file does not parse or has no `@tickets`."""
    from prefixgate.security.identity import Keyring

    ring = Keyring.from_file(keyring_path)
    if ring.ticket_key is None:
        raise ValueError(f"{keyring_path} has no '@tickets' line: the connector cannot check "
                         "pull tickets without the gateways' ticket key")
    own = ring.private_key(worker_id)
    return (ring.ticket_key,) + ((own.public_key(),) if own is not None else ())


@dataclass(frozen=True)
class ExportTLS:
    """PEM files for mutual TLS on the transfer path: this server's certificate and key
    (presented to callers and, when it pulls, to holders) and the CA both ends' must
    chain to. (Not wire/rpc.py's TLSConfig: that module's health and reflection services
    are not in vLLM's environment.)"""

    cert_file: str
    key_file: str
    ca_file: str

    @classmethod
    def of(cls, cert_file: str, key_file: str, ca_file: str) -> ExportTLS | None:
        """The files checked readable now (ValueError saying which is missing or not
        readable); None when none is named."""
        named = {"tls_cert": cert_file, "tls_key": key_file, "tls_ca": ca_file}
        if not any(named.values()):
            return None
        for what, path in named.items():
            if not path:
                raise ValueError(f"the connector's TLS needs tls_cert, tls_key and tls_ca; "
                                 f"{what} is not given")
            try:
                Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"the connector's {what} {path}: {exc.strerror}") from None
        return cls(cert_file, key_file, ca_file)

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return (Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes(),
                Path(self.ca_file).read_bytes())

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)


def export_channel(peer: str, tls: ExportTLS | None, peer_worker_id: str) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(peer, options=_OPTIONS)
    if not peer_worker_id:
        raise TransferError(grpc.StatusCode.UNAUTHENTICATED,
                            f"no worker id for the holder at {peer}: its TLS certificate "
                            "cannot be checked, so it is not called")
    from prefixgate.security.local import tls_name

    return grpc.secure_channel(peer, tls.channel_credentials(), options=[
        *_OPTIONS, ("grpc.ssl_target_name_override", tls_name(peer_worker_id))])


def _caller_names(context: grpc.ServicerContext) -> set[str]:
    """The names (common name, subject alternative names) of the caller's TLS certificate
    (empty without TLS)."""
    ctx = context.auth_context() or {}
    return {v.decode(errors="replace") for key in ("x509_common_name",
                                                  "x509_subject_alternative_name")
            for v in ctx.get(key, ())}


class StoreProbe:
    """This server's own export, asked what its store holds (module docstring)."""

    def __init__(self, address: str, worker_id: str, tls: ExportTLS | None,
                 keyring_path: str = "") -> None:
        from prefixgate.security.tickets import TicketSigner

        self.address, self.worker_id, self.tls = address, worker_id, tls
        self._signer: TicketSigner | None = None
        self.usable = True
        if keyring_path:
            from prefixgate.security.identity import Keyring

            own = Keyring.from_file(keyring_path).private_key(worker_id)
            self._signer = TicketSigner(own) if own is not None else None
            self.usable = own is not None
        self._channel: grpc.Channel | None = None

    def held(self, chain: Sequence[int], timeout_s: float) -> int | None:
        """Leading blocks of `chain` the store holds (None: it cannot say)."""
        if not self.usable:
            return None
        if self._channel is None:
            self._channel = export_channel(self.address, self.tls, self.worker_id)
        ticket = (self._signer.sign(self.worker_id, self.worker_id, "", list(chain))
                  if self._signer is not None else b"")
        return held_blocks(self._channel, chain, timeout_s, ticket)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class ExportServer:
    """`dims`: (num_layers, num_kv_heads, head_dim, dtype name) of this server's pages;
    `ticket_keys`: the keys pull tickets must verify with (empty: tickets not checked);
    `tls`: served over mutual TLS with these files (None: plain gRPC)."""

    def __init__(self, store: HostStore, worker_id: str, host: str, port: int,
                 dims: tuple[int, int, int, str], chunk_bytes: int = CHUNK_BYTES,
                 ticket_keys: tuple = (), link: TransferRate | None = None,
                 tls: ExportTLS | None = None) -> None:
        self.store, self.worker_id, self.dims = store, worker_id, dims
        self.link = link if link is not None else TransferRate()
        self.ticket_keys = tuple(ticket_keys)
        self.tls = tls
        self.address = f"{host}:{port}"
        self.chunk_bytes = chunk_bytes
        self._server: grpc.Server | None = None

    def start(self) -> None:
        server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="pg-export"),
                             options=_OPTIONS)
        handler = grpc.unary_stream_rpc_method_handler(
            self._export, request_deserializer=worker_pb2.ExportBlocksRequest.FromString,
            response_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString())
        status = grpc.unary_unary_rpc_method_handler(
            self._status, request_deserializer=worker_pb2.GetStatusRequest.FromString,
            response_serializer=worker_pb2.WorkerStatus.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            _SERVICE, {"ExportBlocks": handler, "GetStatus": status}),))
        bound = (server.add_secure_port(self.address, self.tls.server_credentials())
                 if self.tls is not None else server.add_insecure_port(self.address))
        if not bound:
            raise OSError(f"cannot listen on {self.address}")
        server.start()
        self._server = server
        log.info("prefixgate connector: ExportBlocks on %s%s", self.address,
                 " (mutual TLS)" if self.tls is not None else "")

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1)
            self._server = None

    def _status(self, request: worker_pb2.GetStatusRequest, context: grpc.ServicerContext
                ) -> worker_pb2.WorkerStatus:
        link = self.link
        return worker_pb2.WorkerStatus(transfer_bytes_per_s=link.bytes_per_s,
                                       transfer_setup_s=link.setup_s,
                                       transfer_rate_source=link.source)

    def format_of(self, page: Page) -> KVFormat:
        layers, heads, dim, dtype = self.dims
        return KVFormat(page.fingerprint, page.block_size, dtype, layers, heads, dim)

    def _export(self, request: worker_pb2.ExportBlocksRequest, context: grpc.ServicerContext
                ) -> Iterator[worker_pb2.ExportBlocksEvent | bytes]:
        if self.ticket_keys:  # before any page is touched
            try:
                check_ticket(request.ticket, self.ticket_keys, self.worker_id,
                             request.block_hashes, _caller_names(context))
            except PermissionDenied as exc:
                log.warning("prefixgate connector %s: export refused: %s", self.worker_id, exc)
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        chain, start = list(request.block_hashes), request.from_block
        if request.max_blocks:
            chain = chain[:request.max_blocks]
        if start >= len(chain):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"from_block {start} is past the chain's {len(chain)} blocks")
        pages = self.store.run(chain, start)  # held by reference: evictions cannot touch them
        if not pages:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"{self.worker_id} holds none of blocks {start}.. of the chain "
                          "(evicted or never computed here): compute them")
        import torch

        fmt = self.format_of(pages[0])
        yield worker_pb2.ExportBlocksEvent(header=fmt.header(self.worker_id, len(pages)))
        per_chunk = max(1, self.chunk_bytes // fmt.bytes_per_block)
        for first in range(0, len(pages), per_chunk):
            run = pages[first:first + per_chunk]
            k = torch.cat([p.k for p in run], dim=1)
            v = torch.cat([p.v for p in run], dim=1)
            yield encode_chunk(start + first, len(run), page_bytes(k), page_bytes(v))


def accept_chunk(header: worker_pb2.KVBlocksHeader, chunk: worker_pb2.KVBlocksChunk) -> None:
    """Whether a received chunk may be written into vLLM's cache (TransferError DATA_LOSS
    otherwise, and nothing of it is written): its blocks' pages are whole for the header's
    format, and, where the holder sent per-block digests (`chunk.block_digests`: what a
    prefixgate worker recorded when it computed the pages, security/kv_pages.py), every
    block's pages match its digest. The one place a pulled chunk is accepted."""
    half = header.bytes_per_token * header.block_size // 2
    if not chunk.num_blocks or len(chunk.k) != chunk.num_blocks * half \
            or len(chunk.v) != len(chunk.k):
        raise TransferError(grpc.StatusCode.DATA_LOSS,
                            f"a malformed chunk (blocks {chunk.first_block}+{chunk.num_blocks}, "
                            f"{len(chunk.k)} bytes of keys)")
    # A whole chunk or none: the cache writer takes whole chunks, and the blocks that are
    # refused here are computed by vLLM (the connector reports them as not loaded).
    matched, why = verify_chunk(chunk.k, chunk.v, chunk.block_digests, chunk.num_blocks,
                                header.num_layers, required=False)
    if matched < chunk.num_blocks:
        raise TransferError(grpc.StatusCode.DATA_LOSS,
                            f"blocks {chunk.first_block}+{chunk.num_blocks}: {why}")


def held_blocks(channel: grpc.Channel, chain: Sequence[int], timeout_s: float,
                ticket: bytes = b"") -> int | None:
    """How many blocks of `chain`, from its first, the ExportBlocks at `channel` holds
    (its header's count; the stream is cancelled before its pages are read): 0 when
    none, None when it cannot say (unreachable, refused without a ticket)."""
    if not chain:
        return 0
    call = worker_pb2_grpc.WorkerServiceStub(channel).ExportBlocks(
        worker_pb2.ExportBlocksRequest(block_hashes=list(chain), from_block=0, ticket=ticket),
        timeout=timeout_s)
    try:
        first = next(iter(call), None)
        if first is None or first.WhichOneof("event") != "header":
            return None
        return int(first.header.num_blocks)
    except grpc.RpcError as exc:
        return 0 if exc.code() == grpc.StatusCode.NOT_FOUND else None
    finally:
        call.cancel()


def pull_chain(peer: str, chain: Sequence[int], from_block: int, ticket: bytes,
               format: KVFormat, on_chunk: Callable[[int, int, bytes, bytes], None],
               timeout_s: float, max_blocks: int = 0, tls: ExportTLS | None = None,
               peer_worker_id: str = "") -> int:
    end = min(max_blocks, len(chain)) if max_blocks else len(chain)
    with export_channel(peer, tls, peer_worker_id) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        call = stub.ExportBlocks(worker_pb2.ExportBlocksRequest(
            block_hashes=list(chain), from_block=from_block, ticket=ticket,
            max_blocks=max_blocks), timeout=timeout_s)
        received = 0
        try:
            events = iter(call)
            first = next(events, None)
            if first is None or first.WhichOneof("event") != "header":
                raise TransferError(grpc.StatusCode.DATA_LOSS,
                                    f"{peer}: the export stream did not start with a header")
            header = first.header
            why = format.mismatch(header)
            if why:
                raise TransferError(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"{peer}'s KV pages do not fit this server: {why}")
            want = min(header.num_blocks, end - from_block)
            while received < want:
                ev = next(events, None)
                if ev is None:
                    raise TransferError(grpc.StatusCode.DATA_LOSS,
                                        f"{peer}: the export stream ended after {received} of "
                                        f"{want} blocks")
                chunk = ev.chunk
                if chunk.first_block != from_block + received:
                    raise TransferError(grpc.StatusCode.DATA_LOSS,
                                        f"{peer}: chunk at block {chunk.first_block}, expected "
                                        f"{from_block + received}")
                accept_chunk(header, chunk)
                n = min(chunk.num_blocks, want - received)
                on_chunk(chunk.first_block, n, chunk.k, chunk.v)
                received += n
        except grpc.RpcError as exc:
            raise TransferError(exc.code(), f"{peer}: {exc.details()}") from None
        finally:
            call.cancel()
        return received
