"""``ServerContext``: what every route handler of one app shares (the engine, token texts, request ids in flight)."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.contracts.protocol import random_id
from radixserve.engine.io_struct import InvalidRequestError
from radixserve.engine.server.chat import TemplateCaps
from radixserve.engine.server.engine_client import EngineClient
from radixserve.engine.server.reasoning import make_reasoning_stream
from radixserve.engine.server.token_text import TokenTexts


class RidRegistry:
    """Engine request ids in flight on this server, so a client reusing an ``x-request-id`` cannot clash in the engine.

    The HTTP event loop is single-threaded, so no lock is needed.
    """

    def __init__(self) -> None:
        self._live: set[str] = set()

    def claim(self, base: str, count: int) -> list[str]:
        """Reserve ``count`` unique engine rids derived from ``base`` (``base`` itself when ``count`` is 1)."""
        wanted = [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
        if any(r in self._live for r in wanted):
            suffix = random_id()[:8]
            wanted = [f"{r}-{suffix}" for r in wanted]
        self._live.update(wanted)
        return wanted

    def release(self, rids: list[str]) -> None:
        """Forget ``rids`` (their requests have ended)."""
        self._live.difference_update(rids)


@dataclass
class ServerContext:
    """Everything the route handlers need, built once per app from the engine (no module-level state)."""

    engine: EngineClient
    texts: TokenTexts
    rids: RidRegistry = field(default_factory=RidRegistry)
    _template_caps: TemplateCaps | None = None

    @classmethod
    def of(cls, engine: EngineClient) -> ServerContext:
        """The context of ``engine``. Raises ``ValueError`` for an unknown ``--reasoning-parser`` (at start-up)."""
        make_reasoning_stream(engine.args.reasoning_parser)
        return cls(engine=engine, texts=TokenTexts(engine.tokenizer))

    @property
    def template_caps(self) -> TemplateCaps:
        """The chat template's ``TemplateCaps`` (probed once, on first use)."""
        if self._template_caps is None:
            self._template_caps = TemplateCaps.probe(self.engine.tokenizer)
        return self._template_caps

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    def check_model(self, model: str | None) -> None:
        """Raise 404 unless ``model`` is None or the served model name."""
        if model is not None and model != self.model_name:
            raise InvalidRequestError(f"The model `{model}` does not exist.", "model", status_code=404)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Raise 400 (naming ``param``) unless every id is an int in ``[0, vocab_size)``."""
        vocab = self.engine.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"{param} must hold token ids in [0, {vocab})", param)
