"""Lesson 11 solution (for teachers): capacity and cost arithmetic."""

from __future__ import annotations

import math


def flops_per_token(active_parameters: int) -> float:
    """FLOPs to compute one token: one multiply and one add per parameter the token uses."""
    return 2.0 * active_parameters


def max_concurrent(memory_bytes: float, memory_utilization: float, weight_bytes: float,
                   kv_bytes_per_token: float, tokens_per_sequence: int) -> int:
    """How many sequences' KV caches fit beside the weights."""
    room = memory_bytes * memory_utilization - weight_bytes
    return max(0, math.floor(room / (kv_bytes_per_token * tokens_per_sequence)))


def users_served(per_user_tokens_per_second: dict[int, float], max_concurrent: int,
                 min_tokens_per_second: float) -> int:
    """The largest batch that fits and keeps every user at or above the speed floor."""
    ok = [b for b, speed in per_user_tokens_per_second.items()
          if b <= max_concurrent and speed >= min_tokens_per_second]
    return max(ok, default=0)


def cost_per_million_tokens(price_per_hour: float, seconds: float, tokens: float,
                            utilization: float) -> float:
    """Dollars per million tokens, paying for idle hours too."""
    return price_per_hour / 3600 * seconds / (tokens * utilization) * 1e6


def breakeven_utilization(cost_per_million_at_full_use: float, api_price_per_million: float) -> float:
    """The utilization above which self-hosting costs less per token than the API."""
    return cost_per_million_at_full_use / api_price_per_million
