"""Grammar backend on xgrammar: compile JSON schemas, regexes and EBNF into token-level matchers.

Design after SGLang's ``XGrammarGrammarBackend`` (srt/constrained/xgrammar_backend.py) and xgrammar itself (Dong et al.,
"XGrammar: Flexible and Efficient Structured Generation Engine for Large Language Models", 2024):

- one ``xgrammar.TokenizerInfo`` for the engine's tokenizer (vocab size = the model's logits width, stop tokens = eos);
- compiled grammars are cached by ``(kind, text)`` in a bounded LRU; failures are cached too, so a repeated bad grammar
  is a fast 400 again;
- compilation runs on a small pool of worker threads (xgrammar releases the GIL), never on the scheduler loop or the
  event loop; callers await a future ("grammar queue"), and only a compiled grammar reaches the scheduler. Several
  workers, so a trivial grammar never waits behind one heavy compile; the compile timeout counts from the moment this
  grammar's own compile starts (queue time is limited separately and answered 503, not blamed on the grammar); a
  compile that exceeds its timeout is cached as a failure; a queued compile whose callers all left is cancelled;
- JSON-Schema keywords xgrammar does not enforce are refused with a 400 naming the keyword and its JSON pointer
  (``check_schema_supported``), never silently ignored;
- each generated sample gets its own ``xgrammar.GrammarMatcher`` (``Grammar.matcher()``), which sees only generated
  tokens (never the prompt), so radix-cache hits and retraction do not touch grammar state.

JSON is compact by default (``separators=(",", ":")``, no free whitespace) and unconstrained numbers have a bounded
number of digits: a small model otherwise loops on spaces, newlines or digits until max_tokens.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import re
import threading
import time
from typing import Any

from radixserve.engine.io_struct import InvalidRequestError

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
# Compiled grammars kept (a compiled JSON schema is tens of KiB; 256 of them stay well under 100 MiB).
DEFAULT_CACHE_SIZE = 256
# A caller stops waiting after its grammar has compiled this long (seconds, from the start of that compile, not of the
# wait) and gets a 400; the failure is cached. The compile itself still runs to the end: xgrammar cannot be interrupted.
DEFAULT_COMPILE_TIMEOUT_S = 60.0
# A caller whose compile has not even started after this long (every worker busy) gets a 503: the server is busy, the
# grammar is not at fault, nothing is cached.
DEFAULT_QUEUE_TIMEOUT_S = 60.0
# Compile worker threads. Several, so one heavy grammar does not hold up every other new one; each compile uses one
# xgrammar thread (``COMPILE_THREADS``), so on a 2-core machine a heavy compile leaves a core to the forward pass and
# to the trivial compiles next to it (the OS time-slices the workers).
DEFAULT_COMPILE_WORKERS = 4
COMPILE_THREADS = 1
JSON_SEPARATORS = (",", ":")

# xgrammar's C++ errors read "[04:25:53] /project/cpp/json_schema_converter.cc:5082: Schema should be ..."
_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def clean_error(exc: BaseException) -> str:
    """xgrammar's error text without the C++ log prefix (time, source file, line); first line only."""
    text = str(exc).strip()
    text = _LOG_PREFIX.sub("", text)
    text = _CHECK_PREFIX.sub("", text)
    return text.splitlines()[0].strip() if text else type(exc).__name__


class Grammar:
    """A compiled grammar; ``matcher()`` makes a fresh per-sample matcher (initial state, nothing accepted)."""

    def __init__(self, kind: str, text: str, compiled: Any):
        self.kind = kind
        self.text = text
        self.compiled = compiled

    def matcher(self) -> Any:
        """A new ``xgrammar.GrammarMatcher`` for one sample."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, {len(self.text)} chars)"


class _Compile:
    """One cache entry: the compile future, when its compile started (``time.monotonic()``, None while queued) and
    how many callers are waiting for it."""

    __slots__ = ("future", "started", "waiters")

    def __init__(self, future: concurrent.futures.Future[Grammar] | None = None):
        self.future: concurrent.futures.Future[Grammar] = future if future is not None else concurrent.futures.Future()
        self.started: float | None = None
        self.waiters = 0


def _done_event(fut: concurrent.futures.Future[Any]) -> asyncio.Future[None]:
    """An event-loop future that completes (with None) once ``fut`` is done; cancelling it leaves ``fut`` alone
    (unlike ``asyncio.wrap_future``), and it never holds ``fut``'s exception (so nothing is reported unretrieved)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    def wake(_: concurrent.futures.Future[Any]) -> None:
        try:
            loop.call_soon_threadsafe(finish)
        except RuntimeError:  # that loop has closed; nobody is waiting
            pass

    fut.add_done_callback(wake)
    return done


class GrammarBackend:
    """Compiles and caches grammars for one engine.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed ``len(tokenizer)``; extra ids are never allowed).
        stop_token_ids: the engine's eos ids; a grammar ends by accepting one of them.
        cache_size: compiled grammars (and compile failures) kept, LRU.
        metrics: ``EngineMetrics`` or None (``grammar_compile_seconds``, ``grammar_cache_hits_total``).
        compile_timeout_s: the longest one grammar may compile, seconds, counted from the start of its own compile.
        queue_timeout_s: the longest a caller waits for its compile to start (all workers busy), seconds.
        num_workers: compile worker threads.

    Thread-safety: ``future`` / ``get`` / ``get_sync`` may be called from any thread or event loop.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
        metrics: Any = None,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
        num_workers: int = DEFAULT_COMPILE_WORKERS,
    ):
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.metrics = metrics
        self.compile_timeout_s = compile_timeout_s
        self.queue_timeout_s = queue_timeout_s
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], _Compile] = collections.OrderedDict()
        self._executor = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="radixserve-grammar")
        # Building the TokenizerInfo takes ~150 ms (+ importing xgrammar): start it now, in the background.
        self._compiler = self._executor.submit(self._make_compiler, tokenizer, vocab_size, list(stop_token_ids))

    @staticmethod
    def _make_compiler(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        return xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def num_pending(self) -> int:
        """Compiles queued or running (what a ``num_grammar_queue_reqs``-style gauge should show)."""
        with self._lock:
            return sum(1 for e in self._cache.values() if not e.future.done())

    # ------------------------------------------------------------------------------------------------------------
    def future(self, kind: str, text: str) -> concurrent.futures.Future[Grammar]:
        """The compile future for ``(kind, text)``: cached (done or in progress) or newly submitted.

        The future's result is a ``Grammar``; its exception an ``InvalidRequestError`` (400, ``param`` = ``kind``).
        Raises InvalidRequestError at once for an unknown kind. Waiting on it directly applies no timeout; ``get`` /
        ``get_sync`` do.
        """
        return self._entry(kind, text, wait=False).future

    def _entry(self, kind: str, text: str, wait: bool) -> _Compile:
        """The cache entry for ``(kind, text)``, submitting its compile when new; ``wait`` counts one more waiter."""
        if kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(f"unknown grammar kind {kind!r}; use one of {GRAMMAR_KINDS}", kind)
        key = (kind, text)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                if self.metrics is not None:
                    self.metrics.grammar_cache_hits_total.inc()
            else:
                entry = _Compile()
                entry.future = self._executor.submit(self._compile, kind, text, entry)
                self._cache[key] = entry
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            if wait:
                entry.waiters += 1
            return entry

    def _leave(self, kind: str, text: str, entry: _Compile) -> None:
        """One waiter left: when it was the last and the compile has not started, cancel it (drop it from the
        cache, so a later request submits it again)."""
        with self._lock:
            entry.waiters -= 1
            if entry.waiters == 0 and entry.started is None and entry.future.cancel():
                if self._cache.get((kind, text)) is entry:
                    del self._cache[(kind, text)]

    def _check_wait(self, kind: str, text: str, entry: _Compile, t_wait: float) -> float:
        """Seconds to wait before the next check; raises InvalidRequestError when a limit is exceeded: 503 when the
        compile has waited more than ``queue_timeout_s`` to start, 400 (cached) when it has compiled for more than
        ``compile_timeout_s``."""
        now = time.monotonic()
        started = entry.started
        if started is None:
            if now - t_wait >= self.queue_timeout_s and not entry.future.done():
                raise InvalidRequestError(
                    f"every grammar compile worker stayed busy for {self.queue_timeout_s:g} s and this {kind} did "
                    "not start compiling; retry later",
                    kind,
                    status_code=503,
                )
            return max(0.0, min(0.05, self.queue_timeout_s - (now - t_wait)))
        left = started + self.compile_timeout_s - now
        if left > 0 or entry.future.done():
            return max(left, 0.0)
        err = InvalidRequestError(
            f"{kind} is too complex: compiling it took longer than the {self.compile_timeout_s:g} s limit "
            "(counted from the start of its own compile); simplify it (e.g. fewer properties, smaller repetition "
            "counts in patterns)",
            kind,
        )
        failed = _Compile()
        failed.started = started
        failed.future.set_exception(err)
        with self._lock:  # later requests for this grammar get the same 400 at once
            if self._cache.get((kind, text)) is entry:
                self._cache[(kind, text)] = failed
        raise err

    async def get(self, kind: str, text: str) -> Grammar:
        """Compile (or fetch) ``text`` as ``kind`` without blocking the event loop.

        Raises InvalidRequestError naming the problem: 400 (param = ``kind``) when the grammar is invalid or
        unsupported, or when its own compile takes longer than ``compile_timeout_s``; 503 when its compile could not
        start within ``queue_timeout_s`` (every worker busy).
        """
        entry = self._entry(kind, text, wait=True)
        try:
            t_wait = time.monotonic()
            waiter = _done_event(entry.future)
            # The thread-safe future decides, not its event-loop copy: a loop that stalled must not turn a compile
            # that has already finished into a timeout.
            while not entry.future.done():
                step = self._check_wait(kind, text, entry, t_wait)
                await asyncio.wait([waiter], timeout=step)
            return entry.future.result()
        finally:
            self._leave(kind, text, entry)

    def get_sync(self, kind: str, text: str) -> Grammar:
        """Blocking ``get`` (tools, benchmarks). Raises InvalidRequestError as ``get``."""
        entry = self._entry(kind, text, wait=True)
        try:
            t_wait = time.monotonic()
            while True:
                try:
                    return entry.future.result(self._check_wait(kind, text, entry, t_wait))
                except concurrent.futures.TimeoutError:
                    continue
        finally:
            self._leave(kind, text, entry)

    def _compile(self, kind: str, text: str, entry: _Compile) -> Grammar:
        compiler = self._compiler.result()
        t0 = time.perf_counter()
        entry.started = time.monotonic()
        try:
            if kind == "json_schema":
                import xgrammar as xgr

                schema = _check_schema(text)
                check_schema_supported(schema)
                schema = bound_schema_numbers(schema)
                grammar = xgr.Grammar.from_json_schema(
                    json.dumps(schema), any_whitespace=False, separators=JSON_SEPARATORS
                )
                try:
                    compiled = compiler.compile_grammar(bound_json_numbers(str(grammar)))
                except Exception:  # the rewrite did not parse (another xgrammar's printing): unbounded numbers
                    compiled = compiler.compile_grammar(grammar)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            else:
                compiled = compiler.compile_grammar(text)
        except InvalidRequestError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError (sometimes ValueError) for invalid / unsupported input
            raise InvalidRequestError(f"invalid {kind}: {clean_error(e)}", kind) from None
        finally:
            if self.metrics is not None:
                self.metrics.grammar_compile_seconds.observe(time.perf_counter() - t0)
        result = Grammar(kind, text, compiled)
        _check_matches_something(result)
        return result


def _check_matches_something(grammar: Grammar) -> None:
    """Raise InvalidRequestError (400) when ``grammar`` allows no first token at all, not even a stop token: its
    language is empty (regression: the regex ``[^\\s\\S]`` compiled, then its first decode step failed with "the
    grammar rejected token 0": a 500, or a 200 aborted with status 500 on /generate)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, grammar.compiled.tokenizer_info.vocab_size)
    grammar.matcher().fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()):
        raise InvalidRequestError(f"invalid {grammar.kind}: it matches no string", grammar.kind)


# Digits allowed in the integer part and in the fraction of an unconstrained JSON number (a float64 holds 15-17
# significant digits), and in its exponent. Small models otherwise loop on digits ("10.0000000000001111...") until
# max_tokens, the number analogue of runaway whitespace.
MAX_NUMBER_DIGITS = 15
MAX_EXPONENT_DIGITS = 3
_NUMBER_RULE = re.compile(r"^basic_(integer|number_\d+) ::=")


def bound_json_numbers(ebnf: str) -> str:
    """Rewrite xgrammar's JSON-schema EBNF so unconstrained numbers have at most ``MAX_NUMBER_DIGITS`` digits in the
    integer part and in the fraction and ``MAX_EXPONENT_DIGITS`` in the exponent.

    Only xgrammar's generic ``basic_integer`` / ``basic_number_*`` rules are touched (numbers with ``minimum`` /
    ``maximum`` get their own, already bounded, rules; user ``pattern`` strings are never rewritten).
    """
    out = []
    for line in ebnf.splitlines():
        if _NUMBER_RULE.match(line):
            line = line.replace("[0-9]*", f"[0-9]{{0,{MAX_NUMBER_DIGITS - 1}}}")
            digits = MAX_EXPONENT_DIGITS if "[eE]" in line else MAX_NUMBER_DIGITS
            line = line.replace("basic_number_digits{1, -1}", f"basic_number_digits{{1,{digits}}}")
        out.append(line)
    return "\n".join(out)


# Magnitude bound added to integer / number schemas that have only one of minimum / maximum: xgrammar turns a one-sided
# range into an unbounded digit loop, a two-sided one into a digit-bounded rule. 15 digits: what a float64 holds.
NUMBER_BOUND = 10**MAX_NUMBER_DIGITS - 1
# Keywords whose values are instances (data), not subschemas: never rewritten.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def bound_schema_numbers(schema: Any) -> Any:
    """A copy of ``schema`` where every integer / number subschema bounded on one side only gets the other side
    (``-NUMBER_BOUND`` or ``NUMBER_BOUND``), unless that would contradict the given bound.

    Only narrows what the schema accepts, so outputs still validate against the original. Ranged numbers then have at
    most 6 fraction digits (xgrammar's range rules).
    """
    if isinstance(schema, list):
        return [bound_schema_numbers(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYWORDS else bound_schema_numbers(v)) for k, v in schema.items()}
    types = out.get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" in types or "number" in types:
        lo = _num(out.get("minimum"), out.get("exclusiveMinimum"))
        hi = _num(out.get("maximum"), out.get("exclusiveMaximum"))
        if lo is not None and hi is None and lo < NUMBER_BOUND:
            out["maximum"] = NUMBER_BOUND
        elif hi is not None and lo is None and hi > -NUMBER_BOUND:
            out["minimum"] = -NUMBER_BOUND
    return out


def _num(*values: Any) -> float | None:
    """The first numeric (non-bool) value, or None."""
    for v in values:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


# JSON-Schema keywords xgrammar 0.2 does not enforce (it ignores them, or enforces them only partly), with why.
# Accepting them would return HTTP 200 outputs that fail validation, so they are refused instead.
UNSUPPORTED_KEYWORDS = {
    "not": "negated schemas are not enforced",
    "if": "conditional schemas (if/then/else) are not enforced",
    "then": "conditional schemas (if/then/else) are not enforced",
    "else": "conditional schemas (if/then/else) are not enforced",
    "contains": "array 'contains' is not enforced",
    "minContains": "array 'contains' is not enforced",
    "maxContains": "array 'contains' is not enforced",
    "minProperties": "property-count limits are not reliably enforced",
    "maxProperties": "property-count limits are not reliably enforced",
    "propertyNames": "property-name schemas are not reliably enforced",
    "patternProperties": "pattern properties are not enforced (keys may repeat)",
    "dependentRequired": "dependent requirements are not enforced",
    "dependentSchemas": "dependent schemas are not enforced",
    "dependencies": "dependencies are not enforced",
    "unevaluatedProperties": "unevaluatedProperties is not enforced",
    "unevaluatedItems": "unevaluatedItems is not enforced",
}
# Keywords whose value is one subschema / a list of subschemas / a name -> subschema map.
_SUBSCHEMA = (
    "additionalProperties",
    "additionalItems",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def check_schema_supported(schema: Any, path: str = "#") -> None:
    """Refuse JSON-Schema constructs that xgrammar would silently not enforce.

    Walks every subschema (``properties``, ``items``, ``prefixItems``, ``additionalProperties``, ``anyOf`` /
    ``oneOf`` / ``allOf``, ``$defs`` / ``definitions``, ...); data keywords (``enum``, ``const``, ``default``,
    ``examples``) and annotations (``title``, ``description``, ``$schema``, ``$id``, ...) are not inspected.

    Raises InvalidRequestError (400, param ``json_schema``) naming the keyword and its JSON pointer, for: a keyword
    in ``UNSUPPORTED_KEYWORDS``; ``uniqueItems: true``; ``allOf`` with more than one subschema; a ``required`` name
    that ``properties`` does not declare (xgrammar never generates undeclared required keys).
    """
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            check_schema_supported(sub, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return

    def refuse(keyword: str, why: str) -> None:
        raise InvalidRequestError(
            f"unsupported json_schema: keyword {keyword!r} at {path}/{_pointer(keyword)}: {why}", "json_schema"
        )

    for keyword, why in UNSUPPORTED_KEYWORDS.items():
        if keyword in schema:
            refuse(keyword, why)
    if schema.get("uniqueItems") is True:
        refuse("uniqueItems", "unique array items are not enforced")
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        refuse("allOf", f"only a single-element allOf is supported, got {len(all_of)} subschemas")
    required = schema.get("required")
    if isinstance(required, list):
        props = schema.get("properties")
        if not isinstance(props, dict):
            props = {}
        missing = [name for name in required if name not in props]
        if missing:
            refuse("required", f"required properties {missing} are not declared in 'properties'")
    for keyword in _SUBSCHEMA:
        if isinstance(schema.get(keyword), dict):
            check_schema_supported(schema[keyword], f"{path}/{_pointer(keyword)}")
    for keyword in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            check_schema_supported(schema[keyword], f"{path}/{_pointer(keyword)}")
    for keyword in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                check_schema_supported(sub, f"{path}/{_pointer(keyword)}/{_pointer(name)}")


def _pointer(token: str) -> str:
    """One JSON-pointer reference token (RFC 6901 escaping)."""
    return str(token).replace("~", "~0").replace("/", "~1")


def _check_schema(text: str) -> Any:
    """Parses ``text``; returns the schema when it is a JSON object or boolean (what JSON Schema allows).

    Raises InvalidRequestError otherwise (xgrammar's parse errors echo the whole text back)."""
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise InvalidRequestError(f"invalid json_schema: not valid JSON ({e})", "json_schema") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(
            f"invalid json_schema: a schema must be a JSON object or boolean, got {type(schema).__name__}",
            "json_schema",
        )
    return schema
