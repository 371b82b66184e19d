"""Running programs: the executor behind a program state, the state ``s`` a program sees, fork groups, and
``run_program`` / ``run_program_batch`` (SGLang's ``interpreter.py``).

Each executor runs its expressions in order on its own worker thread: ``s += gen(...)`` queues the gen and returns at
once, and reading a result (``s["x"]``, ``s.text()``) waits for it. So the forks of a state, each with its own thread,
generate concurrently. Every gen sends the program's whole text so far: the engine's radix cache serves the part an
earlier request of the program already prefilled, and a router keying on the prompt's prefix keeps the program on
the engine that holds it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from radixserve.lang.chat_template import ChatTemplate
from radixserve.lang.ir import (
    SglArgument,
    SglConcateAndAppend,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    SglVarScopeBegin,
    SglVarScopeEnd,
    as_expr,
)

if TYPE_CHECKING:
    from radixserve.lang.backend.base import Backend, PrefixTokens
    from radixserve.lang.function import SglFunction

logger = logging.getLogger("radixserve.lang")

# Uncached text shorter than this (characters) is not worth a request of its own before a batch or a fork: each
# program or fork prefilling it costs less than the round trip (SGLang's threshold for a traced prefix).
PRECACHE_MIN_CHARS = 64


class ProgramError(RuntimeError):
    """A variable was read whose expression never ran because an earlier one of the program failed."""


class StreamExecutor:
    """Runs one program state's expressions against ``backend``, in order, on a worker thread (or in the caller's
    thread with ``use_thread=False``). Holds the text, chat messages, variables and their meta info.

    Args:
        backend: the server to call.
        arguments: the program's arguments (for reference).
        default_sampling_para: the ``run`` defaults under every gen's own parameters.
        chat_template: role markers; the backend's when None.
        stream: gens stream their text as it is produced (``text_iter``).
        use_thread: run on a worker thread (False: ``submit`` runs the expression at once and raises its error).
    """

    def __init__(
        self,
        backend: Backend,
        arguments: dict[str, Any],
        default_sampling_para: SglSamplingParams,
        chat_template: ChatTemplate | None = None,
        stream: bool = False,
        use_thread: bool = True,
    ):
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_para = default_sampling_para
        self.stream = stream
        self.variables: dict[str | None, Any] = {}
        self.variable_event: dict[str | None, threading.Event] = {}
        self.meta_info: dict[str | None, dict[str, Any]] = {}
        self.is_finished = False
        self.error_: BaseException | None = None
        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.chat_template = chat_template or backend.get_chat_template()
        self.cur_role: str | None = None
        self.cur_role_begin_pos = 0
        self.fork_start_text_pos: int | None = None
        # The longest prefix of text_ whose token count a response told us (for select's logprob_start_len).
        self.known_prefix: PrefixTokens | None = None
        # How much of text_ the server has processed (a request's prompt and completion): in its radix cache.
        self.cached_chars = 0
        self.stream_text_event = threading.Event() if stream else None
        self.stream_var_event: dict[str | None, threading.Event] = {}
        self.use_thread = use_thread
        self._ended = False
        if use_thread:
            self.queue: queue.Queue[SglExpr | None] = queue.Queue()
            self.worker = threading.Thread(target=self._worker, name=f"sgl-{self.sid[:8]}", daemon=True)
            self.worker.start()

    # -- submitting and waiting ----------------------------------------------------------------------------------

    def submit(self, expr: SglExpr) -> None:
        """Queue ``expr`` (run it now with ``use_thread=False``)."""
        self._init_var_event(expr)
        if self.use_thread:
            self.queue.put(expr)
        else:
            self._execute(expr)

    def sync(self) -> None:
        """Wait until every queued expression has run (or been skipped after an error)."""
        if self.use_thread:
            self.queue.join()

    def end(self) -> None:
        """No more expressions: the worker thread exits once the queue is drained. Idempotent."""
        if self.use_thread and not self._ended:
            self._ended = True
            self.queue.put(None)

    def _worker(self) -> None:
        while True:
            expr = self.queue.get()
            try:
                if expr is None:
                    break
                if self.error_ is None:
                    try:
                        self._execute(expr)
                    except Exception as e:  # noqa: BLE001 - kept for s.error() and raised where a result is read
                        logger.warning("program %s failed: %s: %s", self.sid[:8], type(e).__name__, e)
                        self.error_ = e
                        self._release_waiters()
            finally:
                self.queue.task_done()
                if self.stream_text_event is not None:
                    self.stream_text_event.set()
        self.is_finished = True
        if self.stream_text_event is not None:
            self.stream_text_event.set()

    def _release_waiters(self) -> None:
        for event in [*self.variable_event.values(), *self.stream_var_event.values()]:
            event.set()

    def _init_var_event(self, expr: SglExpr) -> None:
        if isinstance(expr, (SglGen, SglSelect, SglVarScopeBegin)):
            self.variable_event[expr.name] = threading.Event()
            if self.stream:
                self.stream_var_event[expr.name] = threading.Event()
            if self.error_ is not None:
                self._release_waiters()
        elif isinstance(expr, SglExprList):
            for e in expr.expr_list:
                self._init_var_event(e)

    # -- reading results -----------------------------------------------------------------------------------------

    def get_var(self, name: str | None) -> Any:
        """Variable ``name``, once its expression has run. Raises ``ProgramError`` when an earlier failure kept it
        from running, KeyError for a name the program never set."""
        if name in self.variable_event:
            self.variable_event[name].wait()
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise ProgramError(f"variable {name!r} was not set: the program failed: {self.error_}") from self.error_
        raise KeyError(name)

    def set_var(self, name: str | None, value: Any) -> None:
        """Set variable ``name``."""
        self.variables[name] = value

    def get_meta_info(self, name: str | None, timeout: float | None = None) -> dict[str, Any] | None:
        """The server's meta info of variable ``name``'s gen or select (None when it has none), once it ran. Raises
        TimeoutError after ``timeout`` seconds."""
        if name in self.variable_event and not self.variable_event[name].wait(timeout):
            raise TimeoutError(f"timed out waiting for {name!r}")
        return self.meta_info.get(name)

    def text(self) -> str:
        """The whole text, once every queued expression has run."""
        self.sync()
        return self.text_

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages (``{"role", "content"}``) closed so far, once every queued expression has run."""
        self.sync()
        return self.messages_

    def error(self) -> BaseException | None:
        """The error that stopped the program, if any."""
        self.sync()
        return self.error_

    # -- forks ---------------------------------------------------------------------------------------------------

    def fork(self, size: int = 1) -> list[StreamExecutor]:
        """``size`` executors that continue from this one's text, messages and variables. With more than one, and
        more than ``PRECACHE_MIN_CHARS`` of the text not sent to the server yet, the text is prefilled into its
        cache first (SGLang's commit before a fork), so the forks share it."""
        self.sync()
        size = int(size)
        if size > 1 and len(self.text_) - self.cached_chars > PRECACHE_MIN_CHARS and self.error_ is None:
            self.known_prefix = (len(self.text_), self.backend.cache_prefix(self.text_))
            self.cached_chars = len(self.text_)
        children = []
        for _ in range(size):
            child = StreamExecutor(
                self.backend, self.arguments, self.default_sampling_para, self.chat_template, self.stream
            )
            child.variables = dict(self.variables)
            child.text_ = self.text_
            child.messages_ = list(self.messages_)
            child.cur_role = self.cur_role
            child.cur_role_begin_pos = self.cur_role_begin_pos
            child.fork_start_text_pos = len(self.text_)
            child.known_prefix = self.known_prefix
            child.cached_chars = self.cached_chars
            children.append(child)
        return children

    # -- running expressions -------------------------------------------------------------------------------------

    def _execute(self, expr: SglExpr) -> None:
        if isinstance(expr, SglConstantText):
            self._fill(expr.value)
        elif isinstance(expr, SglGen):
            self._execute_gen(expr)
        elif isinstance(expr, SglSelect):
            self._execute_select(expr)
        elif isinstance(expr, SglExprList):
            for e in expr.expr_list:
                self._execute(e)
        elif isinstance(expr, SglRoleBegin):
            self._execute_role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._execute_role_end(expr.role)
        elif isinstance(expr, SglVarScopeBegin):
            self.variables[expr.name] = len(self.text_)
        elif isinstance(expr, SglVarScopeEnd):
            self.variables[expr.name] = self.text_[self.variables[expr.name] :]
            self.variable_event[expr.name].set()
        elif isinstance(expr, SglConcateAndAppend):
            self._execute_concatenate_and_append(expr)
        elif isinstance(expr, SglArgument):
            raise TypeError(f"argument {expr.name!r} is not known while tracing")
        else:
            raise TypeError(f"cannot append {type(expr).__name__} to a program state")

    def _fill(self, value: str) -> None:
        self.text_ += value

    def _remember_prefix(self, chars: int, meta_info: dict[str, Any]) -> None:
        tokens = meta_info.get("prompt_tokens")
        if isinstance(tokens, int) and (self.known_prefix is None or chars >= self.known_prefix[0]):
            self.known_prefix = (chars, tokens)

    def _execute_gen(self, expr: SglGen) -> None:
        params = self._resolve_sampling_params(expr.sampling_params)
        name, prompt_chars = expr.name, len(self.text_)
        if not self.stream:
            completion, meta_info = self.backend.generate(self.text_, params)
            self._remember_prefix(prompt_chars, meta_info)
            self.text_ += completion
            self.cached_chars = len(self.text_)
            self.variables[name] = completion
            self.meta_info[name] = meta_info
            self.variable_event[name].set()
            return
        assert self.stream_text_event is not None
        self.variables[name] = ""
        self.stream_var_event[name].set()
        meta: dict[str, Any] = {}
        for piece, meta in self.backend.generate_stream(self.text_, params):
            self.text_ += piece
            self.variables[name] += piece
            self.meta_info[name] = meta
            self.stream_var_event[name].set()
            self.stream_text_event.set()
        self._remember_prefix(prompt_chars, meta)
        self.cached_chars = len(self.text_)
        self.variable_event[name].set()
        self.stream_var_event[name].set()

    def _execute_select(self, expr: SglSelect) -> None:
        if expr.temperature > 1e-5:
            raise ValueError(f"select samples greedily only (temperature 0), got temperature {expr.temperature}")
        decision = self.backend.select(self.text_, expr.choices, expr.choices_method, self.known_prefix)
        prompt_tokens = decision.meta_info.get("prompt_tokens")
        if isinstance(prompt_tokens, list) and decision.decision in expr.choices:
            tokens = prompt_tokens[expr.choices.index(decision.decision)]
            if isinstance(tokens, int):
                self.known_prefix = (len(self.text_) + len(decision.decision), tokens)
        self.text_ += decision.decision
        self.cached_chars = len(self.text_)
        if expr.name is not None:
            self.variables[expr.name] = decision.decision
            self.meta_info[expr.name] = decision.meta_info
            self.variable_event[expr.name].set()
            if expr.name in self.stream_var_event:
                self.stream_var_event[expr.name].set()

    def _execute_role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"nested roles are not allowed: {role} inside {self.cur_role}")
        if not self.messages_ and role != "system" and self.chat_template.default_system_prompt:
            self._execute_role_begin("system")  # the system message the template inserts by itself
            self._fill(self.chat_template.default_system_prompt)
            self._execute_role_end("system")
        self.cur_role = role
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _execute_role_end(self, role: str) -> None:
        content = self.text_[self.cur_role_begin_pos :].lstrip()
        self.cur_role = None
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(suffix)
        self.messages_.append({"role": role, "content": content})

    def _execute_concatenate_and_append(self, expr: SglConcateAndAppend) -> None:
        added = ""
        for state in expr.states:
            exe = state.stream_executor
            exe.sync()
            start = exe.fork_start_text_pos or 0
            added += exe.text_[start:]
        self._fill(added)

    def _resolve_sampling_params(self, params: SglSamplingParams) -> SglSamplingParams:
        """The ``run`` defaults under the gen's own parameters, the chat template's stop strings added (as SGLang
        does), ``dtype`` turned into its regex."""
        resolved = self.default_sampling_para.override(params)
        if self.chat_template.stop_str:
            stop = resolved.stop_list()
            resolved = resolved.override(
                SglSamplingParams(stop=[*stop, *(s for s in self.chat_template.stop_str if s not in stop)])
            )
        return resolved.with_dtype_regex()


class ProgramState:
    """The ``s`` of a program: append with ``s += ...``, read with ``s[name]``, ``s.text()``, ``s.messages()``."""

    def __init__(self, stream_executor: StreamExecutor):
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    def _role_common(self, role: str, expr: SglExpr | str | None) -> Any:
        if expr is not None:
            role_expr = SglExprList([SglRoleBegin(role), as_expr(expr), SglRoleEnd(role)])
            self.stream_executor.submit(role_expr)
            return role_expr

        @contextmanager
        def role_scope() -> Iterator[None]:
            self.stream_executor.submit(SglRoleBegin(role))
            yield
            self.stream_executor.submit(SglRoleEnd(role))

        return role_scope()

    def system(self, expr: SglExpr | str | None = None) -> Any:
        """Append a system message (``expr``), or with no argument a context manager whose body is the message."""
        return self._role_common("system", expr)

    def user(self, expr: SglExpr | str | None = None) -> Any:
        """Append a user message, or a context manager (as ``system``)."""
        return self._role_common("user", expr)

    def assistant(self, expr: SglExpr | str | None = None) -> Any:
        """Append an assistant message, or a context manager (as ``system``)."""
        return self._role_common("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Capture the text appended inside the ``with`` block as variable ``name``."""
        self.stream_executor.submit(SglVarScopeBegin(name))
        yield
        self.stream_executor.submit(SglVarScopeEnd(name))

    def fork(self, size: int = 1) -> ProgramStateGroup:
        """``size`` states continuing from this one (run concurrently); ``join`` brings their results back."""
        return ProgramStateGroup([ProgramState(e) for e in self.stream_executor.fork(size)], self)

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        """A fork of one, joined (gathering its variables) when the ``with`` block ends."""
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def text(self) -> str:
        """The whole text (waits for queued expressions)."""
        return self.stream_executor.text()

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages, in order (waits for queued expressions)."""
        return self.stream_executor.messages()

    def sync(self) -> None:
        """Wait for queued expressions."""
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        """The error that stopped the program, if any (waits for queued expressions)."""
        return self.stream_executor.error()

    def get_var(self, name: str | None) -> Any:
        """Variable ``name`` (waits for it; see ``StreamExecutor.get_var`` for the errors)."""
        return self.stream_executor.get_var(name)

    def set_var(self, name: str | None, value: Any) -> None:
        """Set variable ``name``."""
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str | None) -> dict[str, Any] | None:
        """The server's meta info of variable ``name`` (``prompt_tokens``, ``cached_tokens``, ``finish_reason``,
        logprobs when asked; for a select the choices' logprobs)."""
        return self.stream_executor.get_meta_info(name)

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is produced: the whole program's (``var_name`` None) or one variable's, in pieces that
        join to it. Without ``stream=True`` one piece, once it is done."""
        exe = self.stream_executor
        if not exe.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        assert exe.stream_text_event is not None
        prev = 0
        if var_name is None:
            event = exe.stream_text_event
            while True:
                event.wait()
                event.clear()
                finished = exe.is_finished
                out = exe.text_[prev:]
                prev += len(out)
                if out:
                    yield out
                if finished:
                    return
        var_event: threading.Event | None = None
        while var_event is None:
            var_event = exe.stream_var_event.get(var_name)
            if var_event is None:
                if exe.is_finished:
                    return
                exe.stream_text_event.wait(0.05)
        while True:
            var_event.wait()
            var_event.clear()
            done = exe.variable_event[var_name].is_set()
            value = exe.variables.get(var_name, "")
            out = value[prev:]
            prev += len(out)
            if out:
                yield out
            if done:
                return

    def __iadd__(self, other: SglExpr | str) -> ProgramState:
        if other is None:
            raise ValueError("tried to append None to a program state")
        self.stream_executor.submit(as_expr(other))
        return self

    def __getitem__(self, name: str | None) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str | None, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str | None) -> bool:
        return name in self.stream_executor.variables

    def __del__(self) -> None:
        self.stream_executor.end()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The states ``s.fork(n)`` made. ``forks += expr`` appends to each (a callable gets the fork's index, a list
    gives one item per fork); ``join`` brings them back into the source state."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState):
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        """``"gather_variable"``: each variable the forks set and the source did not have becomes a list in the
        source, one value per fork; ``"concate_and_append"``: the source's text gets what each fork added, in
        order. Raises ValueError for another mode."""
        if mode == "gather_variable":
            src_vars = self.src_state.stream_executor.variables
            before = set(src_vars)
            for child in self.states:
                child.stream_executor.sync()
                for name, value in child.stream_executor.variables.items():
                    if name not in before:
                        src_vars.setdefault(name, []).append(value)
        elif mode == "concate_and_append":
            self.src_state += SglConcateAndAppend(self.states)
            self.src_state.stream_executor.sync()
        else:
            raise ValueError(f"invalid join mode {mode!r}: use 'gather_variable' or 'concate_and_append'")
        for child in self.states:
            child.stream_executor.end()

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Callable[[int], SglExpr | str] | SglExpr | str | Sequence[SglExpr | str]) -> Any:
        if isinstance(other, (SglExpr, str)):
            for state in self.states:
                state += other
        elif callable(other):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} items for {len(self.states)} forks")
            for state, item in zip(self.states, other):
                state += item
        else:
            raise TypeError(f"cannot append {type(other).__name__} to forks")
        return self


# ----------------------------------------------------------------------------------------------------------------------
# Running programs
# ----------------------------------------------------------------------------------------------------------------------


def _run_body(state: ProgramState, program: SglFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    from radixserve.lang.global_config import global_config

    try:
        state.ret_value = program.func(state, *args, **kwargs)
    finally:
        state.stream_executor.end()
    state.stream_executor.sync()
    if global_config.verbosity >= 2:
        print(state.text())


def run_program(
    program: SglFunction,
    backend: Backend,
    func_args: tuple[Any, ...],
    func_kwargs: dict[str, Any],
    default_sampling_para: SglSamplingParams,
    stream: bool,
) -> ProgramState:
    """Run ``program`` with its arguments. Not streaming: returns when every expression has run (an exception in
    the program's own code is raised; a failed request is ``state.error()`` and raised where its result is read).
    Streaming: the program runs on a thread and the state is returned at once (read it with ``text_iter``)."""
    kwargs = {**program.bind_arguments, **func_kwargs}
    executor = StreamExecutor(backend, kwargs, default_sampling_para, stream=stream)
    state = ProgramState(executor)
    if stream:
        threading.Thread(target=_run_body, args=(state, program, func_args, kwargs), daemon=True).start()
    else:
        _run_body(state, program, func_args, kwargs)
    return state


class _StopTracing(Exception):
    """The traced program reached something that depends on its arguments or the model."""


class _TracingBackend:
    """A backend that stops the trace at the first request (the chat template is the real backend's)."""

    def __init__(self, chat_template: ChatTemplate):
        self.chat_template = chat_template

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def _stop(self, *_: Any) -> Any:
        raise _StopTracing

    generate = generate_stream = select = cache_prefix = flush_cache = get_server_info = _stop


def extract_prefix_by_tracing(program: SglFunction, backend: Backend, argument_names: Sequence[str]) -> str:
    """The text ``program`` appends before anything that depends on the arguments named ``argument_names`` (stand-ins
    that stop the trace when used) or on the model (the first gen or select). Runs the program's own code up to that
    point; any exception there ends the trace too."""
    executor = StreamExecutor(
        _TracingBackend(backend.get_chat_template()),
        {},
        SglSamplingParams(),
        stream=False,
        use_thread=False,
    )
    state = ProgramState(executor)
    kwargs: dict[str, Any] = {**program.bind_arguments, **{n: SglArgument(n) for n in argument_names}}
    try:
        program.func(state, **kwargs)
    except Exception:  # noqa: BLE001 - _StopTracing, or the program using an argument's value
        pass
    return executor.text_


def run_program_batch(
    program: SglFunction,
    backend: Backend,
    batch_arguments: list[dict[str, Any]],
    default_sampling_para: SglSamplingParams,
    num_threads: int | str,
    progress_bar: bool,
) -> list[ProgramState]:
    """Run ``program`` once per arguments dict on ``num_threads`` threads (``"auto"``: max(96, 16 per CPU), at
    most one per program); returns the states in input order. ``progress_bar`` shows a tqdm bar. With
    ``global_config.enable_precache_with_tracing`` the prefix common to every program is cached first."""
    from radixserve.lang.global_config import global_config

    if not batch_arguments:
        return []
    if global_config.enable_precache_with_tracing and len(batch_arguments) > 1:
        names = sorted({name for arguments in batch_arguments for name in arguments})
        prefix = extract_prefix_by_tracing(program, backend, names)
        if len(prefix) > PRECACHE_MIN_CHARS:
            backend.cache_prefix(prefix)
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or an integer >= 1, got {num_threads!r}")
    num_threads = min(num_threads, len(batch_arguments))

    def one(arguments: dict[str, Any]) -> ProgramState:
        return run_program(program, backend, (), arguments, default_sampling_para, False)

    bar = _progress_bar(len(batch_arguments)) if progress_bar else None
    try:
        if num_threads == 1:
            states = []
            for arguments in batch_arguments:
                states.append(one(arguments))
                if bar is not None:
                    bar.update()
            return states
        with ThreadPoolExecutor(num_threads) as pool:
            futures = [pool.submit(one, arguments) for arguments in batch_arguments]
            if bar is not None:
                for f in futures:
                    f.add_done_callback(lambda _: bar.update())
            return [f.result() for f in futures]
    finally:
        if bar is not None:
            bar.close()


def _progress_bar(total: int) -> Any:
    import tqdm

    return tqdm.tqdm(total=total)
