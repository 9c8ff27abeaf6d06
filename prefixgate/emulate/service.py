"""The service-time model of an emulated worker, shared by the emulated engine, the
emulated fleet, the routing simulator and their flags (one set of defaults).

Contract: `ServiceModel(prefill_tokens_per_s, decode_s_per_token)`: a prefill of N
uncached tokens takes N / prefill_tokens_per_s seconds (one prefill at a time per
worker); each output token after the first takes decode_s_per_token seconds (decoding is
batched: sequences decode side by side). Units: tokens, seconds (emulated).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_KV_BYTES_PER_TOKEN", "DEFAULT_TRANSFER_BYTES_PER_S", "ServiceModel"]

# What block transfer stands for by default: 100 Gb/s between GPUs (12.5 GB/s) and an 8B
# model's KV (Llama-3-8B: 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes (bf16)
# = 131,072 bytes per token), the model the default prefill rate (20k tokens/s) stands for:
# 95k tokens/s over the link, 4.8x the prefill rate.
DEFAULT_TRANSFER_BYTES_PER_S = 12.5e9
DEFAULT_KV_BYTES_PER_TOKEN = 131_072


@dataclass(frozen=True)
class ServiceModel:
    # An 8B model on one accelerator (the model DEFAULT_KV_BYTES_PER_TOKEN stands for).
    prefill_tokens_per_s: float = 20_000.0
    decode_s_per_token: float = 0.030

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_s_per_token < 0:
            raise ValueError("prefill_tokens_per_s must be > 0 and decode_s_per_token >= 0")

    def prefill_s(self, num_tokens: int) -> float:
        """Seconds to prefill `num_tokens` uncached tokens."""
        return num_tokens / self.prefill_tokens_per_s

    def decode_s(self, num_tokens: int) -> float:
        """Seconds to decode `num_tokens` output tokens after the first."""
        return num_tokens * self.decode_s_per_token
