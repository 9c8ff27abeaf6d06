"""Who may call prefixgate, and as which tenant (torch-free, transport-independent).

Contract
--------
Public API (ChatService over gRPC, the OpenAI-compatible HTTP front): a client sends
`Authorization: Bearer <token>` (gRPC metadata key `authorization`). `TokenStore`
maps tokens to a `Tenant`; it holds only SHA-256 digests of the tokens (tokens are
random, 256 bits from `new_token()`, so a fast hash is enough: there is nothing to guess).

  TokenStore.authenticate(authorization) -> Tenant
      raises Unauthenticated (no header, not "Bearer", unknown token).
  bind_namespace(tenant, requested) -> str
      the cache namespace the request runs in. The mapping: a token is bound to exactly
      one namespace. A request that names no namespace runs in its token's; a request
      that names another tenant's namespace is refused with PermissionDenied (never
      silently rewritten: a client that means another namespace learns at once that it
      cannot have it). With no TokenStore (open mode) the request's namespace is used
      as is.

Token file (`--tokens-file`), one token per line, `#` comments:

    sha256:<64 hex digits of SHA-256(token)>  <namespace>  [<label>]

`prefixgate token --namespace acme` prints a new token and its line. A tenant may have
several lines (rotation: add the new token, move clients, delete the old line).

Internal API (WorkerService, gateway -> worker): `InternalCredential` is one shared
secret (`--internal-token-file`, the file holds the token) that gateways send as a bearer
token on every worker call and workers require on every WorkerService method. A worker
only checks it, so its file may hold just the token's hash (`sha256:<hex>`, what
`hash_token` prints): then a worker pod's files do not let their holder call other
workers as a gateway. The gRPC health and reflection services stay open (probes).

Peer API (worker -> worker): the peer credential (`--peer-token-file`, another shared
secret) is what workers send to each other; `worker_guard` admits it for PEER_METHODS
only: ExportBlocks (block pulls, each also needing a pull ticket: security/tickets.py),
and for the drain hand-off GetStatus and PullBlocks (the latter only when the caller's
certificate names the holder it asks the worker to pull from: workerapi/server.py). Every
other method (Generate, FlushCache, the event streams) answers PERMISSION_DENIED to it.

Errors carry a message a caller can act on; transports map `Unauthenticated` to gRPC
UNAUTHENTICATED / HTTP 401 and `PermissionDenied` to PERMISSION_DENIED / HTTP 403
(`rpc.add_service(..., guard=...)` does it for gRPC).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# The refusals are part of the wire contract (each has its status code there); raised here.
from prefixgate.wire.protocol import AuthError as AuthError
from prefixgate.wire.protocol import PermissionDenied as PermissionDenied
from prefixgate.wire.protocol import Unauthenticated as Unauthenticated

log = logging.getLogger(__name__)

TOKEN_PREFIX = "pg_"
_HASH_PREFIX = "sha256:"


@dataclass(frozen=True)
class Tenant:
    namespace: str  # the cache namespace this tenant's requests run in
    label: str = ""  # for logs (never the token)


@dataclass(frozen=True)
class AuthConfig:
    """Paths of the credentials a process reads at start ("" = that check is off)."""

    tokens_file: str = ""  # gateway: public API tokens (TokenStore)
    internal_token_file: str = ""  # gateway sends, worker requires (InternalCredential)
    peer_token_file: str = ""  # worker sends to peers, peers admit for PEER_METHODS
    worker_keyring_file: str = ""  # worker identity keys (prefixgate.security.identity)


def new_token() -> str:
    """A fresh random bearer token (256 bits)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """The form a token file stores: "sha256:<hex>"."""
    return _HASH_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def bearer(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` value; Unauthenticated otherwise."""
    if not authorization:
        raise Unauthenticated(
            "this server requires a bearer token: send the metadata/header "
            "'authorization: Bearer <token>' (prefixgate chat --token-file FILE)")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("the authorization value must be 'Bearer <token>'")
    return token.strip()


def credential_lines(text: str, source: str) -> Iterator[tuple[str, list[str]]]:
    """("file:line", whitespace-separated fields) of each line of a credential file (token
    file, keyring) that is not empty once `#` comments are dropped."""
    for lineno, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if fields:
            yield f"{source}:{lineno}", fields


def metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    """The first value of `key` in gRPC metadata (keys are lower case)."""
    for k, v in metadata or ():
        if k == key:
            return v.decode(errors="replace") if isinstance(v, bytes) else v
    return None


class TokenStore:
    """Public API tokens (stored hashed) -> tenants."""

    def __init__(self, tenants_by_hash: dict[str, Tenant]) -> None:
        self._tenants = dict(tenants_by_hash)

    def __len__(self) -> int:
        return len(self._tenants)

    @classmethod
    def parse(cls, text: str, source: str = "<tokens>") -> TokenStore:
        tenants: dict[str, Tenant] = {}
        for where, fields in credential_lines(text, source):
            if len(fields) not in (2, 3):
                raise ValueError(f"{where}: expected 'sha256:<hex> <namespace> [<label>]'")
            digest, namespace = fields[0], fields[1]
            hexpart = digest[len(_HASH_PREFIX):]
            if (not digest.startswith(_HASH_PREFIX) or len(hexpart) != 64
                    or any(c not in "0123456789abcdef" for c in hexpart)):
                raise ValueError(f"{where}: the first field must be sha256:<64 lower-case hex "
                                 "digits> (the hash of the token, never the token itself; "
                                 "`prefixgate token` prints the line)")
            if digest in tenants:
                raise ValueError(f"{where}: the same token is listed twice")
            tenants[digest] = Tenant(namespace, fields[2] if len(fields) == 3 else namespace)
        if not tenants:
            raise ValueError(f"{source}: no tokens (an empty token file would lock everyone out)")
        return cls(tenants)

    @classmethod
    def from_file(cls, path: str | Path) -> TokenStore:
        return cls.parse(Path(path).read_text(), str(path))

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an Authorization value; Unauthenticated when unknown."""
        tenant = self._tenants.get(hash_token(bearer(authorization)))
        if tenant is None:
            raise Unauthenticated("the bearer token is not valid here: check the token, or ask "
                                  "the operator for one (tokens are listed in --tokens-file)")
        return tenant


def bind_namespace(tenant: Tenant | None, requested: str) -> str:
    """The namespace a request runs in (see the module docstring for the mapping)."""
    if tenant is None or requested == tenant.namespace:
        return requested
    if not requested:
        return tenant.namespace
    raise PermissionDenied(
        f"namespace {requested[:64]!r} is not this token's: the token is bound to namespace "
        f"{tenant.namespace!r}; leave namespace empty or set it to that value")


class InternalCredential:
    """The shared secret of the internal (worker) API: the token (sends and checks) or
    only its hash, "sha256:<hex>" (checks only: `can_send` is False)."""

    def __init__(self, token: str) -> None:
        if token.startswith(_HASH_PREFIX):
            hexpart = token[len(_HASH_PREFIX):]
            if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
                raise ValueError("a hashed credential is sha256:<64 lower-case hex digits>")
            self._token = ""
            self._digest = bytes.fromhex(hexpart)
            return
        if len(token) < 16:
            raise ValueError("the internal token must be at least 16 characters "
                             "(`prefixgate token` prints a good one)")
        self._token = token
        self._digest = hashlib.sha256(token.encode()).digest()

    @classmethod
    def from_file(cls, path: str | Path) -> InternalCredential:
        return cls(Path(path).read_text().strip())

    @property
    def can_send(self) -> bool:
        """Whether the token itself is held (not only its hash)."""
        return bool(self._token)

    @property
    def metadata(self) -> tuple[tuple[str, str]]:
        """gRPC call metadata that carries this credential."""
        if not self._token:
            raise ValueError("this credential is only a hash: it can check, not be sent")
        return (("authorization", f"Bearer {self._token}"),)

    def matches(self, authorization: str | None) -> bool:
        """Whether `authorization` carries this credential (never raises)."""
        try:
            token = bearer(authorization)
        except Unauthenticated:
            return False
        return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    def check(self, authorization: str | None) -> None:
        """Raises Unauthenticated unless `authorization` carries this credential."""
        if authorization is None:
            raise Unauthenticated(
                "the worker API requires the internal credential: only gateways started with "
                "the same --internal-token-file may call it")
        token = bearer(authorization)
        if not hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest):
            raise Unauthenticated("wrong internal credential: the caller's "
                                  "--internal-token-file differs from this worker's")


Metadata = Iterable[tuple[str, "str | bytes"]]


def tokens_guard(store: TokenStore) -> Callable[[str, Metadata], Tenant]:
    """An `rpc.add_service` guard: every call needs a token of `store`."""
    return lambda _method, metadata: store.authenticate(metadata_value(metadata, "authorization"))


def internal_guard(credential: InternalCredential) -> Callable[[str, Metadata], None]:
    """An `rpc.add_service` guard: every call needs the internal credential."""
    return lambda _method, metadata: credential.check(metadata_value(metadata, "authorization"))


# What the peer credential admits (the module docstring): block pulls, and the drain
# hand-off's status read and pull request.
PEER_METHODS = frozenset({"ExportBlocks", "GetStatus", "PullBlocks"})
PEER = "peer"  # what `worker_guard` returns for a call with the peer credential


def worker_guard(internal: InternalCredential | None, peer: InternalCredential | None
                 ) -> Callable[[str, Metadata], str | None]:
    """An `rpc.add_service` guard for WorkerService: the internal credential admits every
    method, the peer credential only PEER_METHODS (PERMISSION_DENIED for the others).
    Returns PEER for a call admitted by the peer credential, else None. With neither
    credential configured, every call is admitted."""
    def guard(method: str, metadata: Metadata) -> str | None:
        authorization = metadata_value(metadata, "authorization")
        if internal is None and peer is None:
            return None
        if internal is not None and internal.matches(authorization):
            return None
        if peer is not None and peer.matches(authorization):
            if method in PEER_METHODS:
                return PEER
            raise PermissionDenied(
                f"the peer credential is good for block pulls only ({', '.join(sorted(PEER_METHODS))}), "
                f"not {method}: only gateways (the internal credential) may call it")
        if internal is not None:
            internal.check(authorization)  # raises with the internal credential's message
        raise Unauthenticated("wrong peer credential: the caller's --peer-token-file differs "
                              "from this worker's")
    return guard


def load_tokens(config: AuthConfig, what: str) -> TokenStore | None:
    """The TokenStore of `config`, or None (open) with a warning naming `what`."""
    if config.tokens_file:
        store = TokenStore.from_file(config.tokens_file)
        log.info("%s: bearer tokens required (%d tokens from %s)", what, len(store),
                 config.tokens_file)
        return store
    log.warning("%s: no --tokens-file: the API is OPEN (any client may use any namespace); "
                "fine on loopback, never on a network", what)
    return None


def load_peer(config: AuthConfig) -> InternalCredential | None:
    """The peer credential of `config` (`--peer-token-file`), or None."""
    if not config.peer_token_file:
        return None
    credential = InternalCredential.from_file(config.peer_token_file)
    if not credential.can_send:
        raise ValueError(f"{config.peer_token_file}: the peer credential is sent to peers: "
                         "the file must hold the token, not its hash")
    return credential


def load_internal(config: AuthConfig, what: str) -> InternalCredential | None:
    """The InternalCredential of `config`, or None (open) with a warning naming `what`."""
    if config.internal_token_file:
        return InternalCredential.from_file(config.internal_token_file)
    log.warning("%s: no --internal-token-file: the worker API is OPEN to anyone who can "
                "reach it; fine on loopback, never on a network", what)
    return None
