"""One engine as the router sees it: its URL and endpoint, the load a policy ranks, its breaker, what it serves.

``WorkerState`` is plain data: ``workers.py`` ``WorkerPool`` creates one per engine URL and updates its load and
breaker; ``probes.py`` ``HealthProber`` writes its models and probe timestamps. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.router.breaker import Breaker, WorkerHealthState
from radixserve.router.types import Endpoint, WorkerLoad


@dataclass
class WorkerState:
    """One engine. ``load`` is the view a policy ranks (in-flight requests and tokens, updated in place).

    ``breaker`` holds its state (``pending``, ``healthy``, ``ejected``, ``probing``) and its consecutive failures.
    """

    url: str
    endpoint: Endpoint
    load: WorkerLoad
    breaker: Breaker = field(default_factory=Breaker)
    models: tuple[str, ...] = ()
    removed: bool = False
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> its /v1/models entry
    gauges: tuple[Any, Any] | None = field(default=None, repr=False)  # (in-flight requests, tokens) gauge children
    answered_at: float = 0.0  # monotonic seconds the last successful probe ended
    probe_failing: bool = False  # the latest probe of the probe loop failed (no answer, or not a healthy one)
    # The engine said it is draining (a 503 with x-radixserve-draining): not routable, its requests in flight go on,
    # never counted as stalled. Cleared by its next successful probe (a restart at the same URL).
    draining: bool = False

    @property
    def state(self) -> WorkerHealthState:
        """The breaker's state: ``pending``, ``healthy``, ``ejected`` or ``probing``."""
        return self.breaker.state

    @property
    def consecutive_failures(self) -> int:
        """Failures (probes or requests) in a row since the last success."""
        return self.breaker.consecutive_failures

    @property
    def last_error(self) -> str | None:
        """The latest failure's reason, in the log's wording; ``None`` once a success followed it (or before any)."""
        return self.breaker.last_error

    @property
    def inflight_requests(self) -> int:
        """Requests this router has in flight on the engine."""
        return self.load.inflight_requests

    @property
    def inflight_tokens(self) -> int:
        """Tokens (uncached prompt + max tokens) of the requests this router has in flight on the engine."""
        return self.load.inflight_tokens

    def describe(self) -> dict[str, Any]:
        """The worker as ``/health`` lists it."""
        return {
            "url": self.url,
            "models": list(self.models),
            "state": self.state,
            "inflight_requests": self.load.inflight_requests,
            "inflight_tokens": self.load.inflight_tokens,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "draining": self.draining,
            "pod": self.endpoint.pod,
            "inference_service": self.endpoint.inference_service,
        }
