"""Grammar backend on xgrammar: compile JSON schemas, regexes and EBNF into token-level matchers.

Design after SGLang's ``XGrammarGrammarBackend`` (srt/constrained/xgrammar_backend.py) and xgrammar itself (Dong et al.,
"XGrammar: Flexible and Efficient Structured Generation Engine for Large Language Models", 2024):

- one ``xgrammar.TokenizerInfo`` for the engine's tokenizer (vocab size = the model's logits width, stop tokens = eos);
- compiled grammars are cached by ``(kind, text)`` in a bounded LRU; failures are cached too, so a repeated bad grammar
  is a fast 400 again;
- compilation runs on a dedicated worker thread, never on the scheduler loop or the event loop; callers await a
  future ("grammar queue"), and only a compiled grammar reaches the scheduler;
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
# A caller stops waiting for a compile after this long and gets a 400; the compile itself still finishes (and is
# cached), xgrammar cannot be interrupted.
DEFAULT_COMPILE_TIMEOUT_S = 60.0
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


class GrammarBackend:
    """Compiles and caches grammars for one engine.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed ``len(tokenizer)``; extra ids are never allowed).
        stop_token_ids: the engine's eos ids; a grammar ends by accepting one of them.
        cache_size: compiled grammars (and compile failures) kept, LRU.
        metrics: ``EngineMetrics`` or None (``grammar_compile_seconds``, ``grammar_cache_hits_total``).
        compile_timeout_s: a caller waits at most this long for one compile, seconds.

    Thread-safety: ``future`` / ``get`` may be called from any thread or event loop.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, metrics: Any = None,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S):
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.metrics = metrics
        self.compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = collections.OrderedDict()
        # One worker: compiles are serialised; xgrammar parallelises inside one compile (max_threads).
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixserve-grammar")
        # Building the TokenizerInfo takes ~150 ms (+ importing xgrammar): start it now, in the background.
        self._compiler = self._executor.submit(self._make_compiler, tokenizer, vocab_size, list(stop_token_ids))

    @staticmethod
    def _make_compiler(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # max_threads: this machine class has 2 cores shared with the forward pass.
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------------------------
    def future(self, kind: str, text: str) -> concurrent.futures.Future:
        """The compile future for ``(kind, text)``: cached (done or in progress) or newly submitted.

        The future's result is a ``Grammar``; its exception an ``InvalidRequestError`` (400, ``param`` = ``kind``).
        Raises InvalidRequestError at once for an unknown kind.
        """
        if kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(f"unknown grammar kind {kind!r}; use one of {GRAMMAR_KINDS}", kind)
        key = (kind, text)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                if self.metrics is not None:
                    self.metrics.grammar_cache_hits_total.inc()
                return fut
            fut = self._executor.submit(self._compile, kind, text)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    async def get(self, kind: str, text: str) -> Grammar:
        """Compile (or fetch) ``text`` as ``kind`` without blocking the event loop.

        Raises InvalidRequestError (400, param = ``kind``) naming the problem when the grammar is invalid or
        unsupported, or when compiling takes longer than ``compile_timeout_s``.
        """
        fut = self.future(kind, text)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.compile_timeout_s)
        except asyncio.TimeoutError:
            raise InvalidRequestError(
                f"{kind} took longer than {self.compile_timeout_s:g} s to compile; simplify it", kind) from None

    def get_sync(self, kind: str, text: str, timeout: float | None = None) -> Grammar:
        """Blocking ``get`` (tools, benchmarks). Raises InvalidRequestError as ``get``."""
        return self.future(kind, text).result(timeout if timeout is not None else self.compile_timeout_s)

    def _compile(self, kind: str, text: str) -> Grammar:
        compiler = self._compiler.result()
        t0 = time.perf_counter()
        try:
            if kind == "json_schema":
                import xgrammar as xgr

                schema = bound_schema_numbers(_check_schema(text))
                grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                       separators=JSON_SEPARATORS)
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
        return Grammar(kind, text, compiled)


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
            line = line.replace("[0-9]*", "[0-9]{0,%d}" % (MAX_NUMBER_DIGITS - 1))
            digits = MAX_EXPONENT_DIGITS if "[eE]" in line else MAX_NUMBER_DIGITS
            line = line.replace("basic_number_digits{1, -1}", "basic_number_digits{1,%d}" % digits)
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
            "json_schema")
    return schema
