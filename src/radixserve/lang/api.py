"""The public functions of the language, with SGLang's names and arguments: ``function``, ``gen``, ``gen_int``,
``gen_string``, ``select``, the role blocks, ``set_default_backend``."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, overload

from radixserve.lang.backend.base import Backend
from radixserve.lang.choices import ChoicesSamplingMethod, token_length_normalized
from radixserve.lang.function import SglFunction
from radixserve.lang.global_config import global_config
from radixserve.lang.ir import (
    SglExpr,
    SglExprList,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    as_expr,
    json_schema_text,
)


@overload
def function(func: Callable[..., Any], num_api_spec_tokens: int | None = None) -> SglFunction: ...
@overload
def function(
    func: None = None, num_api_spec_tokens: int | None = None
) -> Callable[[Callable[..., Any]], SglFunction]: ...
def function(
    func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None
) -> SglFunction | Callable[[Callable[..., Any]], SglFunction]:
    """Decorator making a program of ``func`` (first parameter ``s``): ``@function`` or
    ``@function(num_api_spec_tokens=N)`` (accepted for SGLang's API, ignored)."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)

    def decorator(f: Callable[..., Any]) -> SglFunction:
        return SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)

    return decorator


def set_default_backend(backend: Backend) -> None:
    """The backend programs use when ``run`` gets none."""
    global_config.default_backend = backend


def flush_cache(backend: Backend | None = None) -> bool:
    """Empty the server's prefix cache (the default backend's); False when there is no backend."""
    chosen = backend or global_config.default_backend
    if chosen is None:
        return False
    chosen.flush_cache()
    return True


def get_server_info(backend: Backend | None = None) -> dict[str, Any] | None:
    """Facts about the server and its model (the default backend's); None when there is no backend."""
    chosen = backend or global_config.default_backend
    return None if chosen is None else chosen.get_server_info()


def _unsupported(**given: Any) -> None:
    named = [k for k, v in given.items() if v is not None]
    if named:
        raise ValueError(f"radixserve does not support gen argument(s) {', '.join(named)}")


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    stop_regex: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    max_new_tokens: int | None = None,
) -> SglExpr:
    """Generate after the text so far; the result is appended and stored as variable ``name``.

    ``max_tokens`` (or ``max_new_tokens``) in tokens; ``stop`` strings are not part of the result. ``dtype`` (int,
    float, str, bool) constrains the text to that type's pattern (the variable stays text: ``int(s[name])``
    parses); ``regex`` / ``json_schema`` constrain it to a match (at most one of them). With ``choices`` it is
    ``select``. Parameters left None take the program's ``run`` defaults, else the server's. Raises re.error for an
    invalid regex and ValueError for SGLang arguments radixserve does not support (``n``, ``stop_regex``).
    ``min_tokens``: tokens generated before an end token or a stop string may end the text.
    """
    if choices:
        method = choices_method or token_length_normalized
        return select(name, choices, 0.0 if temperature is None else temperature, method)
    _unsupported(n=n, stop_regex=stop_regex)
    if regex is not None:
        re.compile(regex)
    params = SglSamplingParams(
        max_new_tokens=max_new_tokens if max_new_tokens is not None else max_tokens,
        min_new_tokens=min_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
        dtype=dtype,
        regex=regex,
        json_schema=json_schema_text(json_schema),
    )
    return SglGen(name, params)


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> SglExpr:
    """``gen`` of an integer (``dtype=int``): digits with an optional sign, ending at a space or newline."""
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> SglExpr:
    """``gen`` of a double-quoted string of letters, digits and spaces (``dtype=str``), quotes included."""
    return gen(name, max_tokens, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> SglExpr:
    """Append the choice the model scores highest after the text so far, stored as variable ``name``.

    Every choice is scored in one request by the engine's logprobs of its tokens after the shared text
    (``choices_method``: ``token_length_normalized``, the mean token logprob, by default; ``greedy_token_selection``;
    ``unconditional_likelihood_normalized``); the variable's meta info holds the logprobs. Only greedy selection
    (``temperature`` 0) is supported, as in SGLang. Raises ValueError for no choices or a choice that is not a
    non-empty string.
    """
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    if any(not isinstance(c, str) or not c for c in choices):
        raise ValueError(f"choices must be non-empty strings, got {list(choices)!r}")
    return SglSelect(name, list(choices), temperature, choices_method)


def _role(role: str, expr: SglExpr | str | None) -> SglExprList:
    if expr is None:
        return SglExprList([SglRoleBegin(role), SglRoleEnd(role)])
    return SglExprList([SglRoleBegin(role), as_expr(expr), SglRoleEnd(role)])


def system(expr: SglExpr | str | None = None) -> SglExprList:
    """A system message with content ``expr``, rendered with the model's chat template."""
    return _role("system", expr)


def user(expr: SglExpr | str | None = None) -> SglExprList:
    """A user message with content ``expr``, rendered with the model's chat template."""
    return _role("user", expr)


def assistant(expr: SglExpr | str | None = None) -> SglExprList:
    """An assistant message with content ``expr`` (typically a ``gen``), rendered with the model's chat template."""
    return _role("assistant", expr)


def system_begin() -> SglRoleBegin:
    """Open a system message (close it with ``system_end``)."""
    return SglRoleBegin("system")


def system_end() -> SglRoleEnd:
    """Close a system message."""
    return SglRoleEnd("system")


def user_begin() -> SglRoleBegin:
    """Open a user message (close it with ``user_end``)."""
    return SglRoleBegin("user")


def user_end() -> SglRoleEnd:
    """Close a user message."""
    return SglRoleEnd("user")


def assistant_begin() -> SglRoleBegin:
    """Open an assistant message (close it with ``assistant_end``)."""
    return SglRoleBegin("assistant")


def assistant_end() -> SglRoleEnd:
    """Close an assistant message."""
    return SglRoleEnd("assistant")
