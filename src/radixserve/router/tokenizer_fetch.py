"""Fetching each model's tokenizer once, from an engine serving it, for the prefix-key extractor.

The engine's ``GET /get_tokenizer_files`` gives the files; ``tokenizer.py`` rebuilds the tokenizer from them (in a
worker thread: it takes a second or so). A 404 means the engine has no servable tokenizer, a broken tokenizer is not
retried: both leave the model on character blocks for good. A transient failure (another status, a connection lost
mid-fetch) is retried on the next probe, at most ``TOKENIZER_ATTEMPTS`` times.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from radixserve.contracts import constants

logger = logging.getLogger("radixserve.router.workers")

# Transient tokenizer-fetch failures tolerated before a model routes on character blocks for good.
TOKENIZER_ATTEMPTS = 3


class TokenizerNotReady(Exception):
    """The latest attempt to fetch a model's tokenizer failed; the next probe tries again."""


@dataclass
class _Fetch:
    done: bool = False  # a tokenizer was set, or the engines said they have none (404), or we gave up
    task: asyncio.Task[None] | None = None
    failures: int = 0


class TokenizerFetcher:
    """Per-model tokenizer fetches through ``client`` (with ``headers``: the engine API key), handing each tokenizer
    to ``extractor.set_tokenizer``. ``timeout_s`` bounds one fetch. Runs on the router's event loop; no locks."""

    def __init__(self, client: httpx.AsyncClient, headers: dict[str, str], extractor: Any, timeout_s: float) -> None:
        self.client = client
        self.headers = headers
        self.extractor = extractor
        self.timeout_s = timeout_s
        self._fetches: dict[str, _Fetch] = {}

    def tasks(self) -> list[asyncio.Task[None]]:
        """The fetches under way or ended (for cancelling them on shutdown)."""
        return [f.task for f in self._fetches.values() if f.task is not None]

    def ensure(self, model: str, url: str) -> _Fetch:
        """Start fetching ``model``'s tokenizer from the engine at ``url`` unless it is settled or being fetched."""
        f = self._fetches.setdefault(model, _Fetch())
        if f.done or (f.task is not None and not f.task.done()) or self.extractor.has_tokenizer(model):
            return f
        f.task = asyncio.get_running_loop().create_task(self._fetch(model, url, f))
        return f

    async def settled(self, model: str, url: str) -> None:
        """Wait for this attempt to fetch ``model``'s tokenizer from ``url``. Raises ``TokenizerNotReady`` when it
        failed and will be retried (the worker stays pending until the next probe)."""
        f = self.ensure(model, url)
        if f.task is not None and not f.task.done():
            await asyncio.shield(f.task)
        if not f.done and not self.extractor.has_tokenizer(model):
            raise TokenizerNotReady(f"tokenizer for {model} not loaded yet")

    async def _fetch(self, model: str, url: str, f: _Fetch) -> None:
        try:
            r = await self.client.get(
                url + constants.ENGINE_TOKENIZER_FILES_PATH, headers=self.headers, timeout=self.timeout_s
            )
            if r.status_code == 404:
                f.done = True  # this engine has no servable tokenizer: character blocks for this model
                logger.info("model %s: no tokenizer from %s; routing on character blocks", model, url)
                return
            if r.status_code != 200:
                f.failures += 1
                if f.failures >= TOKENIZER_ATTEMPTS:
                    f.done = True
                    logger.warning(
                        "model %s: %s answered %d for its tokenizer %d times; routing on character blocks",
                        model,
                        url,
                        r.status_code,
                        f.failures,
                    )
                return  # try again on the next probe
            files = r.json().get("files")
            if not isinstance(files, dict) or not files:
                f.done = True
                return
            from radixserve.router.tokenizer import tokenizer_from_files

            tokenizer = await asyncio.to_thread(tokenizer_from_files, files)
            self.extractor.set_tokenizer(model, tokenizer)
            f.done = True
            logger.info("model %s: tokenizer from %s; routing on token blocks", model, url)
        except asyncio.CancelledError:
            raise
        except httpx.TransportError as e:  # the engine went away mid-fetch: try again on the next probe
            f.failures += 1
            f.done = f.failures >= TOKENIZER_ATTEMPTS
            logger.info("model %s: tokenizer fetch from %s failed: %s", model, url, _describe(e))
        except Exception as e:  # a broken tokenizer must not stop routing: character blocks stay
            f.done = True
            logger.warning(
                "model %s: tokenizer from %s unusable (%s); routing on character blocks", model, url, _describe(e)
            )


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
