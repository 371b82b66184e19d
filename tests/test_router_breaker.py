"""The router's per-worker circuit breaker (router/breaker.py) alone: its states, transitions and failure wording."""

from __future__ import annotations

import asyncio
import socket
import typing

import httpx
import pytest

from radixserve.contracts import constants
from radixserve.router.breaker import Breaker, Transition, WorkerHealthState, failure_reason, status_reason


def test_states_are_the_contract():
    assert typing.get_args(WorkerHealthState) == constants.ROUTER_WORKER_STATES


def test_healthy_worker_ejected_after_n_failures_then_probing_then_healthy_again():
    b = Breaker(eject_after_failures=3, readmit_after_s=10.0)
    assert b.success(0.0, probe=True) == Transition("pending", "healthy")
    assert b.failure("connection refused on GET /health", 1.0) is None
    assert b.failure("connection refused on GET /health", 2.0) is None
    t = b.failure("connection refused on GET /health", 3.0)
    assert t == Transition("healthy", "ejected", "connection refused on GET /health", 3)
    assert not b.routable and b.last_error == "connection refused on GET /health"
    assert b.failure("connection refused on GET /health", 4.0) is None  # one change, not one line per probe
    assert b.success(12.9, probe=True) is None  # before readmit_after_s
    assert b.success(13.0, probe=False) is None and b.state == "ejected"  # a request does not readmit
    assert b.success(13.0, probe=True) == Transition("ejected", "probing", down_s=10.0)
    assert b.routable
    assert b.success(15.5, probe=False) == Transition("probing", "healthy", down_s=12.5)
    assert b.down_since is None and b.consecutive_failures == 0


def test_a_failure_while_probing_ejects_at_once_and_the_outage_clock_keeps_running():
    b = Breaker(eject_after_failures=3, readmit_after_s=1.0)
    b.success(0.0, probe=True)
    for t in (1.0, 2.0, 3.0):
        b.failure("503 Service Unavailable from GET /health", t)
    assert b.success(4.0, probe=True).new == "probing"
    assert b.failure("connection reset on POST /generate", 4.5) == Transition(
        "probing", "ejected", "connection reset on POST /generate", 1
    )
    assert b.success(5.0, probe=True) is None  # the readmission clock restarted at 4.5
    b.success(5.5, probe=True)
    assert b.success(6.0, probe=True) == Transition("probing", "healthy", down_s=3.0)  # since the first ejection


def test_pending_worker_waits_out_loading_but_a_definite_refusal_ejects_it():
    b = Breaker(eject_after_failures=1)
    for t in range(10):  # an engine still loading: refused connections, 503s
        assert b.failure("connection refused on GET /health", float(t)) is None
    assert b.state == "pending" and b.consecutive_failures == 10
    reason = status_reason(401, "GET", "/v1/models")
    assert b.failure(reason, 11.0, definite=True) == Transition("pending", "ejected", reason, 11)


def test_pending_overdue_is_said_once():
    b = Breaker(created_at=100.0)
    assert not b.overdue(159.0, 60.0)
    assert b.overdue(160.0, 60.0) and not b.overdue(200.0, 60.0)
    admitted = Breaker(created_at=0.0)
    admitted.success(1.0, probe=True)
    assert not admitted.overdue(100.0, 60.0)


def test_status_reason_names_the_request_and_hints_at_the_key():
    assert status_reason(401, "GET", "/v1/models") == (
        "401 Unauthorized from GET /v1/models (is --engine-api-key / RADIXSERVE_ENGINE_API_KEY set to the engine's "
        "key?)"
    )
    assert status_reason(503, "POST", "/generate") == "503 Service Unavailable from POST /generate"
    assert status_reason(599, "GET", "/health") == "599 answer from GET /health"


@pytest.mark.parametrize("transport", ["httpx", "aiohttp"])
def test_failure_reason_of_a_refused_connection(transport):
    # aiohttp's transport reports a refused connection as ConnectTimeout; the OS error underneath says what it was.
    from httpx_aiohttp import AiohttpTransport

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/health"  # bound, not listening: refused

        async def get() -> BaseException:
            t = AiohttpTransport() if transport == "aiohttp" else httpx.AsyncHTTPTransport()
            async with httpx.AsyncClient(transport=t) as client:
                with pytest.raises(httpx.HTTPError) as e:
                    await client.get(url)
            return e.value

        assert failure_reason(asyncio.run(get())) == "connection refused"


def test_failure_reason_without_an_os_error():
    assert failure_reason(httpx.ReadTimeout("slow")) == "timed out (ReadTimeout)"
    assert (
        failure_reason(httpx.RemoteProtocolError("Server disconnected")) == "RemoteProtocolError: Server disconnected"
    )
