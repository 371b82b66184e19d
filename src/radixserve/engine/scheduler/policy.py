"""Waiting-queue ordering policies: ``lpm`` (longest prefix match, SGLang's cache-aware policy) and ``fcfs``."""

from __future__ import annotations

from typing import Any

# Matching every waiting request against the radix tree costs O(queue * prompt); past this queue length the
# ordering is not worth it and SGLang also falls back to FCFS.
LPM_MAX_QUEUE = 128

POLICIES = ("lpm", "fcfs")


def order_waiting(waiting: list[Any], policy: str, cache: Any) -> list[Any]:
    """Return ``waiting`` in admission order.

    ``lpm``: requests with the longest cached prefix first (ties: arrival order), so requests that share a prefix run
    together while it is still cached (SGLang, "Efficiently Programming LLMs using SGLang", Zheng et al. 2024).
    ``fcfs``: arrival order. Raises ValueError for an unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown schedule policy {policy!r}; choose from {POLICIES}")
    if policy == "fcfs" or cache.disable or len(waiting) > LPM_MAX_QUEUE or len(waiting) <= 1:
        return sorted(waiting, key=lambda r: r.arrival_time)
    scored = [(len(cache.match_prefix(r.fill_ids).slots), r) for r in waiting]
    scored.sort(key=lambda x: (-x[0], x[1].arrival_time))
    return [r for _, r in scored]
