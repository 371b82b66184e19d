"""The requests in flight through this router: drained, ended early on shutdown, moved off an engine that stalls.

Each relay registers its task for its whole life (a drain waits on ``idle`` for them to end, ``begin_shutdown`` cancels
them all) and, while it waits on an engine, itself under that engine's URL (``abandon_stalled`` gives those up).
``start_draining`` marks the router as draining (docs/contracts.md, "Graceful drain"): the proxy then admits no new
request. Everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from radixserve.contracts.drain import IdleSignal

logger = logging.getLogger("radixserve.router.proxy")


class Abandonable(Protocol):
    """A request waiting on an engine (``relay.Relay``)."""

    abandoned: str | None

    def abandon(self, reason: str) -> None:
        """Stop waiting on the engine (it stalled because of ``reason``)."""


class InFlight:
    """The registry of relays. ``draining`` turns true with ``start_draining``, ``shutting_down`` with
    ``begin_shutdown``; both stay so."""

    def __init__(self) -> None:
        self.draining = False
        self.shutting_down = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_worker: dict[str, set[Abandonable]] = {}
        self.idle = IdleSignal()  # wakes a drain (``contracts.drain``) once no task is registered

    def __len__(self) -> int:
        """Requests in flight (relays registered)."""
        return len(self._tasks)

    def add(self, task: asyncio.Task[Any]) -> None:
        """``task`` serves a request until ``discard``."""
        self._tasks.add(task)
        self.idle.busy()

    def discard(self, task: asyncio.Task[Any]) -> None:
        """``task`` has ended (or no longer counts in flight)."""
        self._tasks.discard(task)
        if not self._tasks:
            self.idle.idle()

    def start_draining(self) -> None:
        """Admit no new request from now on (the proxy answers them 503); those in flight go on."""
        self.draining = True

    def watch(self, relay: Abandonable, worker_url: str) -> None:
        """``relay`` now waits on ``worker_url`` (until ``unwatch``)."""
        self._on_worker.setdefault(worker_url, set()).add(relay)

    def unwatch(self, relay: Abandonable, worker_url: str) -> None:
        waiting = self._on_worker.get(worker_url)
        if waiting is not None:
            waiting.discard(relay)
            if not waiting:
                del self._on_worker[worker_url]

    def begin_shutdown(self) -> None:
        """End every request in flight now (call on the event loop): a client gets a 503, or for a stream already
        under way an SSE error event and ``[DONE]`` — instead of a connection cut when the server's graceful
        timeout runs out (regression: streams ended without an event, one traceback logged per stream)."""
        self.shutting_down = True
        for task in list(self._tasks):
            task.cancel()

    def abandon_stalled(self, worker_url: str, why: str) -> None:
        """``worker_url`` stopped answering its probes for ``engine_stall_timeout_s`` (``WorkerPool.on_stall``):
        every request waiting on it gives it up (its connection closed, so the engine aborts the request once it
        runs again). One that has sent the client nothing yet is retried on its next candidate; a stream under way
        ends with an SSE error event and ``[DONE]``."""
        relays = [r for r in self._on_worker.get(worker_url, ()) if r.abandoned is None]
        if not relays:
            return
        logger.warning("worker %s stalled: %s; giving up %d request(s) on it", worker_url, why, len(relays))
        for r in relays:
            r.abandon(why)
