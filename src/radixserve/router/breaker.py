"""Whether one engine may take traffic: the per-worker circuit breaker, and the words for why it changed state.

A worker is ``pending`` (discovered, its first probe has not succeeded yet), ``healthy`` (routable), ``ejected`` (not
routable) or ``probing`` (routable again, on trial). The breaker is Nygard's (*Release It!*; Envoy's outlier detection
does the same), with the states named for what they mean to a user rather than closed / open / half-open:

- ``pending`` -> ``healthy`` on the first successful probe; ``pending`` -> ``ejected`` at once on a *definite* failure
  (the engine answered and refused, e.g. 401 from ``/v1/models``: waiting will not help), never on the connection
  errors and 503s of an engine still loading;
- ``healthy`` -> ``ejected`` after ``eject_after_failures`` consecutive failures (probes, or proxied requests that
  could not connect or got a 5xx before the first byte);
- ``ejected`` -> ``probing`` on the first successful *probe* at least ``readmit_after_s`` after the ejection (a probe
  has just re-read the worker's models; a request's success does not readmit);
- ``probing`` -> ``healthy`` on the next success; ``probing`` -> ``ejected`` on any failure.

``Breaker`` is pure: it takes monotonic seconds and returns the ``Transition`` a call caused (or None); the pool logs
it and counts ejections; ``overdue`` says once that a worker is still pending ``PENDING_WARN_S`` after discovery.
``failure_reason`` / ``status_reason`` word the failures the way the log line shows them.
"""

from __future__ import annotations

import http
from dataclasses import dataclass
from typing import Literal

from radixserve.router.config import ENGINE_API_KEY_ENV

WorkerHealthState = Literal["pending", "healthy", "ejected", "probing"]
ROUTABLE_STATES: frozenset[str] = frozenset({"healthy", "probing"})
# Seconds a worker may stay pending before one WARNING says so (no state change: it may be a big model loading).
PENDING_WARN_S = 60.0


@dataclass(frozen=True)
class Transition:
    """One state change. ``reason``: the failure that ejected the worker (None otherwise); ``failures``: consecutive
    failures at that point; ``down_s``: seconds since the worker left ``healthy`` (or was first ejected while pending),
    set when it becomes ``probing`` or ``healthy`` again."""

    old: WorkerHealthState
    new: WorkerHealthState
    reason: str | None = None
    failures: int = 0
    down_s: float | None = None


@dataclass
class Breaker:
    """One worker's state. ``eject_after_failures`` >= 1 and ``readmit_after_s`` >= 0 come from ``RouterArgs``."""

    eject_after_failures: int = 3
    readmit_after_s: float = 10.0
    state: WorkerHealthState = "pending"
    consecutive_failures: int = 0
    last_error: str | None = None
    ejected_at: float = 0.0  # monotonic seconds of the latest ejection (the readmission clock)
    down_since: float | None = None  # monotonic seconds the current outage began
    created_at: float = 0.0  # monotonic seconds the worker was discovered
    warned_pending: bool = False

    @property
    def routable(self) -> bool:
        """Whether the worker may take requests now (``healthy`` or ``probing``)."""
        return self.state in ROUTABLE_STATES

    def success(self, now: float, probe: bool) -> Transition | None:
        """A probe (``probe``) or a proxied request reached the worker and got an answer that is not a 5xx."""
        self.consecutive_failures = 0
        self.last_error = None
        if self.state == "pending" and probe:
            return self._move("healthy", now)
        if self.state == "probing":
            return self._move("healthy", now)
        if self.state == "ejected" and probe and now - self.ejected_at >= self.readmit_after_s:
            return self._move("probing", now)
        return None

    def failure(self, reason: str, now: float, definite: bool = False) -> Transition | None:
        """A probe or a proxied request failed with ``reason``. ``definite``: the engine answered and refused (it is
        up but will not serve this router), which ejects a pending worker at once."""
        self.consecutive_failures += 1
        self.last_error = reason
        if (
            self.state == "probing"
            or (self.state == "healthy" and self.consecutive_failures >= self.eject_after_failures)
            or (self.state == "pending" and definite)
        ):
            return self._move("ejected", now, reason)
        return None

    def overdue(self, now: float, after_s: float) -> bool:
        """True once, the first time it is asked while the worker is still pending ``after_s`` seconds after it was
        discovered (so the log says why nothing is routable, e.g. a URL where nothing listens)."""
        if self.state != "pending" or self.warned_pending or now - self.created_at < after_s:
            return False
        self.warned_pending = True
        return True

    def _move(self, new: WorkerHealthState, now: float, reason: str | None = None) -> Transition:
        old, self.state = self.state, new
        down_s = None
        if new == "ejected":
            self.ejected_at = now
            if self.down_since is None:
                self.down_since = now
        elif self.down_since is not None:
            down_s = now - self.down_since
            if new == "healthy":
                self.down_since = None
        return Transition(old, new, reason, self.consecutive_failures, down_s)


# What a 401 / 403 from an engine usually means: the router sends no key, or not the engine's (router/config.py).
_KEY_HINT = f"(is --engine-api-key / {ENGINE_API_KEY_ENV} set to the engine's key?)"


def status_reason(status: int, method: str, path: str) -> str:
    """An HTTP answer that counts as a failure, worded for the log, e.g. ``401 Unauthorized from GET /v1/models (is
    --engine-api-key / RADIXSERVE_ENGINE_API_KEY set to the engine's key?)``."""
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "answer"
    text = f"{status} {phrase} from {method} {path}"
    return f"{text} {_KEY_HINT}" if status in (401, 403) else text


def failure_reason(exc: BaseException) -> str:
    """A transport failure in a few words: ``connection refused``, ``connection reset``, ``timed out (ReadTimeout)``,
    ... Looks through the exception's causes for the OS error (httpx and aiohttp both wrap it; aiohttp's transport
    even reports a refused connection as ``ConnectTimeout``)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
        if isinstance(e, ConnectionResetError):
            return "connection reset"
        if isinstance(e, ConnectionAbortedError | BrokenPipeError):
            return "connection closed"
        e = e.__cause__ or e.__context__
    name = type(exc).__name__
    if "Timeout" in name:
        return f"timed out ({name})"
    text = str(exc)
    return f"{name}: {text}" if text else name
