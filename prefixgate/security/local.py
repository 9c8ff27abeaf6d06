"""Credentials for a secured prefixgate on one machine (`prefixgate up --secure`).

Contract
--------
`make_local_credentials(directory, worker_ids)` writes, into `directory` (created with
mode 0700, every file 0600; what was there before is replaced), fresh:

  ca.crt, ca.key          a CA (EC P-256), valid one year, trusted by every part
  server.crt/.key         the gateway's and the workers' certificate (127.0.0.1, localhost,
                          and each worker id: workers check a peer's certificate against
                          the worker id they call)
  client.crt/.key         the gateway's and the workers' client certificate (mutual TLS;
                          naming each worker id, the receivers of pull tickets)
  tokens, token           the gateway's --tokens-file (hash only) and its one client token,
                          bound to namespace "default" (the demo and `prefixgate chat`)
  internal-token          the internal credential gateways send and workers require
  gateway.keyring         every worker's Ed25519 public key and the gateways' key
  worker-<id>.keyring     each worker's own private key (prefixgate/security/identity.py)
                          and the gateways' pull-ticket key (public: security/tickets.py)

and returns their paths (`LocalCredentials`). Nothing here is for a network: the
certificates name loopback only, and the CA key stays in the directory.

`issue_worker(creds, worker_id)` adds, for a worker whose id is known only once it is
started (a vLLM server's `vllm-HOST:PORT`), the same directory's files of its own:

  worker-<id>.keyring     its own private key and the gateways' pull-ticket key (as above;
                          its public line is added to gateway.keyring)
  worker-<id>.crt/.key    a certificate from the CA for both ends of mutual TLS (server and
                          client), naming loopback, the worker id (what a holder matches a
                          pull ticket's receiver against) and `tls_name(worker_id)` (the
                          name a caller checks the worker's certificate against: a DNS
                          name, which a worker id with a ':' is not to gRPC's check)

and returns their paths (`WorkerFiles`).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from prefixgate.security.auth import hash_token, new_token
from prefixgate.security.identity import GATEWAYS, new_gateway_key, new_worker_key
from prefixgate.security.tickets import ticket_public_line

NAMESPACE = "default"  # the namespace the generated client token is bound to


@dataclass(frozen=True)
class LocalCredentials:
    directory: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    tokens: Path  # the gateway's --tokens-file
    token: Path  # the client's --token-file
    internal_token: Path
    gateway_keyring: Path

    def worker_keyring(self, worker_id: str) -> Path:
        return self.directory / f"worker-{worker_id}.keyring"


@dataclass(frozen=True)
class WorkerFiles:
    """One worker's own files (`issue_worker`): its keyring and its TLS certificate."""

    keyring: Path
    cert: Path
    key: Path
    ca: Path


def tls_name(worker_id: str) -> str:
    """The DNS name a worker's certificate carries for `worker_id`, which callers check it
    against: lower case, each character outside [a-z0-9.-] a '-' (`vllm-127.0.0.1:8001`
    -> `vllm-127.0.0.1-8001`: gRPC's host name check refuses a name with a ':')."""
    return re.sub(r"[^a-z0-9.-]", "-", worker_id.lower())


def _write(path: Path, data: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificate(subject: str, key, issuer: x509.Certificate | None, issuer_key,
                 usage: list | None, names: Sequence[str] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer.subject if issuer is not None else name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=365)))
    if usage is None:  # the CA
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), True)
    else:
        builder = (builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
                   .add_extension(x509.ExtendedKeyUsage(usage), False)
                   .add_extension(x509.SubjectAlternativeName(
                       [x509.DNSName("localhost"), *(x509.DNSName(n) for n in names),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False))
    return builder.sign(issuer_key if issuer_key is not None else key, hashes.SHA256())


def make_local_credentials(directory: str | Path,
                           worker_ids: Sequence[str]) -> LocalCredentials:
    """Write fresh credentials for a gateway and `worker_ids` (module docstring)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    pem = serialization.Encoding.PEM
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("prefixgate local CA", ca_key, None, None, None)
    _write(d / "ca.key", _pem_key(ca_key))
    paths = {"ca": _write(d / "ca.crt", ca.public_bytes(pem))}
    for role, usage in (("server", [ExtendedKeyUsageOID.SERVER_AUTH]),
                        ("client", [ExtendedKeyUsageOID.CLIENT_AUTH])):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(f"prefixgate local {role}", key, ca, ca_key, usage, worker_ids)
        paths[f"{role}_cert"] = _write(d / f"{role}.crt", cert.public_bytes(pem))
        paths[f"{role}_key"] = _write(d / f"{role}.key", _pem_key(key))
    token = new_token()
    paths["token"] = _write(d / "token", f"{token}\n".encode())
    paths["tokens"] = _write(d / "tokens", f"{hash_token(token)} {NAMESPACE} local\n".encode())
    paths["internal_token"] = _write(d / "internal-token", f"{new_token()}\n".encode())
    gateways = new_gateway_key()
    public = [gateways]
    tickets = ticket_public_line(bytes.fromhex(gateways.split(":", 1)[1]))
    creds = LocalCredentials(directory=d, gateway_keyring=d / "gateway.keyring", **paths)
    for wid in worker_ids:
        private, line = new_worker_key(wid)
        _write(creds.worker_keyring(wid), f"{private}\n{tickets}\n".encode())
        public.append(line)
    _write(creds.gateway_keyring, ("\n".join(public) + "\n").encode())
    return creds


def issue_worker(creds: LocalCredentials, worker_id: str) -> WorkerFiles:
    """Write worker `worker_id`'s own keyring and certificate (module docstring)."""
    d = creds.directory
    secret = next((line.split()[1].split(":", 1)[1] for line in
                   creds.gateway_keyring.read_text().splitlines()
                   if line.startswith(GATEWAYS + " ")), None)
    if secret is None:
        raise ValueError(f"{creds.gateway_keyring} has no '{GATEWAYS}' line")
    private, public = new_worker_key(worker_id)
    keyring = _write(creds.worker_keyring(worker_id),
                     f"{private}\n{ticket_public_line(bytes.fromhex(secret))}\n".encode())
    with open(creds.gateway_keyring, "a") as f:  # gateways verify what it signs
        f.write(public + "\n")
    pem = serialization.Encoding.PEM
    ca = x509.load_pem_x509_certificate(creds.ca.read_bytes())
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(f"prefixgate worker {worker_id}", key, ca, ca_key,
                        [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                        [worker_id, tls_name(worker_id)])
    base = f"worker-{tls_name(worker_id)}"
    return WorkerFiles(keyring, _write(d / f"{base}.crt", cert.public_bytes(pem)),
                       _write(d / f"{base}.key", _pem_key(key)), creds.ca)
