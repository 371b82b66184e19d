"""When the router can first route: the one ``ready:`` log line (the 503s before it say why: ``unavailable.py``).

The router's HTTP server listens long before its engines have loaded (the local stack: ~19 s), so "Uvicorn running"
says nothing about when a request would get an answer. ``ReadyAnnouncer`` logs, once::

    ready: http://127.0.0.1:8000/v1 — smollm2-135m-instruct on 2 engines

when every known engine is routable (all of ``--worker-urls``; with service discovery, all discovered so far), so
the first request after the line is answered and the line's engine count is the stack's. So that one engine stuck
in a crash loop does not hide a router that can already serve, the line also comes ``READY_GRACE_S`` seconds after
the first engine became routable, as ``on 1 of 2 engines``; an ``all N engines routable`` line follows when the rest
catch up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("radixserve.router")

# Seconds a partly routable router waits for the rest before announcing itself: longer than the gap between engines
# of one stack finishing their load together (a probe interval or two), shorter than a newcomer's patience.
READY_GRACE_S = 15.0
# Seconds between readiness checks; the routable set is cached by the pool, so a check costs next to nothing.
POLL_S = 0.2


def public_url(host: str, port: int) -> str:
    """The router's OpenAI base URL, ``http://host:port/v1`` (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def _engines(n: int) -> str:
    return "1 engine" if n == 1 else f"{n} engines"


class ReadyAnnouncer:
    """Logs the ``ready:`` line (once) and, after a partial one, the ``all N engines routable`` line (once).

    ``pool`` is the router's ``WorkerPool`` (``workers``, ``routable(None)``, ``routable_models()``);
    ``listening()`` says whether the HTTP server accepts connections yet (the line must not precede it);
    ``grace_s`` defaults to ``READY_GRACE_S``. Call ``check()`` on the event loop, or run ``run()`` as a task.
    """

    def __init__(
        self,
        pool: Any,
        host: str,
        port: int,
        listening: Callable[[], bool] = lambda: True,
        grace_s: float | None = None,
    ) -> None:
        self.pool = pool
        self.url = public_url(host, port)
        self.listening = listening
        self.grace_s = READY_GRACE_S if grace_s is None else grace_s
        self.ready = False  # the ready line was logged
        self.complete = False  # every known engine was routable when, or after, it was logged
        self._partial_since: float | None = None  # monotonic s since some, not all, engines are routable

    def check(self, now: float | None = None) -> bool:
        """Log what is due; returns True once there is nothing left to log. ``now``: monotonic seconds."""
        if self.complete:
            return True
        if not self.listening():
            return False
        now = time.monotonic() if now is None else now
        routable, total = len(self.pool.routable(None)), len(self.pool.workers)
        models = ", ".join(self.pool.routable_models())
        if routable and routable == total:
            if self.ready:
                logger.info("all %s routable — %s", _engines(total), models)
            else:
                logger.info("ready: %s — %s on %s", self.url, models, _engines(total))
            self.ready = self.complete = True
            return True
        if self.ready:
            return False
        if not routable:
            self._partial_since = None  # the clock restarts with the next routable engine
            return False
        if self._partial_since is None:
            self._partial_since = now
        elif now - self._partial_since >= self.grace_s:
            logger.info(
                "ready: %s — %s on %d of %s (the others are not routable yet)",
                self.url,
                models,
                routable,
                _engines(total),
            )
            self.ready = True
        return False

    async def run(self) -> None:
        """Check every ``POLL_S`` seconds until both lines are logged (or the task is cancelled). The first check
        waits one period: the lifespan starts this task just before uvicorn binds its socket."""
        while True:
            await asyncio.sleep(POLL_S)
            if self.check():
                return
