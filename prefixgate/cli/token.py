"""`prefixgate token`: new credentials for the trust model (prefixgate/security/auth.py,
prefixgate/security/identity.py)."""

from __future__ import annotations

import argparse

from prefixgate.cli.flags import flag

HELP = "print a new bearer token (and its --tokens-file line) or worker key"
DESCRIPTION = ("Print a new random bearer token. With --namespace, also the line to add "
               "to the gateway's --tokens-file (which holds only the token's hash). With "
               "--worker-key ID, a --worker-keyring line for that worker instead.")


def add_arguments(t: argparse.ArgumentParser) -> None:
    flag(t, "--namespace", default="",
         help="bind the token to this cache namespace (prints the token file line)")
    flag(t, "--label", default="", help="a label for logs, in the token file line")
    flag(t, "--worker-key", default="",
         help="print a --worker-keyring line for this worker id instead ('*': a master key "
              "every worker id derives its own from)")
    t.set_defaults(log_level="WARNING")


def run(args: argparse.Namespace) -> int:
    import secrets

    from prefixgate.security.auth import hash_token, new_token

    if any(c.isspace() or c == "#"
           for v in (args.namespace, args.label, args.worker_key) for c in v):
        raise SystemExit("prefixgate token: --namespace, --label and --worker-key must not "
                         "contain spaces or '#' (the files are split on whitespace, and "
                         "'#' starts a comment)")
    if args.worker_key:
        print(f"{args.worker_key} {secrets.token_hex(32)}")
        return 0
    token = new_token()
    print(token)
    if args.namespace:
        line = f"{hash_token(token)} {args.namespace}" + (f" {args.label}" if args.label else "")
        print(f"# add to --tokens-file; give the token above to the client only:\n{line}")
    return 0
