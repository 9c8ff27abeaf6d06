"""`prefixgate token`: new credentials for the trust model (prefixgate/security/auth.py,
prefixgate/security/identity.py)."""

from __future__ import annotations

import argparse

from prefixgate.cli.flags import flag, own_variables

HELP = "print a new bearer token (and its --tokens-file line) or worker key"
DESCRIPTION = ("Print a new random bearer token. With --namespace, also the line to add "
               "to the gateway's --tokens-file (which holds only the token's hash). With "
               "--worker-key ID, a new key for that worker instead: its private "
               "--worker-keyring line (the worker's only) and its public line (gateways'); "
               "with --gateway-key, the gateways' shared '@gateways' line.")


def add_arguments(t: argparse.ArgumentParser) -> None:
    own_variables(t, "token")  # PREFIXGATE_TOKEN_*: never a serving variable
    flag(t, "--namespace", default="",
         help="bind the token to this cache namespace (prints the token file line)")
    flag(t, "--label", default="", help="a label for logs, in the token file line")
    flag(t, "--worker-key", default="",
         help="print a new key's --worker-keyring lines for this worker id instead: the "
              "private line (for that worker only) and the public line (for gateways)")
    flag(t, "--gateway-key", action="store_true",
         help="print a new '@gateways' --worker-keyring line (for every gateway, never a "
              "worker: it signs routing predictions and reaps)")
    t.set_defaults(log_level="WARNING")


def run(args: argparse.Namespace) -> int:
    from prefixgate.security.auth import hash_token, new_token
    from prefixgate.security.identity import new_gateway_key, new_worker_key

    if any(c.isspace() or c == "#"
           for v in (args.namespace, args.label, args.worker_key) for c in v):
        raise SystemExit("prefixgate token: --namespace, --label and --worker-key must not "
                         "contain spaces or '#' (the files are split on whitespace, and "
                         "'#' starts a comment)")
    if args.worker_key:
        if args.worker_key.startswith("@"):
            raise SystemExit("prefixgate token: worker ids do not start with '@'")
        private, public = new_worker_key(args.worker_key)
        print(f"# worker {args.worker_key}'s --worker-keyring (this worker only):\n{private}\n"
              f"# add to the gateways' --worker-keyring:\n{public}")
        return 0
    if args.gateway_key:
        print(f"# add to every gateway's --worker-keyring (never a worker's):\n"
              f"{new_gateway_key()}")
        return 0
    token = new_token()
    print(token)
    if args.namespace:
        line = f"{hash_token(token)} {args.namespace}" + (f" {args.label}" if args.label else "")
        print(f"# add to --tokens-file; give the token above to the client only:\n{line}")
    return 0
