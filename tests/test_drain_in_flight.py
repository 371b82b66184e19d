"""``contracts/drain.py``, the drain both the engine (``Drain.run``) and the router (``Proxy.drain``) run: the wait for
the requests in flight, its log lines and the ending of the rest, on uvloop as under uvicorn."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import uvloop

from radixserve.contracts import drain as drain_module
from radixserve.contracts.drain import IdleSignal, drain_in_flight

LOGGER = logging.getLogger("test.drain")


class Count:
    """A count of requests in flight with its IdleSignal, as the engine's Drain keeps one."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.idle = IdleSignal()

    def __call__(self) -> int:
        return self.n

    def leave(self) -> None:
        self.n -= 1
        if not self.n:
            self.idle.idle()


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_the_timeout_is_told_from_the_cancel_not_the_clock(monkeypatch, caplog):
    """Regression (CI, under load): uvloop's timer fired a few milliseconds before ``--shutdown-timeout`` had passed
    by ``time.monotonic()``, and the drain logged "stopped at once" for a timeout. A frozen clock makes that so."""
    frozen = time.monotonic()
    monkeypatch.setattr(drain_module.time, "monotonic", lambda: frozen)
    ended: list[str] = []

    async def timed_out() -> None:
        count = Count(1)
        await drain_in_flight(count, count.idle, 0.05, lambda: ended.append("timeout"), LOGGER)

    async def cancelled() -> None:
        count = Count(2)
        task = asyncio.ensure_future(drain_in_flight(count, count.idle, 30, lambda: ended.append("cancel"), LOGGER))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        uvloop.run(timed_out())
        uvloop.run(cancelled())
    assert warnings(caplog) == [
        "drain: 0.05 s passed; aborting the 1 request(s) still in flight",
        "drain: stopped at once; aborting the 2 request(s) still in flight",
    ]
    assert ended == ["timeout", "cancel"]


def test_the_drain_returns_when_the_last_request_leaves(caplog):
    ended: list[bool] = []

    async def main() -> float:
        count = Count(2)
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, count.leave)
        loop.call_later(0.1, count.leave)
        t0 = time.monotonic()
        await drain_in_flight(count, count.idle, 30, lambda: ended.append(True), LOGGER, "ending")
        return time.monotonic() - t0

    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        took = uvloop.run(main())
    assert 0.09 < took < 5
    assert ended == [True] and not warnings(caplog)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("draining: 2 request(s) in flight may finish within 30 s")
    assert messages[1].startswith("drained: every request finished")


def test_nothing_in_flight_ends_at_once_without_an_event_loop_wait(caplog):
    ended: list[bool] = []
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        uvloop.run(drain_in_flight(lambda: 0, IdleSignal(), 30, lambda: ended.append(True), LOGGER))
    assert ended == [True] and not warnings(caplog)
