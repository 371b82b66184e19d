"""Types shared by the router's parts: prefix keys, worker load views, routing decisions, discovered endpoints.

Import direction inside router/: types <- prefix_key, policy, discovery, worker_state, request, usage <- probes <-
workers <- relay <- proxy <- app. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

# constants.ROUTE_REASONS, in the same order (tests/test_docs_contracts.py checks).
RouteReason = Literal["cache-affinity", "cold", "hot-prefix", "load-spill", "retry", "fallback"]

# The proxied request kinds: POST /v1/chat/completions, /v1/completions and the native /generate.
RequestKind = Literal["chat", "completions", "generate"]


@dataclass(frozen=True)
class PrefixKey:
    """What the router knows about a request's prompt, as the engine will cache it.

    ``blocks`` are chained hashes (64-bit ints) of consecutive full blocks of the rendered prompt: block ``i``'s hash
    covers blocks ``0..i`` and the namespace (model name and cache salt), so equal hashes mean equal prefixes.
    ``routing_key`` is the hash of the first K blocks; of the whole prompt, its last partial block included, when
    that is shorter than K blocks (so short prompts spread over the ring); the namespace hash alone for an empty
    prompt. The partial block is never in ``blocks``. ``kind`` says whether blocks are token ids (the router has the
    model's tokenizer) or characters. ``prompt_tokens`` is the prompt length in tokens (exact for ``tokens``,
    estimated for ``chars``); ``block_tokens`` is how many tokens one block covers (estimated for ``chars``).
    """

    model: str
    kind: Literal["tokens", "chars"]
    blocks: tuple[int, ...]
    routing_key: int
    prompt_tokens: int
    block_tokens: int


@dataclass
class WorkerLoad:
    """A routable worker as a policy sees it: its URL, what this router has in flight on it, and what the engine
    last reported of all its requests (every router's).

    ``inflight_tokens`` = sum over this router's in-flight requests of (uncached prompt tokens + max output tokens).
    ``engine_requests`` / ``engine_tokens`` are the engine's ``GET /load`` (samples queued + running; queued prefill
    + running KV tokens), None when it has none. The engine's tokens are not in the router's unit (they count cached
    prefixes the running requests hold), so ``load`` uses only its request count: other routers' requests count at
    this router's mean cost per request (regression: ``max(inflight, engine KV tokens)`` tipped the bounded-load
    check and spilled conversations off their engine, hit rate 0.74 -> 0.67 on the multi-conversation bench).
    """

    url: str
    inflight_requests: int = 0
    inflight_tokens: int = 0
    engine_tokens: int | None = None
    engine_requests: int | None = None
    mean_request_tokens: float = 0.0  # this router's recent cost per request on this worker (tokens, an EMA)

    @property
    def requests(self) -> int:
        """Requests on this worker as far as this router knows (its own, or the engine's count when larger)."""
        return max(self.inflight_requests, self.engine_requests or 0)

    @property
    def load(self) -> int:
        """Tokens of work on this worker in this router's unit: its own in-flight tokens plus the engine's other
        requests at this router's mean cost per request."""
        others = (self.engine_requests or 0) - self.inflight_requests
        if others <= 0:
            return self.inflight_tokens
        per_request = self.inflight_tokens / self.inflight_requests if self.inflight_requests else 0.0
        return self.inflight_tokens + int(others * (per_request or self.mean_request_tokens))


@dataclass(frozen=True)
class RouteDecision:
    """One candidate worker, why it was picked, and how many prompt tokens the router predicts it has cached."""

    worker: str
    reason: RouteReason
    predicted_cached_tokens: int = 0


class CacheOracle(Protocol):
    """Where a policy's matches come from when set (``IndexedPolicy.oracle``; ``cache_state.py``
    ``CacheStateTracker``): the engine-reported cache of a worker whose report is verified, else a prediction."""

    def match(self, worker: str, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` (chained hashes) ``worker`` holds."""

    def record(self, worker: str, blocks: Sequence[int]) -> None:
        """A prompt of ``blocks`` was just dispatched to ``worker``."""


class RoutingPolicy(Protocol):
    """Orders the routable workers for one request (first = the choice, the rest = retry candidates in order)."""

    name: str

    def set_workers(self, urls: Sequence[str]) -> None:
        """All workers this policy may see (e.g. to build a hash ring); ``rank`` gets a subset of them."""

    def rank(self, key: PrefixKey | None, workers: Sequence[WorkerLoad], cost_tokens: int) -> list[RouteDecision]:
        """Every worker of ``workers`` exactly once, best first. ``cost_tokens`` is the load this request adds.
        ``key`` is None when the request has no prompt to key on (the policy falls back to load)."""

    def record(self, worker: str, key: PrefixKey) -> None:
        """The request with ``key`` was sent to ``worker`` (the engine will now cache its blocks)."""

    def forget_worker(self, worker: str) -> None:
        """``worker`` left (its cache is gone)."""


@dataclass(frozen=True)
class Endpoint:
    """A discovered engine endpoint. ``url`` like ``http://10.0.0.7:30000``; ``service`` the engine Service name;
    ``inference_service`` the ``radixserve.io/inference-service`` label value (None for static URLs)."""

    url: str
    service: str | None = None
    inference_service: str | None = None
    pod: str | None = None
    labels: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
