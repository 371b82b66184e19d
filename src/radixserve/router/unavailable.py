"""Why the router cannot route now: the message of its 503 and the ``Retry-After`` that goes with it.

Read from the workers' breaker states (``breaker.py``), so a client sees what the log said: engines still starting
(``pending``: retry in a second) are not engines that were ejected, e.g. for a 401 that no retry will clear
(regression: a router without the engines' key answered "no engine is ready yet; retry shortly" forever).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from radixserve.router.breaker import WorkerHealthState

# Seconds a client should wait while engines are still starting, or for a transient failure (a full queue, a router
# shutting down): about one pending probe interval, so the retry finds a newly admitted engine.
RETRY_SOON_S = 1


class _Worker(Protocol):
    """What is read of a ``workers.WorkerState``."""

    @property
    def state(self) -> WorkerHealthState: ...

    @property
    def last_error(self) -> str | None: ...

    models: tuple[str, ...]
    draining: bool


@dataclass(frozen=True)
class Unroutable:
    """A 503's ``message`` and its ``Retry-After`` in whole seconds (``retry_after_s`` >= 1)."""

    message: str
    retry_after_s: int


def unroutable(workers: Iterable[_Worker], readmit_after_s: float, model: str | None = None) -> Unroutable:
    """Why none of ``workers`` (for ``model``: those serving it, and those not admitted yet, whose models are not
    known) takes a request, e.g. ``no engine is routable (0 of 1): 1 ejected after 401 Unauthorized from GET
    /v1/models (is --engine-api-key / RADIXSERVE_ENGINE_API_KEY set to the engine's key?)``.

    While some are ``pending`` the message says ``no engine is ready yet`` and asks to retry in ``RETRY_SOON_S``;
    with only ejected ones, ``Retry-After`` is ``readmit_after_s`` (the earliest an ejected engine is readmitted)."""
    known = [w for w in workers if model is None or model in w.models or not w.models]
    if not known:
        if model is not None:
            return Unroutable(f"no engine is available for model `{model}`", RETRY_SOON_S)
        return Unroutable("no engine has been discovered yet; retry shortly", RETRY_SOON_S)
    pending = sum(w.state == "pending" for w in known)
    ejected = Counter(w.last_error or "no answer" for w in known if w.state == "ejected")
    causes = [f"{n} ejected after {reason}" for reason, n in sorted(ejected.items(), key=lambda kv: -kv[1])]
    draining = sum(w.draining for w in known)
    if draining:
        causes.append(f"{draining} draining (shutting down)")
    routable = sum(w.state in ("healthy", "probing") and not w.draining for w in known)
    what = "no engine" if model is None else f"no engine for model `{model}`"
    if pending:
        detail = "; ".join([f"{pending} still starting", *causes])
        return Unroutable(
            f"{what} is ready yet ({routable} of {len(known)} routable: {detail}); retry shortly", RETRY_SOON_S
        )
    detail = "; ".join(causes) or "none routable"
    retry_s = RETRY_SOON_S if draining and not ejected else max(RETRY_SOON_S, math.ceil(readmit_after_s))
    return Unroutable(f"{what} is routable ({routable} of {len(known)}): {detail}", retry_s)


def retry_after_header(seconds: int) -> tuple[bytes, bytes]:
    """The raw ASGI ``Retry-After`` header (delay-seconds, RFC 9110 §10.2.3)."""
    return (b"retry-after", str(seconds).encode())
