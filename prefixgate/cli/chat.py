"""`prefixgate chat`: an interactive multi-turn chat client of a gateway (gRPC, or its
OpenAI-compatible HTTP API with `--http URL`: wire/openai_client.py).

`converse` holds a conversation (given messages or stdin lines) and prints each reply and
its figures (`figures`); `prefixgate up --demo` uses it too. `run` exits 1 when a turn
failed (the error is printed in place of its reply), 0 when every turn was answered; a
gateway that does not answer because it speaks TLS the client was not told of is named as
such (`speaks_tls`), not as absent.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from prefixgate.cli import security
from prefixgate.cli.common import log_flags, quiet_http_client_logs
from prefixgate.cli.flags import flag, own_variables

HELP = "interactive multi-turn chat client"
DESCRIPTION = ("Chat with a prefixgate gateway. Type a message and press Enter; /reset starts "
               "a new conversation, /quit ends.")


def add_arguments(c: argparse.ArgumentParser) -> None:
    own_variables(c, "chat")  # PREFIXGATE_CHAT_*: never a serving variable
    log_flags(c)
    flag(c, "--address", default="127.0.0.1:50051", help="gateway host:port")
    flag(c, "--http", default="",
         help="talk to this OpenAI-compatible API instead (http[s]://host:port[/v1]; a "
              "gateway's --http-port, or any OpenAI-compatible server)")
    security.client_flags(c)
    flag(c, "--message", action="append", comma_separated=False,
         help="send these messages as successive turns instead of reading stdin")
    flag(c, "--system", default="", help="system prompt")
    flag(c, "--conversation-id", default="", help="conversation id (default: a new one)")
    flag(c, "--namespace", default="", help="cache namespace (tenant)")
    flag(c, "--max-tokens", type=int, default=None, help="max tokens per reply (default: 256)")
    flag(c, "--temperature", type=float, default=None,
         help="0 is greedy (default: the model's, from its generation_config; else greedy)")
    flag(c, "--top-p", type=float, default=None,
         help="nucleus sampling mass (0: off; default: the model's, else off)")
    flag(c, "--top-k", type=int, default=None,
         help="top-k sampling (0: off; default: the model's, else off)")
    flag(c, "--seed", type=int, default=None, help="sampling seed")
    from prefixgate.wire.protocol import OVERFLOW_FROM_PROTO, SHIFTED_REUSE_FROM_PROTO

    # Not given: the request leaves the choice to the gateway and worker (their flags).
    flag(c, "--context-overflow", default="",
         choices=[n for n in OVERFLOW_FROM_PROTO.values() if n],
         help="when the conversation outgrows the context: fail, or drop its oldest turns "
              "(default: the gateway's --context-overflow)")
    flag(c, "--shifted-reuse", default="",
         choices=[n for n in SHIFTED_REUSE_FROM_PROTO.values() if n],
         help="how a turn that dropped turns reuses the cache (default: the worker's "
              "--shifted-reuse)")
    flag(c, "--timeout", type=float, default=300.0, help="deadline per turn in seconds")


def figures(r) -> str:
    """One line of a turn's figures: worker, prompt/cached tokens, TTFT, rate, finish."""
    rate = r.completion_tokens / (r.total_ms / 1e3) if r.total_ms else 0.0
    dropped = f" | dropped {r.dropped_tokens} tok" if r.dropped_tokens else ""
    return (f"[worker {r.worker_id} | prompt {r.prompt_tokens} tok | cached {r.cached_tokens} "
            f"tok{dropped} | ttft {r.ttft_ms:.0f} ms | {r.completion_tokens} tok in "
            f"{r.total_ms / 1e3:.2f} s ({rate:.1f} tok/s) | {r.finish_reason}]")


async def converse(client, messages: Sequence[str] | None, conversation_id: str, system: str,
                   sampling_kwargs: dict, namespace: str = "", timeout_s: float = 300.0
                   ) -> tuple[list, int]:
    """Hold a conversation: the given messages, or lines from stdin when None. Returns
    the answered turns' results and the number of turns that failed (given messages stop
    at the first; from stdin the user may go on)."""
    import uuid

    import grpc

    from prefixgate.v1 import common_pb2
    from prefixgate.wire.openai_client import HTTPTurnError

    conversation_id = conversation_id or uuid.uuid4().hex[:12]
    history: list[tuple[str, str]] = [("system", system)] if system else []
    sampling = common_pb2.SamplingParams(**{k: v for k, v in sampling_kwargs.items()
                                            if v is not None})
    results = []
    failed = 0
    lines = iter(messages) if messages is not None else None
    while True:
        if lines is not None:
            text = next(lines, None)
            if text is None:
                break
            print(f"you> {text}", flush=True)
        else:
            try:
                text = input("you> ")
            except EOFError:
                break
        if text.strip() == "/quit":
            break
        if text.strip() == "/reset":
            history = [("system", system)] if system else []
            conversation_id = uuid.uuid4().hex[:12]
            continue
        if not text.strip():
            continue
        history.append(("user", text))
        print("assistant> ", end="", flush=True)
        try:
            r = await client.turn(history, conversation_id=conversation_id, namespace=namespace,
                                  sampling=sampling, timeout_s=timeout_s,
                                  on_text=lambda t: print(t, end="", flush=True))
        except (grpc.aio.AioRpcError, HTTPTurnError) as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}" if isinstance(
                exc, grpc.aio.AioRpcError) else f"\nerror: HTTP {exc}", flush=True)
            history.pop()
            failed += 1
            if lines is not None:
                break
            continue
        print("\n" + figures(r), flush=True)
        history.append(("assistant", r.text))
        results.append(r)
    return results, failed


def overflow_params(args: argparse.Namespace) -> dict:
    """SamplingParams fields for --context-overflow / --shifted-reuse (enum values)."""
    from prefixgate.wire.protocol import OVERFLOW_FROM_PROTO, SHIFTED_REUSE_FROM_PROTO

    by_name = lambda table, name: next(k for k, v in table.items() if v == name)  # noqa: E731
    return {"context_overflow": by_name(OVERFLOW_FROM_PROTO, args.context_overflow),
            "shifted_reuse": by_name(SHIFTED_REUSE_FROM_PROTO, args.shifted_reuse)}


def speaks_tls(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """Whether a TLS handshake (any certificate, ALPN h2 as gRPC's) completes at
    host:port: a server that does not answer a plaintext client may be one that wants
    TLS."""
    import socket
    import ssl

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2", "http/1.1"])
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=host) as tls:
            tls.do_handshake()
            return True
    except (OSError, ValueError):  # ssl.SSLError is an OSError
        return False


def _not_answering(args: argparse.Namespace, where: str) -> str:
    """Why `where` did not answer: TLS the client did not use or trust, or nothing there."""
    from urllib.parse import urlsplit

    url = urlsplit(args.http if "://" in args.http else f"//{args.http or args.address}")
    port = url.port or (443 if url.scheme == "https" else 80)
    if url.hostname and speaks_tls(url.hostname, port):
        if not args.tls_ca:
            scheme = "use an https:// URL and " if args.http and url.scheme != "https" else ""
            return (f"{where} speaks TLS: {scheme}pass the gateway's CA certificate with "
                    "--tls-ca (prefixgate up --secure prints its path)")
        return (f"{where} speaks TLS but no connection was made with --tls-ca "
                f"{args.tls_ca}: is it the CA that signed the gateway's certificate, and "
                "does the certificate name this host?")
    return f"no gateway answers at {where}"


def run(args: argparse.Namespace) -> int:
    quiet_http_client_logs()  # a request line would land in the middle of a reply
    return asyncio.run(_chat(args))


async def _chat(args: argparse.Namespace) -> int:
    from prefixgate.wire.client import ChatClient
    from prefixgate.wire.openai_client import HTTPTurnError, OpenAIChatClient

    where = args.http or args.address
    client = (OpenAIChatClient(args.http, **security.client_security(args)) if args.http
              else ChatClient(args.address, **security.client_security(args)))
    try:
        try:
            await client.wait_ready(10)
        except TimeoutError:
            raise SystemExit("prefixgate chat: " + await asyncio.to_thread(
                _not_answering, args, where)) from None
        except HTTPTurnError as exc:
            raise SystemExit(f"prefixgate chat: {where} refused: HTTP {exc}") from None
        _, failed = await converse(
            client, args.message or None, args.conversation_id, args.system,
            {"max_tokens": args.max_tokens, "temperature": args.temperature,
             "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
             **overflow_params(args)},
            namespace=args.namespace, timeout_s=args.timeout)
    finally:
        await client.close()
    return 1 if failed else 0
