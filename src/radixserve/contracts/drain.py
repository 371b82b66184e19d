"""The graceful drain both the engine and the router run on SIGTERM (docs/contracts.md, "Graceful drain"): wait for
the requests in flight, at most ``--shutdown-timeout`` seconds, then end the rest. ``IdleSignal`` wakes the wait
when a count of requests in flight reaches zero; ``drain_in_flight`` is the wait, its two log lines and the ending.
Everything runs on the server's event loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable


class IdleSignal:
    """Tells ``wait`` that nothing is in flight. The owner calls ``busy`` when its count leaves zero and ``idle``
    when it returns to zero; the event exists only once someone waits (no loop is needed before that)."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def busy(self) -> None:
        """The count of requests in flight left zero."""
        if self._event is not None:
            self._event.clear()

    def idle(self) -> None:
        """The count of requests in flight reached zero."""
        if self._event is not None:
            self._event.set()

    async def wait(self, in_flight: Callable[[], int], timeout_s: float) -> bool:
        """Wait until ``in_flight()`` (requests) is zero, at most ``timeout_s`` seconds; True when none is left.
        Raises ``asyncio.CancelledError`` when cancelled."""
        if not in_flight():
            return True
        if self._event is None:
            self._event = asyncio.Event()
        try:
            await asyncio.wait_for(self._event.wait(), max(0.0, timeout_s))
        except TimeoutError:
            return not in_flight()
        return True


async def drain_in_flight(
    in_flight: Callable[[], int],
    idle: IdleSignal,
    timeout_s: float,
    end_rest: Callable[[], None],
    logger: logging.Logger,
    ending: str = "aborting",
) -> None:
    """Let the requests in flight (``in_flight()``, a count) finish for up to ``timeout_s`` seconds, then call
    ``end_rest()`` (which must not block), in every case: ended early by a cancel (a second signal) too, which is
    re-raised. Logs "draining: N request(s) in flight ..." first, then either "drained: every request finished" or
    "drain: <why>; <ending> the N request(s) still in flight", where why is "T s passed" or "stopped at once".

    Why the drain ended is told by the cancel, not by the clock: uvloop's timers run on a cached loop time and may
    fire a few milliseconds before ``timeout_s`` has passed by ``time.monotonic()`` (regression: a timeout was
    logged as "stopped at once")."""
    t0 = time.monotonic()
    logger.info(
        "draining: %d request(s) in flight may finish within %g s (--shutdown-timeout); new requests get 503",
        in_flight(),
        timeout_s,
    )
    done = False
    why = f"{timeout_s:g} s passed"
    try:
        done = await idle.wait(in_flight, timeout_s)
    except asyncio.CancelledError:
        why = "stopped at once"
        raise
    finally:
        left = in_flight()
        if done or not left:
            logger.info("drained: every request finished (%.1f s)", time.monotonic() - t0)
        else:
            logger.warning("drain: %s; %s the %d request(s) still in flight", why, ending, left)
        end_rest()
