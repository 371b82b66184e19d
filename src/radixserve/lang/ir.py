"""The expressions a program appends to its state (``s += ...``), and the sampling parameters of a ``gen``.

Mirrors SGLang's ``sglang.lang.ir`` names: ``SglGen``, ``SglSelect``, ``SglConstantText``, ``SglRoleBegin`` ... An
expression is data; the interpreter (``interpreter.py``) runs it against a backend. ``a + b`` of an expression and a
string or another expression is an ``SglExprList``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.lang.choices import ChoicesSamplingMethod
    from radixserve.lang.interpreter import ProgramState

# What a ``dtype`` gen is constrained to (SGLang's patterns); int and float also stop at a space or newline.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

# Fields of ``SglSamplingParams`` sent in ``sampling_params`` (native /generate names), and those sent beside it.
_SAMPLING_KEYS = (
    "max_new_tokens",
    "min_new_tokens",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
    "regex",
    "json_schema",
)
_REQUEST_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


@dataclass
class SglSamplingParams:
    """Sampling parameters of one ``gen``; None means "not set": the program's ``run`` defaults apply, else the
    server's own defaults (an engine's ``--preferred-sampling-params``, ``max_new_tokens`` 128).

    Units: ``max_new_tokens`` in tokens; ``temperature`` 0 is greedy; ``top_k`` -1 is off. ``dtype`` (``int``,
    ``float``, ``str``, ``bool`` or their names) becomes a regex when the request is built (``with_dtype_regex``).
    """

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: type | str | None = None
    regex: str | None = None
    json_schema: str | None = None

    def override(self, other: SglSamplingParams) -> SglSamplingParams:
        """A copy of these parameters with every field ``other`` sets replacing ours."""
        changes = {f.name: getattr(other, f.name) for f in fields(other) if getattr(other, f.name) is not None}
        return replace(self, **changes)

    def stop_list(self) -> list[str]:
        """``stop`` as a list (a single string is one stop string)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def with_dtype_regex(self) -> SglSamplingParams:
        """``dtype`` turned into its regex (and, for int and float, the stop strings " " and "\\n"), as SGLang's
        runtime endpoint does; a regex given too is replaced, with a warning. Raises ValueError for another dtype."""
        if self.dtype is None:
            return self
        stop = self.stop_list()
        if self.dtype in (int, "int"):
            regex, stop = REGEX_INT, [*stop, " ", "\n"]
        elif self.dtype in (float, "float"):
            regex, stop = REGEX_FLOAT, [*stop, " ", "\n"]
        elif self.dtype in (str, "str"):
            regex = REGEX_STR
        elif self.dtype in (bool, "bool"):
            regex = REGEX_BOOL
        else:
            raise ValueError(f"invalid dtype {self.dtype!r}: use int, float, str or bool")
        if self.regex is not None:
            warnings.warn(f"both dtype and regex are set; dtype {self.dtype!r} wins", stacklevel=2)
        return replace(self, regex=regex, stop=stop, dtype=None)

    def to_srt_kwargs(self) -> dict[str, Any]:
        """The native ``/generate`` ``sampling_params``: the fields that are set, ``stop`` as a list."""
        out: dict[str, Any] = {}
        for key in _SAMPLING_KEYS:
            value = getattr(self, key)
            if value is None:
                continue
            if key == "stop":
                value = self.stop_list()
                if not value:
                    continue
            elif key == "stop_token_ids":
                value = list(value)
            out[key] = value
        return out

    def request_kwargs(self) -> dict[str, Any]:
        """The logprob fields of the ``/generate`` body (``return_logprob`` ...) that are set."""
        return {key: getattr(self, key) for key in _REQUEST_KEYS if getattr(self, key) is not None}


class SglExpr:
    """An expression: appended to a program state with ``s += expr``; ``expr + "text"`` concatenates."""

    def __add__(self, other: str | SglExpr) -> SglExprList:
        return concatenate(self, as_expr(other))

    def __radd__(self, other: str | SglExpr) -> SglExprList:
        return concatenate(as_expr(other), self)


def as_expr(x: object) -> SglExpr:
    """``x`` as an expression: a string (or anything but an expression: its ``str``) is constant text."""
    if isinstance(x, SglExpr):
        return x
    return SglConstantText(str(x))


def concatenate(a: SglExpr, b: SglExpr) -> SglExprList:
    """``a`` then ``b`` as one flat ``SglExprList``."""
    left = a.expr_list if isinstance(a, SglExprList) else [a]
    right = b.expr_list if isinstance(b, SglExprList) else [b]
    return SglExprList([*left, *right])


class SglExprList(SglExpr):
    """Expressions run in order."""

    def __init__(self, expr_list: list[SglExpr]):
        self.expr_list = expr_list

    def __repr__(self) -> str:
        return f"ExprList({self.expr_list})"


class SglConstantText(SglExpr):
    """Text appended as it is."""

    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class SglGen(SglExpr):
    """Generate from the text so far; the result is appended and stored as variable ``name``."""

    def __init__(self, name: str | None, sampling_params: SglSamplingParams):
        self.name = name
        self.sampling_params = sampling_params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class SglSelect(SglExpr):
    """Append the choice the model scores highest after the text so far; stored as variable ``name``."""

    def __init__(self, name: str | None, choices: list[str], temperature: float, choices_method: ChoicesSamplingMethod):
        self.name = name
        self.choices = choices
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class SglRoleBegin(SglExpr):
    """Open a chat message of ``role``: its prefix from the chat template."""

    def __init__(self, role: str):
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class SglRoleEnd(SglExpr):
    """Close the chat message of ``role``: its suffix, and the message recorded for ``s.messages()``."""

    def __init__(self, role: str):
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class SglVarScopeBegin(SglExpr):
    """Start capturing the text appended from here as variable ``name``."""

    def __init__(self, name: str):
        self.name = name


class SglVarScopeEnd(SglExpr):
    """Stop capturing variable ``name``."""

    def __init__(self, name: str):
        self.name = name


class SglConcateAndAppend(SglExpr):
    """Append what each of the fork ``states`` added after the fork (``join("concate_and_append")``)."""

    def __init__(self, states: list[ProgramState]):
        self.states = states


class SglArgument(SglExpr):
    """A program argument not known yet (a stand-in while tracing a program for its constant prefix): any use of
    its value stops the trace."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Argument({self.name!r})"

    def _unknown(self, *_: Any) -> Any:
        raise TypeError(f"argument {self.name!r} is not known while tracing")

    __str__ = __format__ = __len__ = __iter__ = __bool__ = __int__ = __float__ = __getitem__ = _unknown


def json_schema_text(schema: str | dict[str, Any] | None) -> str | None:
    """A JSON schema as the engine takes it (text); a dict is serialized."""
    if schema is None or isinstance(schema, str):
        return schema
    return json.dumps(schema)
