"""Why a sample stopped: a typed finish reason inside the scheduler, a dict only at the ``ReqOutput`` boundary.

The kinds are the OpenAI / SGLang ones (``stop``, ``length``, ``abort``); ``to_dict`` gives the wire form of
docs/contracts.md (``{"type": ..., "matched": ...}``, an abort may add ``message`` and ``status_code``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class FinishKind(enum.Enum):
    """``STOP``: an eos / stop token or a stop string; ``LENGTH``: max_new_tokens or the context; ``ABORT``: the
    client left, the request was invalid, the grammar failed, or the engine is stopping."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class FinishReason:
    """A finished sample's reason.

    Attributes:
        kind: see ``FinishKind``.
        matched: for ``STOP``, the token id (eos / stop token) or the stop string that matched; None otherwise (and
            for a grammar that ended without a stop token).
        message: for ``ABORT``, what the client is told.
        status_code: for ``ABORT``, the HTTP status the server answers (400 invalid request, 500 grammar failure);
            None lets the server pick.
    """

    kind: FinishKind
    matched: str | int | None = None
    message: str | None = None
    status_code: int | None = None

    @classmethod
    def stop(cls, matched: str | int | None) -> FinishReason:
        return cls(FinishKind.STOP, matched)

    @classmethod
    def length(cls) -> FinishReason:
        return cls(FinishKind.LENGTH)

    @classmethod
    def abort(cls, message: str, status_code: int | None = None) -> FinishReason:
        return cls(FinishKind.ABORT, None, message, status_code)

    @property
    def matched_stop_string(self) -> bool:
        """True when a stop string (not a token) ended the sample: its text is already trimmed, nothing to flush."""
        return self.kind is FinishKind.STOP and isinstance(self.matched, str)

    def to_dict(self) -> dict[str, Any]:
        """The ``ReqOutput.finish_reason`` form: ``{"type", "matched"}`` plus ``message`` / ``status_code`` if set."""
        d: dict[str, Any] = {"type": self.kind.value, "matched": self.matched}
        if self.message is not None:
            d["message"] = self.message
        if self.status_code is not None:
            d["status_code"] = self.status_code
        return d
