"""Lesson 11 exercise: capacity and cost arithmetic, the way the simulator does it.

Fill in every body, then run `tinyinfer lesson check 11`.
"""

from __future__ import annotations


def flops_per_token(active_parameters: int) -> float:
    """FLOPs to compute one token: one multiply and one add per parameter the token uses."""
    raise NotImplementedError


def max_concurrent(memory_bytes: float, memory_utilization: float, weight_bytes: float,
                   kv_bytes_per_token: float, tokens_per_sequence: int) -> int:
    """How many sequences' KV caches fit beside the weights (0 if the weights do not fit).

    Usable memory is memory_bytes * memory_utilization (the rest goes to activations and
    workspace); what the weights leave is divided into whole sequences of tokens_per_sequence.
    """
    raise NotImplementedError


def users_served(per_user_tokens_per_second: dict[int, float], max_concurrent: int,
                 min_tokens_per_second: float) -> int:
    """The largest batch (concurrent users) that fits in memory and gives each user at least
    min_tokens_per_second; 0 if no batch does. Keys are batch sizes, values each user's speed.
    """
    raise NotImplementedError


def cost_per_million_tokens(price_per_hour: float, seconds: float, tokens: float,
                            utilization: float) -> float:
    """Dollars per million tokens when a GPU rented at price_per_hour processes tokens in seconds.

    Only a share `utilization` of the paid hours does work, so each token also pays for idle time.
    """
    raise NotImplementedError


def breakeven_utilization(cost_per_million_at_full_use: float, api_price_per_million: float) -> float:
    """The utilization above which self-hosting costs less per token than the API."""
    raise NotImplementedError
