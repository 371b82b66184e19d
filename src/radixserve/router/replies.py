"""The router's own answers (errors in the OpenAI format of docs/contracts.md) and the request counter.

Every proxied request is counted once in ``radixserve_router_requests_total{model, code}``: by ``RequestCounter.count``
when it was relayed, or by ``error`` when the router answered it.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.types import Send

from radixserve.contracts import constants
from radixserve.contracts.protocol import error_body
from radixserve.router.metrics import RouterMetrics
from radixserve.router.unavailable import RETRY_SOON_S, retry_after_header

_JSON_CT = (b"content-type", b"application/json")
_H_WORKER = constants.HEADER_WORKER.encode()
DRAINING_HEADER = (constants.HEADER_DRAINING.encode(), b"1")


class RequestCounter:
    """Counts requests by (model, status) and sends the router's error answers."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self._children: dict[tuple[str, int], Any] = {}

    def count(self, model: str, code: int) -> None:
        """Count one request for ``model`` answered with ``code`` (499: the client left)."""
        child = self._children.get((model, code))
        if child is None:
            child = self._children[(model, code)] = self.metrics.requests.labels(model, str(code))
        child.inc()

    async def error(
        self,
        send: Send,
        status: int,
        message: str,
        model: str,
        param: str | None = None,
        t0: float | None = None,
        worker: str | None = None,
        retry_after_s: int = RETRY_SOON_S,
        draining: bool = False,
    ) -> None:
        """Answer an OpenAI error body and count it (with its duration when ``t0``, the arrival time in
        ``perf_counter`` seconds, is given; naming the engine at fault in ``x-radixserve-worker`` when ``worker`` is;
        a 429 or 503 with ``Retry-After: retry_after_s``; ``x-radixserve-draining: 1`` when ``draining``: the router
        is draining and admits nothing new)."""
        body = json.dumps(error_body(message, status, param)).encode()
        headers = [_JSON_CT, (b"content-length", str(len(body)).encode())]
        if status in (429, 503):
            headers.append(retry_after_header(retry_after_s))
        if worker is not None:
            headers.append((_H_WORKER, worker.encode()))
        if draining:
            headers.append(DRAINING_HEADER)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self.count(model, status)
        if t0 is not None:
            self.metrics.duration.observe(time.perf_counter() - t0)
