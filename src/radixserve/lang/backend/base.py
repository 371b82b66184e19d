"""The seam between the interpreter and a server: what a backend must do for a program.

``RuntimeEndpoint`` (native ``/generate`` over HTTP) is the real one; tests run programs on an in-process fake that
implements the same protocol.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from radixserve.lang.chat_template import ChatTemplate
from radixserve.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from radixserve.lang.ir import SglSamplingParams

# A prefix of a program's text whose token count is known: (its length in characters, its prompt tokens), from a
# request the program sent earlier (``meta_info.prompt_tokens``).
PrefixTokens = tuple[int, int]


class Backend(Protocol):
    """What the interpreter calls. Every method may be called from several threads at once (forks, run_batch)."""

    def get_chat_template(self) -> ChatTemplate:
        """The role markers ``s.user()`` / ``s.assistant()`` ... render with."""
        ...

    def generate(self, text: str, params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        """Generate after ``text`` (the program's text so far): the completion and the server's ``meta_info``."""
        ...

    def generate_stream(self, text: str, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        """As ``generate``, as it is produced: (new text, meta info so far) pieces; their texts join to the
        completion."""
        ...

    def select(
        self,
        text: str,
        choices: Sequence[str],
        method: ChoicesSamplingMethod,
        prefix: PrefixTokens | None,
    ) -> ChoicesDecision:
        """The choice ``method`` picks from the logprobs of each choice's tokens after ``text``. ``prefix`` is a
        prefix of ``text`` with a known token count (None: none known). The decision's ``meta_info`` adds
        ``prompt_tokens``: the token count of ``text`` + each choice."""
        ...

    def cache_prefix(self, text: str) -> int:
        """Have ``text`` prefilled into the server's prefix cache (before forks share it); returns its prompt
        tokens."""
        ...

    def flush_cache(self) -> None:
        """Empty the server's prefix cache."""
        ...

    def get_server_info(self) -> dict[str, Any]:
        """Facts about the server and its model."""
        ...
