"""Security flags: TLS, bearer tokens, the internal credential, worker identity.

Each command that serves or calls takes its group here, and the `*_security` helpers are
the one place those flags become configuration (rpc.TLSConfig, auth.AuthConfig). With
none of them a process runs open, as on loopback, and logs that it does; deploy/ turns
them all on (docs/deploy.md, "Security").
"""

from __future__ import annotations

import argparse

from prefixgate.cli.flags import flag


def _server_tls_flags(p: argparse.ArgumentParser, what: str) -> None:
    flag(p, "--tls-cert", default="", help=f"PEM certificate (chain) of the {what}: serve TLS")
    flag(p, "--tls-key", default="", help="PEM private key of --tls-cert")
    flag(p, "--tls-client-ca", default="",
         help="PEM CA bundle: require client certificates that chain to it (mutual TLS)")
    flag(p, "--health-port", type=int, default=0,
         help="also serve the gRPC health service alone, in plain text, on this port (for "
              "Kubernetes gRPC probes, which cannot speak TLS; 0: off)")


def _internal_flag(p: argparse.ArgumentParser, worker: bool = False) -> None:
    flag(p, "--internal-token-file", default="",
         help="file holding the internal credential gateways send and workers require on "
              "every worker call (empty: the worker API is open)" + (
                  "; a worker's file may hold only its hash, 'sha256:<hex>', so that the "
                  "worker's files cannot call workers as a gateway" if worker else ""))


def _keyring_flag(p: argparse.ArgumentParser, who: str) -> None:
    flag(p, "--worker-keyring", default="",
         help=f"per-worker Ed25519 key lines (prefixgate token --worker-key ID); {who} "
              "(Redis registry only; see prefixgate/security/identity.py)")


def gateway_flags(g: argparse.ArgumentParser) -> None:
    _server_tls_flags(g, "Chat API")
    flag(g, "--tokens-file", default="",
         help="bearer tokens of the Chat API, one 'sha256:<hex> <namespace> [<label>]' per "
              "line (prefixgate token); each token is bound to its namespace (empty: open)")
    _internal_flag(g)
    flag(g, "--worker-tls-ca", default="",
         help="PEM CA that workers' certificates chain to: call workers over TLS")
    flag(g, "--worker-tls-cert", default="",
         help="PEM client certificate presented to workers (mutual TLS)")
    flag(g, "--worker-tls-key", default="", help="PEM private key of --worker-tls-cert")
    _keyring_flag(g, "the workers' public lines (and the '@gateways' line): workers must "
                     "sign their registration and ownership with their own key")


def worker_flags(w: argparse.ArgumentParser) -> None:
    _server_tls_flags(w, "worker API")
    _internal_flag(w, worker=True)
    flag(w, "--peer-tls-ca", default="",
         help="PEM CA that peer workers' certificates chain to: call peers (KV block "
              "pulls, drain hand-off) over TLS, each peer's certificate checked against "
              "its worker id (a DNS subject alternative name); while this worker's API is "
              "secured, peers are never called without it")
    flag(w, "--peer-tls-cert", default="",
         help="PEM client certificate presented to peers (mutual TLS; may be --tls-cert "
              "when it is also a client certificate naming this worker id)")
    flag(w, "--peer-tls-key", default="", help="PEM private key of --peer-tls-cert")
    flag(w, "--peer-token-file", default="",
         help="file holding the peer credential: sent to peers, and admitted from them for "
              "block pulls only (ExportBlocks; the drain hand-off's GetStatus and "
              "PullBlocks of the caller's own blocks), never for Generate or the rest")
    _keyring_flag(w, "this worker's own private line only (it signs what it writes to "
                     "Redis with it), and the '@tickets' line: exports then need a "
                     "gateway's pull ticket")


def client_flags(c: argparse.ArgumentParser) -> None:
    flag(c, "--tls-ca", default="",
         help="PEM CA of the gateway's certificate: connect over TLS")
    flag(c, "--token-file", default="", help="file holding this client's bearer token")


def gateway_security(args: argparse.Namespace) -> dict:
    """GatewayConfig fields from the gateway's security flags ({} for `prefixgate up`,
    which serves on loopback and has none)."""
    from prefixgate.security.auth import AuthConfig
    from prefixgate.wire.rpc import TLSConfig

    if not hasattr(args, "tokens_file"):
        return {}
    return dict(
        tls=TLSConfig(args.tls_cert, args.tls_key, args.tls_client_ca),
        worker_tls=TLSConfig(args.worker_tls_cert, args.worker_tls_key, args.worker_tls_ca),
        health_port=args.health_port,
        auth=AuthConfig(tokens_file=args.tokens_file,
                        internal_token_file=args.internal_token_file,
                        worker_keyring_file=args.worker_keyring))


def worker_security(args: argparse.Namespace) -> dict:
    """WorkerConfig fields from the worker's security flags."""
    from prefixgate.security.auth import AuthConfig
    from prefixgate.wire.rpc import TLSConfig

    return dict(tls=TLSConfig(args.tls_cert, args.tls_key, args.tls_client_ca),
                peer_tls=TLSConfig(args.peer_tls_cert, args.peer_tls_key, args.peer_tls_ca),
                health_port=args.health_port,
                auth=AuthConfig(internal_token_file=args.internal_token_file,
                                peer_token_file=args.peer_token_file,
                                worker_keyring_file=args.worker_keyring))


def client_security(args: argparse.Namespace) -> dict:
    """ChatClient keyword arguments from the client flags."""
    from pathlib import Path

    from prefixgate.wire.rpc import TLSConfig

    return dict(tls=TLSConfig(ca_file=args.tls_ca) if args.tls_ca else None,
                token=Path(args.token_file).read_text().strip() if args.token_file else "")
