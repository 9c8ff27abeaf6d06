"""`PrefixgateConnector`: prefixgate's block transfer as a vLLM KV connector (KVConnectorBase_V1).

vLLM runs two instances: the scheduler's and the worker's (which holds the KV cache).

Scheduler side
--------------
- `get_num_new_matched_tokens`: a request whose `kv_transfer_params` carry a pull
  (params.py) is reported as having the prompt's leading tokens the holder has, in whole
  vLLM blocks and never the prompt's last token (vLLM must compute at least one), past what
  vLLM already holds; loaded asynchronously (vLLM allocates the blocks and parks the request
  until the load is done, running other requests meanwhile).
- A request whose `kv_transfer_params` carry a shift (an overflowing conversation whose
  oldest turns the adapter dropped: params.py `ShiftParams`) is reported as having the
  prompt's tokens that an earlier layout of the conversation, held in this server's host
  store, covers once moved back (shift.py `choose_layout`; whole vLLM blocks, never the
  last prompt token, past what vLLM's own cache holds), loaded the same way. The store
  lives in vLLM's worker process, so the scheduler asks this server's own ExportBlocks
  how much of each layout it holds (its header's block count; export.py `held_blocks`),
  never claiming more than is there: vLLM counts what is claimed as cached. When its
  export checks pull tickets, each ask carries a ticket this server signs for itself with
  its own key (its keyring's private line: export.py `StoreProbe`), over its TLS when it
  has one. When that cannot be asked (no export port, or a keyring without this
  server's own key) nothing is claimed and vLLM computes the kept prompt.
- `update_state_after_alloc` / `build_connector_meta`: the load (holder, chain, token range,
  vLLM block ids) goes to the worker side once, in the next step's metadata; every step also
  names, for each request carrying prefixgate block hashes, the prompt blocks that step
  completes (to keep, see below).

Worker side
-----------
- `register_kv_caches`: the layers' cache tensors, their layout probed (pages.py); starts
  the ExportBlocks server (export.py) when `export_port` is configured, as worker
  `worker_id` (the id the gateway knows this server by: export.py says which), checking
  pull tickets when `keyring` names a keyring file with the gateways' `@tickets` line
  (a path in `kv_connector_extra_config`, never the key itself; a keyring that cannot be
  read, or has no `@tickets` line, stops the server at start: never an unchecked export),
  over mutual TLS when `tls_cert`, `tls_key` and `tls_ca` name PEM files (export.py
  `ExportTLS`; one missing or unreadable stops the server at start, as a keyring does).
- `start_load_kv`: each new load runs on a thread of its own: it pulls the chain from the
  holder (with the gateway's ticket: the whole ticketed chain and `max_blocks`, as
  prefixgate's workers ask; with TLS, presenting this server's certificate and checking
  the holder's against the holder's worker id, never in plain text) and writes each
  chunk's tokens into the request's blocks as it arrives (those blocks belong to the
  request alone until vLLM hears the load is done, so no step reads them meanwhile).
  `get_finished` reports the loads done;
  `get_block_ids_with_load_errors` the blocks a load could not fill (holder gone, blocks
  evicted there, format mismatch, a refused chunk or ticket): vLLM recomputes from the
  first of them (kv_load_failure_policy "recompute", which params.connector_config sets:
  vLLM's default fails the request), so a failed pull never fails a request.
  A shifted load reads the chosen layout's pages from the host store instead, gathers
  each kept token from its old position, rotates its key back by the layout's delta with
  the model's RoPE (shift.py `shifted_kv`; the preamble moves by 0) and writes them into
  the request's blocks. Moved K/V are approximate (they attended to the dropped turns):
  the adapter sends such a prompt under a cache salt of its own and salted block hashes
  (docs/reindex.md), so no exact request ever matches what is computed after them.
- `wait_for_save`: after each step, the pages of the prompt blocks the step completed go to
  the bounded host store (store.py) under their prefixgate hashes, skipping those held: a
  copy of the step's new blocks (the step's own compute dwarfs it), after which exports
  read the store on their own threads and never wait for a step.

Counts: `vllm:external_prefix_cache_hits_total` (vLLM's) counts the tokens loaded; the
log says each load's tokens, bytes and seconds.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from prefixgate.vllm_connector.export import (
    ExportServer,
    ExportTLS,
    StoreProbe,
    pull_chain,
    ticket_keys_of,
)
from prefixgate.vllm_connector.pages import PagedLayout
from prefixgate.vllm_connector.params import DEFAULT_STORE_MIB, ShiftParams, TransferParams
from prefixgate.vllm_connector.shift import UnsupportedRope, choose_layout, rope_of, shifted_kv
from prefixgate.vllm_connector.store import HostStore, Page
from prefixgate.workerapi.rates import TransferRate
from prefixgate.workerapi.transfer import KVFormat, TransferError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under vLLM's logger, so its handlers and level apply inside the server.
log = logging.getLogger("vllm.prefixgate_connector")

PULL_TIMEOUT_S = 120.0

SHIFT_PROBE_TIMEOUT_S = 2.0  # the scheduler asking this server's export what it holds


@dataclass
class LoadSpec:
    """Load tokens [from_token, to_token) of a request from a holder into its blocks."""

    req_id: str
    peer: str
    peer_worker_id: str  # the holder's worker id (its TLS certificate names it)
    chain: list[int]  # prefixgate block hashes from the prompt's first block
    ticket: bytes
    ticket_blocks: int  # the ticket covers chain[:ticket_blocks] (the pull's num_blocks)
    block_size: int  # prefixgate's
    fingerprint: str
    from_token: int
    to_token: int
    block_ids: list[int]  # the request's vLLM blocks, from its first token
    shift: ShiftParams | None = None  # a shifted load from the host store (peer unused)


@dataclass
class SaveSpec:
    """Keep prefixgate blocks [first_block, first_block + len(hashes)) of a request."""

    hashes: list[int]
    first_block: int
    block_size: int
    fingerprint: str
    block_ids: list[int]


@dataclass
class PrefixgateMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class PrefixgateConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self._block_size = vllm_config.cache_config.block_size
        # Pages are mapped for vLLM's CPU backend (pages.py); elsewhere nothing is planned
        # or kept, and vLLM computes as without the connector.
        from vllm.platforms import current_platform

        self._enabled = current_platform.is_cpu()
        if not self._enabled:
            log.warning("prefixgate connector: maps the KV pages of vLLM's CPU backend only; "
                        "this server moves no blocks")
        try:
            self._rope = rope_of(vllm_config.model_config.hf_config)
        except (UnsupportedRope, AttributeError, KeyError, TypeError, ValueError) as exc:
            log.warning("prefixgate connector: %s; overflowing conversations are computed", exc)
            self._rope = None
        # Scheduler side.
        self._params: dict[str, TransferParams] = {}
        self._planned: dict[str, tuple[TransferParams, int, int]] = {}  # id -> (p, from, n)
        self._loads: list[LoadSpec] = []
        self._saved_blocks: dict[str, int] = {}  # prefixgate blocks named for keeping
        # Requests whose load was handed to the worker side: never planned again (a failed
        # load sends the request back to vLLM's queue, which asks again).
        self._attempted: set[str] = set()
        # Worker side.
        self._store = HostStore(int(cfg.get_from_extra_config("store_mib", DEFAULT_STORE_MIB))
                                << 20)
        self._export_host = str(cfg.get_from_extra_config("export_host", "127.0.0.1"))
        self._export_port = int(cfg.get_from_extra_config("export_port", 0) or 0)
        self._worker_id = str(cfg.get_from_extra_config("worker_id", "") or
                              f"vllm-{self._export_host}:{self._export_port}")
        self._keyring = str(cfg.get_from_extra_config("keyring", "") or "")
        # Raises (stopping vLLM at start) when a TLS file is missing or unreadable.
        self._tls = ExportTLS.of(*(str(cfg.get_from_extra_config(name, "") or "")
                                   for name in ("tls_cert", "tls_key", "tls_ca")))
        # This server's export, asked by the scheduler (its channel opened on first use).
        self._probe = StoreProbe(f"{self._export_host}:{self._export_port}", self._worker_id,
                                 self._tls, self._keyring) if self._export_port else None
        if self._probe is not None and not self._probe.usable:
            log.warning("prefixgate connector: its keyring %s holds no key of %s's own to "
                        "sign for asking its export: overflowing conversations are computed",
                        self._keyring, self._worker_id)
        self._layers: list[tuple[str, torch.Tensor]] = []
        self._layout: PagedLayout | None = None
        self._server: ExportServer | None = None
        self._lock = threading.Lock()
        self._running: dict[str, threading.Thread] = {}
        self._done: dict[str, list[int]] = {}  # req id -> block ids it could not fill
        self._failed_blocks: set[int] = set()
        self._link = TransferRate()  # this server's loads: bytes and seconds (GetStatus)

    # ================================================================ scheduler side

    def on_new_request(self, request: Request) -> None:
        params = TransferParams.from_json(request.kv_transfer_params)
        if params is not None and self._enabled:
            self._params[request.request_id] = params

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        params = self._params.get(request.request_id)
        if params is not None and params.shift is not None:
            return self._match_shift(request, params, num_computed_tokens)
        if params is None or params.pull is None or request.num_preemptions \
                or request.request_id in self._attempted:
            return 0, False
        vbs = self._block_size
        # Tokens the holder has, never the prompt's last one, in whole vLLM blocks.
        have = min(params.pull.num_blocks, len(params.block_hashes)) * params.block_size
        have = min(have, request.num_prompt_tokens - 1) // vbs * vbs
        extra = have - num_computed_tokens
        if extra <= 0:
            return 0, False
        self._planned[request.request_id] = (params, num_computed_tokens, extra)
        return extra, True

    def _match_shift(self, request: Request, params: TransferParams, num_computed_tokens: int
                     ) -> tuple[int, bool]:
        """Tokens a shifted load gives past vLLM's own hit (see the module)."""
        assert params.shift is not None
        if self._rope is None or request.num_preemptions \
                or request.request_id in self._attempted:
            return 0, False
        vbs = self._block_size
        limit = (request.num_prompt_tokens - 1) // vbs * vbs
        if request.request_id in self._planned:  # asked again (not scheduled yet)
            _, start, extra = self._planned[request.request_id]
            return (extra, True) if start == num_computed_tokens else (0, False)
        probe = self._probe
        if probe is None or not probe.usable:
            return 0, False

        def held(chain) -> range:
            return range(probe.held(chain, SHIFT_PROBE_TIMEOUT_S) or 0)

        best = choose_layout(held, params.shift, params.block_size, limit)
        end = best[0] // vbs * vbs if best is not None else 0
        extra = end - num_computed_tokens
        if extra <= 0:
            return 0, False
        self._planned[request.request_id] = (params, num_computed_tokens, extra)
        return extra, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        planned = self._planned.pop(request.request_id, None)
        if not num_external_tokens or planned is None:
            return
        params, start, _ = planned
        self._attempted.add(request.request_id)
        if params.shift is not None:
            self._loads.append(LoadSpec(
                request.request_id, "", "", [], b"", 0, params.block_size, params.fingerprint,
                start, start + num_external_tokens, list(blocks.get_block_ids()[0]),
                shift=params.shift))
            return
        assert params.pull is not None
        self._loads.append(LoadSpec(
            request.request_id, params.pull.peer, params.pull.peer_worker_id,
            list(params.block_hashes),
            params.pull.ticket, params.pull.num_blocks, params.block_size, params.fingerprint,
            start, start + num_external_tokens, list(blocks.get_block_ids()[0])))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PrefixgateMetadata(loads=self._loads)
        self._loads = []
        cached = scheduler_output.scheduled_cached_reqs
        progress = [(r.req_id, r.num_computed_tokens) for r in
                    scheduler_output.scheduled_new_reqs]
        progress += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, computed in progress:
            params = self._params.get(req_id)
            if params is None or self._kv_cache_manager is None:
                continue
            end = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(len(params.block_hashes), end // params.block_size)
            done = self._saved_blocks.get(req_id, 0)
            if full <= done:
                continue
            self._saved_blocks[req_id] = full
            block_ids = list(self._kv_cache_manager.get_blocks(req_id).get_block_ids()[0])
            meta.saves.append(SaveSpec(list(params.block_hashes[done:full]), done,
                                       params.block_size, params.fingerprint, block_ids))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        for table in (self._params, self._planned, self._saved_blocks):
            table.pop(request.request_id, None)
        self._attempted.discard(request.request_id)
        return False, None

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self._layers = sorted(kv_caches.items(), key=lambda kv: extract_layer_index(kv[0]))
        if not self._enabled or not self._layers:
            return
        name, first = self._layers[0]
        try:
            self._layout = PagedLayout.of(first, self._isa(name, first))
        except (ValueError, RuntimeError, ImportError, AttributeError) as exc:
            log.error("prefixgate connector: cannot map this KV cache (%s): no transfer", exc)
            self._layout = None
            return
        if self._export_port:
            keys = ticket_keys_of(self._keyring, self._worker_id) if self._keyring else ()
            self._server = ExportServer(self._store, self._worker_id, self._export_host,
                                        self._export_port, self._dims(), ticket_keys=keys,
                                        link=self._link, tls=self._tls)
            self._server.start()

    def _isa(self, layer_name: str, cache: torch.Tensor) -> str:
        layer = self._vllm_config.compilation_config.static_forward_context.get(layer_name)
        isa = getattr(getattr(layer, "impl", None), "isa", None) or getattr(layer, "isa", None)
        if isa:
            return str(isa)
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return _get_attn_isa(cache.dtype, cache.shape[2], cache.shape[3] // 2)

    def _dims(self) -> tuple[int, int, int, str]:
        assert self._layout is not None
        return (len(self._layers), self._layout.num_kv_heads, self._layout.head_dim,
                str(self._layout.dtype).removeprefix("torch."))

    def _format(self, fingerprint: str, block_size: int) -> KVFormat:
        layers, heads, dim, dtype = self._dims()
        return KVFormat(fingerprint, block_size, dtype, layers, heads, dim)

    def _block_ids(self, block_ids: list[int], start: int, stop: int) -> torch.Tensor:
        """The vLLM blocks holding tokens [start, stop) (start a multiple of the block size)."""
        vbs = self._block_size
        return torch.tensor(block_ids[start // vbs: -(-stop // vbs)], dtype=torch.long)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrefixgateMetadata)
        for spec in meta.loads:
            thread = threading.Thread(target=self._load, args=(spec,), daemon=True,
                                      name=f"pg-load-{spec.req_id}")
            with self._lock:
                self._running[spec.req_id] = thread
            thread.start()
        if forward_context.attn_metadata is None and self._running:
            time.sleep(0.002)  # a step with nothing to run but loads: let them have the CPU

    def _load(self, spec: LoadSpec) -> None:
        """Pull tokens [from_token, to_token) and write them; record the blocks unfilled."""
        if spec.shift is not None:
            self._load_shifted(spec)
            return
        began = time.monotonic()
        B = spec.block_size
        written = spec.from_token  # tokens [from_token, written) are in vLLM's blocks
        num_bytes = 0
        error = ""
        try:
            if self._layout is None:
                raise TransferError(grpc.StatusCode.FAILED_PRECONDITION,
                                    "this server's KV cache layout is not mapped")
            fmt = self._format(spec.fingerprint, B)
            layers, heads, dim, _ = self._dims()
            first_block = spec.from_token // B
            last_block = -(-spec.to_token // B)

            vbs = self._block_size
            # Tokens received past `written` that do not fill a vLLM block yet (a chunk
            # ends wherever prefixgate's blocks do): written with the next chunk's.
            carry: list[tuple[torch.Tensor, torch.Tensor]] = []

            def on_chunk(first: int, n: int, k: bytes, v: bytes) -> None:
                nonlocal written, num_bytes
                lo = max(first * B, spec.from_token)
                hi = min((first + n) * B, spec.to_token)
                num_bytes += len(k) + len(v)
                if hi <= lo:
                    return
                dtype = self._layout.dtype
                # Views of the received bytes (read-only: only read, copied into the cache).
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    kt = torch.frombuffer(k, dtype=dtype).view(layers, n * B, heads, dim)
                    vt = torch.frombuffer(v, dtype=dtype).view(layers, n * B, heads, dim)
                rows = slice(lo - first * B, hi - first * B)
                carry.append((kt[:, rows], vt[:, rows]))
                have = sum(c[0].shape[1] for c in carry)
                whole = have if written + have == spec.to_token else have // vbs * vbs
                if not whole:
                    return
                ks = torch.cat([c[0] for c in carry], dim=1) if len(carry) > 1 else carry[0][0]
                vs = torch.cat([c[1] for c in carry], dim=1) if len(carry) > 1 else carry[0][1]
                carry[:] = [(ks[:, whole:], vs[:, whole:])] if whole < have else []
                ids = self._block_ids(spec.block_ids, written, written + whole)
                for i, (_, cache) in enumerate(self._layers):
                    self._layout.write(cache, ids, ks[i, :whole], vs[i, :whole])
                written += whole

            if spec.ticket:  # the holder checks the whole ticketed chain; max_blocks limits it
                pull_chain(spec.peer, spec.chain[:spec.ticket_blocks], first_block, spec.ticket,
                           fmt, on_chunk, PULL_TIMEOUT_S, max_blocks=last_block, tls=self._tls,
                           peer_worker_id=spec.peer_worker_id)
            else:
                pull_chain(spec.peer, spec.chain[:last_block], first_block, b"", fmt, on_chunk,
                           PULL_TIMEOUT_S, tls=self._tls, peer_worker_id=spec.peer_worker_id)
        except TransferError as exc:
            error = str(exc)
        except Exception as exc:  # never let a load take vLLM's step loop down
            log.exception("prefixgate connector: load of %s failed", spec.req_id)
            error = repr(exc)
        vbs = self._block_size
        unfilled = spec.block_ids[written // vbs: -(-spec.to_token // vbs)] \
            if written < spec.to_token else []
        seconds = time.monotonic() - began
        log.info("prefixgate connector: %s loaded %d of %d tokens from %s (%.1f MB in %.3f s)%s",
                 spec.req_id, written - spec.from_token, spec.to_token - spec.from_token,
                 spec.peer, num_bytes / 1e6, seconds, f": {error}" if error else "")
        with self._lock:
            if not error:
                self._link.observe(num_bytes, seconds)
            self._running.pop(spec.req_id, None)
            self._done[spec.req_id] = unfilled

    def _load_shifted(self, spec: LoadSpec) -> None:
        """Move the kept run of an overflowing prompt from the host store into tokens
        [from_token, to_token) of its blocks (as far as a held layout reaches, in whole
        vLLM blocks); record the blocks unfilled."""
        began = time.monotonic()
        vbs = self._block_size
        written, delta, error = spec.from_token, 0, ""
        try:
            assert spec.shift is not None
            if self._layout is None or self._rope is None:
                raise TransferError(grpc.StatusCode.FAILED_PRECONDITION,
                                    "this server's KV cache layout or RoPE is not mapped")
            best = choose_layout(lambda chain: self._store.run(chain, 0), spec.shift,
                                 spec.block_size, spec.to_token)
            if best is None:
                raise TransferError(grpc.StatusCode.NOT_FOUND,
                                    "no earlier layout of the conversation is held")
            end, delta, pages = best
            stop = end // vbs * vbs
            if stop > spec.from_token:
                k, v = shifted_kv(pages, spec.shift.n_keep, delta, spec.from_token, stop,
                                  self._rope)
                ids = self._block_ids(spec.block_ids, spec.from_token, stop)
                for i, (_, cache) in enumerate(self._layers):
                    self._layout.write(cache, ids, k[i], v[i])
                written = stop
        except TransferError as exc:
            error = str(exc)
        except Exception as exc:  # never let a load take vLLM's step loop down
            log.exception("prefixgate connector: shifted load of %s failed", spec.req_id)
            error = repr(exc)
        unfilled = spec.block_ids[written // vbs: -(-spec.to_token // vbs)] \
            if written < spec.to_token else []
        log.info("prefixgate connector: %s moved %d of %d tokens back by %d positions "
                 "(%.3f s)%s", spec.req_id, written - spec.from_token,
                 spec.to_token - spec.from_token, delta, time.monotonic() - began,
                 f": {error}" if error else "")
        with self._lock:
            self._running.pop(spec.req_id, None)
            self._done[spec.req_id] = unfilled

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # kept whole after the step (wait_for_save)

    def wait_for_save(self) -> None:
        if self._layout is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrefixgateMetadata)
        for spec in meta.saves:
            self._save(spec)

    def _save(self, spec: SaveSpec) -> None:
        B = spec.block_size
        todo = [i for i, h in enumerate(spec.hashes) if h not in self._store]
        if not todo:
            return
        lo, hi = (spec.first_block + todo[0]) * B, (spec.first_block + todo[-1] + 1) * B
        vbs = self._block_size
        start = lo // vbs * vbs  # the first vLLM block's first token
        ids = self._block_ids(spec.block_ids, start, hi)
        ks, vs = zip(*(self._layout.read(cache, ids) for _, cache in self._layers), strict=True)
        k, v = torch.stack(ks), torch.stack(vs)  # [layers, tokens from `start`, heads, dim]
        for i in todo:
            rows = slice((spec.first_block + i) * B - start, (spec.first_block + i + 1) * B - start)
            self._store.put(spec.hashes[i], Page(spec.fingerprint, B,
                                                 k[:, rows].contiguous(), v[:, rows].contiguous()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            if not self._done:
                return None, None
            done, self._done = self._done, {}
        for unfilled in done.values():
            self._failed_blocks.update(unfilled)
        return None, set(done)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self._probe is not None:
            self._probe.close()
        if self._server is not None:
            self._server.stop()
