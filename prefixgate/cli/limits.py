"""Request-limit flags shared by `prefixgate gateway`, `worker` and `up`
(prefixgate.wire.protocol.RequestLimits; docs/reliability.md says what each bounds)."""

from __future__ import annotations

import argparse

from prefixgate.cli.flags import flag


def limit_flags(p: argparse.ArgumentParser) -> None:
    from prefixgate.wire.protocol import RequestLimits

    d = RequestLimits()
    g = p.add_argument_group("request limits (refused with INVALID_ARGUMENT or "
                             "RESOURCE_EXHAUSTED before any large allocation)")
    flag(g, "--max-request-bytes", type=int, default=d.max_request_bytes,
         help="largest serialized request accepted (gRPC max receive size)")
    flag(g, "--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
         help="most prompt tokens after tokenizing")
    flag(g, "--max-pending-calls", type=int, default=d.max_pending_calls,
         help="calls accepted but not yet served (a burst beyond is refused)")
    flag(g, "--max-id-chars", type=int, default=d.max_id_chars,
         help="longest conversation_id, namespace, request_id or model name")
    flag(g, "--max-messages", type=int, default=d.max_messages,
         help="most messages in one chat request")
    flag(g, "--max-stop", type=int, default=d.max_stop, help="most stop strings per request")
    flag(g, "--max-stop-chars", type=int, default=d.max_stop_chars,
         help="longest stop string")
    flag(g, "--max-stop-token-ids", type=int, default=d.max_stop_token_ids,
         help="most stop token ids per request")
    flag(g, "--tokenize-threads", type=int, default=d.tokenize_threads,
         help="gateway: threads tokenizing long prompts (each holds its prompt's encoding)")
    flag(g, "--max-tokenize-waiting", type=int, default=d.max_tokenize_waiting,
         help="gateway: long prompts waiting for a tokenizer thread; more are refused "
              "with RESOURCE_EXHAUSTED (HTTP 429)")
    flag(g, "--max-turns-per-tenant", type=int, default=d.max_turns_per_tenant,
         help="gateway: turns one tenant (namespace) may have in flight; more are refused "
              "with RESOURCE_EXHAUSTED (HTTP 429); 0: no bound")


def request_limits(args: argparse.Namespace):
    """The RequestLimits the parsed limit flags stand for (defaults where absent)."""
    from prefixgate.wire.protocol import RequestLimits

    d = RequestLimits()
    return RequestLimits(**{name: getattr(args, name, getattr(d, name))
                            for name in RequestLimits.__dataclass_fields__})
