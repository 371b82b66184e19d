"""Routing policies: ``prefix_hash`` (CHWBL on the prefix key, the default), ``least_load``, ``round_robin``,
``power_of_two``. Each implements ``radixserve.router.types.RoutingPolicy``."""

from __future__ import annotations

from radixserve.router.policy.chwbl import PrefixHashPolicy
from radixserve.router.policy.hot_prefix import HotPrefixTracker
from radixserve.router.policy.simple import IndexedPolicy, LeastLoadPolicy, PowerOfTwoPolicy, RoundRobinPolicy
from radixserve.router.types import RoutingPolicy

POLICIES = ("prefix_hash", "least_load", "round_robin", "power_of_two")


def make_policy(
    name: str,
    *,
    virtual_nodes: int = 256,
    load_factor: float = 1.25,
    capacity_blocks_per_worker: int = 65536,
    seed: int | None = None,
    balance_abs_tokens: int = 2048,
    cache_threshold: float = 0.5,
    hot_prefix_half_life_s: float = 0.0,
    prefix_blocks: int = 8,
) -> RoutingPolicy:
    """A new policy by name (one of ``POLICIES``). ``virtual_nodes``, ``load_factor``, ``balance_abs_tokens``
    (tokens of imbalance tolerated before the load bound applies), ``cache_threshold`` (the fraction of a prompt's
    blocks a worker must hold for cache affinity), ``hot_prefix_half_life_s`` (hot-prefix replication's demand
    half-life in seconds, 0 = off; ``hot_prefix.py``) and ``prefix_blocks`` (K of the routing key) are
    ``prefix_hash``'s;
    ``seed`` is ``power_of_two``'s; every policy keeps a prefix index of ``capacity_blocks_per_worker`` blocks per
    worker for its predicted cached tokens. Raises ``ValueError`` for an unknown name."""
    if name == "prefix_hash":
        hot = HotPrefixTracker(hot_prefix_half_life_s) if hot_prefix_half_life_s > 0 else None
        return PrefixHashPolicy(
            virtual_nodes,
            load_factor,
            capacity_blocks_per_worker,
            balance_abs_tokens,
            cache_threshold,
            hot_prefix=hot,
            prefix_blocks=prefix_blocks,
        )
    if name == "least_load":
        return LeastLoadPolicy(capacity_blocks_per_worker)
    if name == "round_robin":
        return RoundRobinPolicy(capacity_blocks_per_worker)
    if name == "power_of_two":
        return PowerOfTwoPolicy(capacity_blocks_per_worker, seed)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")


__all__ = [
    "POLICIES",
    "HotPrefixTracker",
    "IndexedPolicy",
    "LeastLoadPolicy",
    "PowerOfTwoPolicy",
    "PrefixHashPolicy",
    "RoundRobinPolicy",
    "make_policy",
]
