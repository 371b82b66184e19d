"""Which OpenAI request parameters the engine honours, accepts and ignores, or refuses: the one place that decides,
before a request is tokenized. docs/openai-compat.md is the table, one row per parameter, with its reasons.

Nothing is silently ignored: a parameter is either honoured (``openai_sampling.py``, the endpoints), accepted and
ignored because OpenAI's reference gives it no effect on the output (``user``, ``metadata``, ``store`` false,
``safety_identifier``, ``prompt_cache_key`` / ``_options`` / ``_retention``, ``service_tier``,
``stream_options.include_obfuscation``), or refused
with a 400 whose ``param`` names it. A top-level key that OpenAI's reference does not list, nor our extensions
(``protocol._SamplingExtras``), is refused too: the official ``openai`` client sends only the fields it was given.
"""

from __future__ import annotations

from radixserve.contracts.protocol import MAX_TOP_LOGPROBS, ChatCompletionRequest, CompletionRequest
from radixserve.engine.io_struct import InvalidRequestError
from radixserve.engine.server.context import ServerContext

OpenAIRequest = ChatCompletionRequest | CompletionRequest

# OpenAI's service tiers: latency and price, never the output.
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
MAX_BEST_OF = 128  # as n: every candidate is a sample of one prefill

# Chat parameters a text-only server without reasoning controls or tools beyond functions cannot honour: why, per
# field (refused when set to anything but null).
_CHAT_REFUSED = {
    "functions": "functions (deprecated) is not supported; use tools instead",
    "function_call": "function_call (deprecated) is not supported; use tool_choice instead",
    "audio": "audio output is not supported: this server generates text only",
    "prediction": "prediction (Predicted Outputs) is not supported",
    "reasoning_effort": "reasoning_effort is not supported: this server has no reasoning budget to set",
    "verbosity": "verbosity is not supported: this server has no verbosity control",
    "web_search_options": "web_search_options is not supported: this server has no web search",
    "moderation": "moderation is not supported: this server runs no moderation model",
}


def check_unknown(req: OpenAIRequest) -> None:
    """400 naming the first top-level key (or ``stream_options`` key) the request model does not declare (OpenAI's
    "Unrecognized request argument supplied"); vLLM ignores such keys with a warning, which would silently drop what
    a client asked for."""
    extra = list(req.model_extra or {})
    if req.stream_options is not None:  # its two fields are OpenAI's whole list too
        extra += [f"stream_options.{k}" for k in req.stream_options.model_extra or {}]
    if extra:
        raise InvalidRequestError(f"Unrecognized request argument supplied: {', '.join(extra)}", extra[0])


def check_common(ctx: ServerContext, req: OpenAIRequest) -> None:
    """Checks of both endpoints (400s naming the field, 404 for another model): unknown keys, the model,
    ``stream_options`` without a stream, ``store`` true."""
    check_unknown(req)
    ctx.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
    store = getattr(req, "store", None)
    if store:
        raise InvalidRequestError("store is not supported: this server keeps no completions (send false)", "store")


def check_chat(ctx: ServerContext, req: ChatCompletionRequest) -> int:
    """Checks of ``/v1/chat/completions`` (400s naming the field); returns the ``top_logprobs`` to report."""
    check_common(ctx, req)
    for name, why in _CHAT_REFUSED.items():
        if getattr(req, name) is not None:
            raise InvalidRequestError(why, name)
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise InvalidRequestError(
            f'modalities must be ["text"]: this server generates text only, got {req.modalities}', "modalities"
        )
    if req.service_tier is not None and req.service_tier not in SERVICE_TIERS:
        raise InvalidRequestError(
            f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {req.service_tier!r}", "service_tier"
        )
    if req.top_logprobs is None:
        return 0
    if not req.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}", "top_logprobs"
        )
    return req.top_logprobs


def check_completion(ctx: ServerContext, req: CompletionRequest) -> int:
    """Checks of ``/v1/completions`` (400s naming the field); returns how many samples to generate per prompt
    (``best_of``, else ``n``)."""
    check_common(ctx, req)
    if req.suffix:  # "" is no suffix
        raise InvalidRequestError(
            "suffix is not supported: this server only continues a prompt (insertion needs a fill-in-the-middle "
            "model and format)",
            "suffix",
        )
    k = req.logprobs
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k}", "logprobs")
    if req.best_of is None or req.best_of == req.n:
        return req.n
    if not req.n <= req.best_of <= MAX_BEST_OF:
        raise InvalidRequestError(
            f"best_of must be at least n ({req.n}) and at most {MAX_BEST_OF}, got {req.best_of}", "best_of"
        )
    if req.stream:
        raise InvalidRequestError(
            "best_of greater than n cannot be streamed (the best are known at the end)", "best_of"
        )
    return req.best_of
