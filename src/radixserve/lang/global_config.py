"""``global_config``: the one mutable settings object of the language (SGLang's ``sglang.global_config``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.lang.backend.base import Backend


@dataclass
class GlobalConfig:
    """Settings every program reads.

    Attributes:
        default_backend: the backend ``run`` / ``run_batch`` use when none is given (``set_default_backend``).
        verbosity: 2 or more prints each finished program's text.
        enable_precache_with_tracing: ``run_batch`` of more than one program first traces the program for the
            text it starts with whatever the arguments, and has the server cache it once (when over 64 characters),
            so the batch shares it instead of each program prefilling it.
        skip_special_tokens_in_output: gens leave special tokens out of their text (the engine's default); False
            sends ``skip_special_tokens: false``.
    """

    default_backend: Backend | None = None
    verbosity: int = 0
    enable_precache_with_tracing: bool = True
    skip_special_tokens_in_output: bool = True


global_config = GlobalConfig()
