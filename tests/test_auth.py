"""prefixgate.security.auth: token files, namespace binding, the internal credential."""

from __future__ import annotations

import pytest

from prefixgate.security.auth import (
    InternalCredential,
    PermissionDenied,
    Tenant,
    TokenStore,
    Unauthenticated,
    bind_namespace,
    hash_token,
    new_token,
)


def _store(*pairs: tuple[str, str]) -> TokenStore:
    return TokenStore.parse("\n".join(f"{hash_token(t)} {ns}" for t, ns in pairs))


def test_tokens_map_to_their_namespace_and_are_stored_hashed() -> None:
    a, b = new_token(), new_token()
    text = f"# tenants\n{hash_token(a)} acme  acme-inc\n{hash_token(b)} globex\n"
    assert a not in text and b not in text
    store = TokenStore.parse(text)
    assert store.authenticate(f"Bearer {a}") == Tenant("acme", "acme-inc")
    assert store.authenticate(f"bearer  {b} ") == Tenant("globex", "globex")


@pytest.mark.parametrize("value", [None, "", "Basic abc", "Bearer ", "Bearer pg_nope"])
def test_missing_or_unknown_tokens_are_unauthenticated(value: str | None) -> None:
    with pytest.raises(Unauthenticated, match="token|Bearer"):
        _store((new_token(), "acme")).authenticate(value)


@pytest.mark.parametrize("text, match", [
    ("", "no tokens"),
    ("pg_plaintexttoken acme", "sha256"),
    ("sha256:" + "0" * 64, "expected"),
    (f"{hash_token('x')} a\n{hash_token('x')} b", "twice"),
])
def test_bad_token_files_are_refused_with_the_line(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TokenStore.parse(text)


def test_namespace_binding() -> None:
    acme = Tenant("acme")
    assert bind_namespace(acme, "") == "acme"
    assert bind_namespace(acme, "acme") == "acme"
    with pytest.raises(PermissionDenied, match="bound to namespace 'acme'"):
        bind_namespace(acme, "globex")
    assert bind_namespace(None, "anything") == "anything"  # open mode


def test_internal_credential() -> None:
    token = new_token()
    cred = InternalCredential(token)
    (key, value), = cred.metadata
    assert key == "authorization"
    cred.check(value)
    with pytest.raises(Unauthenticated, match="requires the internal credential"):
        cred.check(None)
    with pytest.raises(Unauthenticated, match="wrong internal credential"):
        cred.check(f"Bearer {new_token()}")
    with pytest.raises(ValueError, match="16"):
        InternalCredential("short")


@pytest.mark.parametrize("namespace", ["acme", "a#b", "a b", " acme"])
def test_printed_token_lines_parse_back_to_their_namespace_or_are_refused(
        namespace: str, capsys: pytest.CaptureFixture) -> None:
    """`prefixgate token --namespace NS`: the line it prints gives NS back when the gateway
    reads it, or the command refuses NS (the file splits on whitespace and '#')."""
    from argparse import Namespace

    from prefixgate.cli import token

    try:
        token.run(Namespace(namespace=namespace, label="", worker_key="", gateway_key=""))
    except SystemExit:
        assert namespace != "acme"
        return
    printed, _comment, line = capsys.readouterr().out.splitlines()
    assert TokenStore.parse(line).authenticate(f"Bearer {printed}").namespace == namespace
