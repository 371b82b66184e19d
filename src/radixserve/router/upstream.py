"""Sending one request to an engine over the router's pooled transport.

``Upstream.send`` posts straight to the transport (``AsyncClient.send`` adds cookies, auth, redirects and event hooks
that a proxy does not use: about a fifth of the router's CPU per request, measured). Failures before any answer
byte are ``Dropped``: nothing was answered, so the next candidate may serve the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from radixserve.contracts import constants
from radixserve.router.breaker import failure_reason


class Dropped(Exception):
    """The upstream connection failed before any answer (connect error / refused / dropped): try the next one."""


class Upstream:
    """Posts to engines. ``transport``: the one pooled transport (httpx's or httpx-aiohttp's) for every upstream
    request; ``timeout`` applies per request; ``engine_api_key`` is sent as a bearer token when set."""

    def __init__(self, transport: httpx.AsyncBaseTransport, timeout: httpx.Timeout, engine_api_key: str | None) -> None:
        self.transport = transport
        self._extensions = {"timeout": timeout.as_dict()}
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self._auth = f"Bearer {engine_api_key}" if engine_api_key else None

    def headers(self, request_id: str) -> dict[str, str]:
        """The headers of an upstream request: JSON, the request id, no compression, the engine API key."""
        headers = {
            "content-type": "application/json",
            constants.HEADER_REQUEST_ID: request_id,
            "accept-encoding": "identity",
        }
        if self._auth is not None:
            headers["authorization"] = self._auth
        return headers

    async def send(self, worker_url: str, path: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
        """``POST worker_url + path``; the response with its body unread (close it with ``aclose``).

        Raises ``Dropped`` when no answer came (connect error, or the connection closed or reset before any byte:
        the engine died, or closed a keep-alive connection just as it was reused), ``httpx.TimeoutException`` on a
        read / write / pool timeout, other ``httpx.HTTPError`` otherwise.
        """
        url = self._urls.get((worker_url, path))
        if url is None:
            url = self._urls[(worker_url, path)] = httpx.URL(worker_url + path)
        request = httpx.Request("POST", url, content=content, headers=headers, extensions=self._extensions)
        try:
            return await self.transport.handle_async_request(request)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise Dropped(failure_reason(e)) from e
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            raise Dropped(failure_reason(e)) from e


async def first_chunk(chunks: AsyncIterator[bytes]) -> bytes:
    """A stream's first body chunk (b"" for an empty body), read from ``chunks`` (``resp.aiter_raw()``, to go on
    with). A connection dropped before it raises ``Dropped``; a read timeout raises ``httpx.ReadTimeout``."""
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return b""
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        raise Dropped(f"{failure_reason(e)} before the first event") from e
