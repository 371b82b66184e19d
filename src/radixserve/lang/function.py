"""``SglFunction``: a program (a Python function whose first argument is the state ``s``) and how it is run."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from radixserve.lang.backend.base import Backend
from radixserve.lang.interpreter import ProgramState, run_program, run_program_batch
from radixserve.lang.ir import SglSamplingParams

# Keyword arguments of run / run_batch that are sampling defaults for every gen of the program (the rest are the
# program's own arguments). max_tokens is accepted as max_new_tokens.
SAMPLING_DEFAULT_NAMES = (
    "max_new_tokens",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)


def _split_sampling(
    kwargs: dict[str, Any], program_args: Sequence[str] = ()
) -> tuple[SglSamplingParams, dict[str, Any]]:
    """(the sampling defaults among ``kwargs``, the rest); a name the program takes as a parameter is the
    program's."""
    sampling = {k: kwargs.pop(k) for k in SAMPLING_DEFAULT_NAMES if k in kwargs and k not in program_args}
    max_tokens = sampling.pop("max_tokens", None)
    if max_tokens is not None and sampling.get("max_new_tokens") is None:
        sampling["max_new_tokens"] = max_tokens
    return SglSamplingParams(**sampling), kwargs


def _backend(backend: Backend | None) -> Backend:
    from radixserve.lang.global_config import global_config

    chosen = backend or global_config.default_backend
    if chosen is None:
        raise ValueError("no backend: pass backend=..., or call set_default_backend(RuntimeEndpoint(url)) first")
    return chosen


class SglFunction:
    """A program. ``f.run(**arguments)`` (or ``f(**arguments)``) runs it once, ``f.run_batch([...])`` many times.

    Args:
        func: the program; its first parameter must be named ``s``.
        num_api_spec_tokens: accepted for SGLang's API (speculative execution for API models); ignored here.
        bind_arguments: arguments fixed with ``bind``.
    """

    def __init__(
        self,
        func: Callable[..., Any],
        num_api_spec_tokens: int | None = None,
        bind_arguments: dict[str, Any] | None = None,
    ):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].name != "s":
            raise TypeError(f'the first parameter of program {func.__name__} must be named "s"')
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = [p.default for p in params[1:] if p.default is not inspect.Parameter.empty]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> SglFunction:
        """A copy of the program with these arguments fixed. Raises TypeError for a name it does not take."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.__name__} takes no argument(s) {', '.join(unknown)}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, stream: bool = False, backend: Backend | None = None, **kwargs: Any) -> ProgramState:
        """Run the program once and return its state.

        ``kwargs`` are the program's arguments, and the sampling defaults for its gens (``max_new_tokens`` or
        ``max_tokens``, ``stop``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, the penalties, ``ignore_eos``,
        the logprob fields; a name the program itself takes is its argument); a gen's own parameters win, and what
        neither sets is left to the server. ``stream``: return at once and read the text as it comes with
        ``state.text_iter()``. ``backend``: default ``global_config.default_backend``; ValueError when there is
        none.
        """
        defaults, program_kwargs = _split_sampling(dict(kwargs), self.arg_names)
        return run_program(self, _backend(backend), args, program_kwargs, defaults, stream)

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        **sampling: Any,
    ) -> list[ProgramState]:
        """Run the program once per item of ``batch_kwargs`` (a dict of arguments, or a list of positional ones),
        on ``num_threads`` threads (``"auto"``: max(96, 16 per CPU)); returns one state per item, in order.
        ``progress_bar`` shows a tqdm bar. ``sampling``: the defaults as ``run`` takes them (TypeError for another
        keyword). Raises TypeError when an item does not fit the program's parameters."""
        defaults, rest = _split_sampling(dict(sampling))
        if rest:
            raise TypeError(f"run_batch got unexpected keyword argument(s) {', '.join(sorted(rest))}")
        batch: list[dict[str, Any]] = []
        required = len(self.arg_names) - len(self.arg_defaults)
        for item in batch_kwargs:
            if isinstance(item, dict):
                batch.append(dict(item))
            elif isinstance(item, (list, tuple)) and required <= len(item) <= len(self.arg_names):
                batch.append(dict(zip(self.arg_names, item)))
            else:
                raise TypeError(f"arguments {item!r} do not fit the parameters of {self.__name__}: {self.arg_names}")
        return run_program_batch(self, _backend(backend), batch, defaults, num_threads, progress_bar)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        """``run``."""
        return self.run(*args, **kwargs)
