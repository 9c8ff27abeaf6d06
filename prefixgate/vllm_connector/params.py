"""What a prefixgate request tells the connector inside vLLM (torch-free).

Contract
--------
`TransferParams` travels in a completion request's `kv_transfer_params` under the key
`KEY` (vLLM hands that dict to the connector as `Request.kv_transfer_params`, as it does
for LMCache's and NIXL's per-request parameters):
  - `block_size` (tokens) and `fingerprint`: the prefixgate block size and model
    fingerprint the hashes were made with (what the wire's KVBlocksHeader must say);
  - `block_hashes`: the prompt's full prefixgate blocks, chained
    (`prefixgate.radix.BlockHasher`, salted with model and namespace): the keys under which
    the connector keeps what vLLM computes for this prompt, and the chain it pulls;
  - `pull` (optional): the holder to pull the prompt's leading `num_blocks` blocks from
    (`peer`: the host:port of its ExportBlocks), and the gateway's pull ticket, passed on
    unchanged in ExportBlocksRequest.ticket.
  - `shift` (optional, `ShiftParams`): the prompt is an overflowing conversation whose
    oldest turns were dropped (model/overflow.py); its kept run may be loaded, moved back,
    from an earlier layout of the conversation that this server's host store keeps:
    `n_keep` preamble tokens sit at the same positions in every layout (moved by 0), and
    each of `layouts` is (`delta`, `chain`): the prefixgate block hashes of an earlier
    layout (preamble, then the prompt as sent from an earlier turn start), where the new
    prompt's token p >= n_keep sat at p + delta. Keys are rotated back by delta on load
    (vllm_connector/shift.py); values are copied.
`to_json`/`from_json` are the JSON form; `from_json` returns None for a request without
them or with malformed ones (that request then moves nothing: vLLM computes as usual).

`connector_config(...)` is the `--kv-transfer-config` document that loads the connector
(`launch/vllm.py` and the README's `vllm serve` line use it).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

__all__ = ["CLASS", "KEY", "MODULE", "PullParams", "ShiftParams", "TransferParams",
           "connector_config"]

KEY = "prefixgate"
MODULE = "prefixgate.vllm_connector.connector"
CLASS = "PrefixgateConnector"
DEFAULT_STORE_MIB = 1024


@dataclass(frozen=True)
class PullParams:
    peer: str  # host:port of the holder's ExportBlocks (WorkerService)
    peer_worker_id: str
    num_blocks: int  # the prompt's leading prefixgate blocks the holder has
    ticket: bytes = b""


@dataclass(frozen=True)
class ShiftParams:
    """Where the kept run of an overflowing prompt may be cached (see the module)."""

    n_keep: int  # preamble tokens: at the same positions in every layout
    layouts: tuple[tuple[int, tuple[int, ...]], ...]  # (delta in positions, chain)

    def to_json(self) -> dict:
        return {"n_keep": self.n_keep,
                "layouts": [{"delta": d, "chain": list(c)} for d, c in self.layouts]}

    @classmethod
    def from_json(cls, doc: dict) -> ShiftParams:
        """KeyError / TypeError / ValueError when malformed."""
        layouts = tuple((int(x["delta"]), tuple(int(h) for h in x["chain"]))
                        for x in doc["layouts"])
        out = cls(int(doc["n_keep"]), layouts)
        if out.n_keep < 0 or any(d < 0 or not all(0 <= h < 1 << 64 for h in c)
                                 for d, c in layouts):
            raise ValueError("negative n_keep or delta, or a hash out of range")
        return out


@dataclass(frozen=True)
class TransferParams:
    block_size: int
    fingerprint: str
    block_hashes: tuple[int, ...]
    pull: PullParams | None = None
    shift: ShiftParams | None = None

    def to_json(self) -> dict:
        doc: dict = {"block_size": self.block_size, "fingerprint": self.fingerprint,
                     "block_hashes": list(self.block_hashes)}
        if self.pull is not None:
            doc["pull"] = {"peer": self.pull.peer, "peer_worker_id": self.pull.peer_worker_id,
                           "num_blocks": self.pull.num_blocks,
                           "ticket": base64.b64encode(self.pull.ticket).decode()}
        if self.shift is not None:
            doc["shift"] = self.shift.to_json()
        return {KEY: doc}

    @classmethod
    def from_json(cls, kv_transfer_params: dict | None) -> TransferParams | None:
        doc = (kv_transfer_params or {}).get(KEY) if isinstance(kv_transfer_params, dict) \
            else None
        if not isinstance(doc, dict):
            return None
        try:
            pull = None
            if isinstance(doc.get("pull"), dict):
                p = doc["pull"]
                pull = PullParams(str(p["peer"]), str(p.get("peer_worker_id", "")),
                                  int(p["num_blocks"]),
                                  base64.b64decode(p.get("ticket", "") or ""))
            shift = ShiftParams.from_json(doc["shift"]) if isinstance(doc.get("shift"), dict) \
                else None
            params = cls(int(doc["block_size"]), str(doc["fingerprint"]),
                         tuple(int(h) for h in doc["block_hashes"]), pull, shift)
        except (KeyError, TypeError, ValueError):
            return None
        if params.block_size <= 0 or any(not 0 <= h < 1 << 64 for h in params.block_hashes):
            return None
        return params


def connector_config(export_port: int, export_host: str = "127.0.0.1",
                     store_mib: int = DEFAULT_STORE_MIB, worker_id: str = "",
                     keyring: str = "", tls_cert: str = "", tls_key: str = "",
                     tls_ca: str = "") -> str:
    """vLLM's `--kv-transfer-config` JSON loading the connector: its ExportBlocks on
    `export_host:export_port` (loopback unless asked), a host store of `store_mib` MiB, as
    worker `worker_id` (the id the gateway knows the server by: the holder its pull
    tickets name; "": `vllm-HOST:PORT` of the export), checking pull tickets with the
    `@tickets` line of the keyring file `keyring` ("": not checked), and, with `tls_cert`,
    `tls_key` and `tls_ca` (PEM files), its export served and its pulls made over mutual
    TLS (vllm_connector/export.py `ExportTLS`). Paths, never a key."""
    extra: dict = {"export_host": export_host, "export_port": export_port,
                   "store_mib": store_mib}
    if worker_id:
        extra["worker_id"] = worker_id
    if keyring:
        extra["keyring"] = keyring
    for name, path in (("tls_cert", tls_cert), ("tls_key", tls_key), ("tls_ca", tls_ca)):
        if path:
            extra[name] = path
    return json.dumps({
        "kv_connector": CLASS, "kv_connector_module_path": MODULE, "kv_role": "kv_both",
        # A load that fails (holder gone, blocks evicted there) is computed instead; vLLM's
        # default, "fail", would fail the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra})
