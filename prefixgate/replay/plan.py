"""What `prefixgate replay --simulate` and `--fleet` model: one plan for both, so the
simulator and the emulated fleet stand for the same workers and gateways.

Contract: `FleetPlan` (frozen; the replay command builds it from its flags) holds the
workers (capacity, block size, service model), the front ends (gateway counts, policies,
Redis, status interval), the fleet's clock (`time_scale`), how turns are sent
(conversation ids, turnaround) and where a fleet keeps its logs. `fleet_model(trace,
plan, max_tokens)` is the model such a fleet serves for `trace` (emulate/model.py: the
tokenizer model's tokenizer with a context for the trace, no weights) and its block
size; `status_interval_ms(time_scale)` the status interval its gateways get. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefixgate.emulate.service import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_TRANSFER_BYTES_PER_S,
    ServiceModel,
)
from prefixgate.replay.traces import Trace

CHAT_BLOCK_SIZE = 16

__all__ = ["CHAT_BLOCK_SIZE", "FleetPlan", "fleet_context_tokens", "fleet_model",
           "status_interval_ms"]


@dataclass(frozen=True)
class FleetPlan:
    trace_path: str = ""  # named in reports
    label: str = ""  # prefixes each run's label
    tokenizer_model: str = "smollm2-135m"  # whose tokenizer counts (and serves) the tokens
    cache_dir: Path | None = None
    block_size: int = 0  # tokens (0: the trace's, CHAT_BLOCK_SIZE for chat traces)
    capacity_tokens: int = 2_048_000  # per worker
    service: ServiceModel = ServiceModel()
    transfer_bytes_per_s: float = DEFAULT_TRANSFER_BYTES_PER_S  # each worker's KV link
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN  # (block transfer; 0: none)
    policies: tuple[str, ...] = ()  # gateway routing policies ("" : each mode's default)
    num_workers: int = 0  # --fleet: emulated workers
    worker_counts: tuple[int, ...] = ()  # --simulate: simulated worker counts (default 8)
    gateway_counts: tuple[int, ...] = (1,)  # one run per count
    redis: bool = False  # workers register in (and gateways follow) a private Redis
    time_scale: float = 1.0  # emulated seconds per wall second
    publish_at: str = "prefill"  # "prefill" | "finish" (emulate/engine.py)
    conversation_ids: bool = True  # False: turns carry no conversation id
    turnaround_s: tuple[float, ...] | None = None  # --simulate (None: the fleet's measured)
    gateway_args: tuple[str, ...] = ()  # --fleet: more flags for every gateway
    peer_router: tuple[str, ...] = ()  # --fleet: an HTTP router's command, run in place of
    peer_label: str = ""  # the gateways too, under this name
    logs_dir: str = ""  # --fleet: keep the processes' logs here ("" : a temporary dir)
    timeout_s: float = 300.0  # per turn
    progress: bool = True


def status_interval_ms(time_scale: float) -> int:
    """The status interval gateways get in a fleet running `time_scale` times faster: the
    deployed interval (GatewayConfig's) in emulated time, as far as the workers' floor
    (prefixgate/wire/status.py MIN_INTERVAL_S) allows (at 20x, 10 ms of wall time: 200 ms
    emulated instead of the 1 s the unscaled 50 ms would be). A wall-clock constant left
    unscaled would make load look 20 times staler than in the deployment the fleet stands
    for; `--gateway-args='--status-interval-ms N'` overrides."""
    from prefixgate.gateway.server import GatewayConfig
    from prefixgate.wire.status import MIN_INTERVAL_S

    return max(round(MIN_INTERVAL_S * 1e3),
               round(GatewayConfig.status_interval_ms / time_scale))


def fleet_context_tokens(trace: Trace, max_tokens: int) -> int:
    """The context the fleet's model gets: a power of two holding the trace's longest
    prompt and a reply (at least 16k; a chat prompt's UTF-8 bytes bound its tokens under a
    byte-level tokenizer, plus the template's few tokens per message)."""
    longest = max((t.num_prompt_tokens or sum(len(m.encode()) + 16 for _, m in c.messages(i))
                   for c in trace.conversations for i, t in enumerate(c.turns)), default=0)
    return 1 << max(14, (longest + max_tokens + 1).bit_length())


def fleet_model(trace: Trace, plan: FleetPlan, max_tokens: int):
    """(ModelSpec, block size) of the fleet `plan` brings up for `trace` (replies up to
    `max_tokens`)."""
    from prefixgate.emulate.model import emulation_model_dir
    from prefixgate.model.catalog import resolve_model

    block_size = plan.block_size or trace.block_size or CHAT_BLOCK_SIZE
    if trace.block_size and block_size != trace.block_size:
        raise SystemExit(f"prefixgate replay: {trace.kind} traces have blocks of "
                         f"{trace.block_size} tokens; --sim-block-size must be that or 0")
    model_dir = emulation_model_dir(plan.tokenizer_model,
                                    fleet_context_tokens(trace, max_tokens), plan.cache_dir)
    return resolve_model(str(model_dir), plan.cache_dir), block_size
