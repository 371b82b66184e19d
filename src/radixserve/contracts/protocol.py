"""OpenAI-compatible and native request/response types, shared by the engine's HTTP server and the router.

Shapes follow the official OpenAI API (chat completions, legacy completions, models, error body) and SGLang's native
``/generate`` (docs/contracts.md, "Native POST /generate"); the models mirror SGLang's
``srt/entrypoints/openai/protocol.py``. Every parameter of OpenAI's reference for the two OpenAI endpoints is
declared here, those we cannot honour too, so the engine can refuse them with a 400 naming them rather than ignore
them (docs/openai-compat.md; the policy is ``engine/server/openai_params.py``). The models themselves accept unknown
keys (``model_extra``): the engine refuses an unknown top-level key of an OpenAI request with a 400 naming it, while
the router and ``/prefix_blocks`` read the same bodies without judging them.

Request fields are validated strictly, as OpenAI checks types: a boolean is ``true`` / ``false`` only (not ``"yes"``
nor ``1``), an integer a JSON integer (not ``"12"``, ``12.0`` nor ``true``), a number an integer or a float (not
``"0.5"``); pydantic's lax mode would coerce all of these (regression: ``"stream": "yes"`` answered 200).

This module must not import the engine: the router uses it too.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic.types import FailFast
from typing_extensions import TypeAliasType

from radixserve.contracts import constants

# The most alternatives per token that we return (OpenAI's limit for chat ``top_logprobs``).
MAX_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# Request lists stop at their first bad element (pydantic's FailFast): a body of millions of bad elements would
# otherwise make one error per element, built on the event loop (regression: an 8 MB /generate body with
# ``sampling_params: [0, 0, ...]`` took 60 s to answer its 400 and held up every other request meanwhile).
# Type aliases, because FailFast is unhashable and typing's unions hash their members.
IntList = TypeAliasType("IntList", Annotated[list[int], FailFast()])
IntLists = TypeAliasType("IntLists", Annotated[list[IntList], FailFast()])
StrList = TypeAliasType("StrList", Annotated[list[str], FailFast()])
DictList = TypeAliasType("DictList", Annotated[list[dict[str, Any]], FailFast()])


def error_type(status: int) -> str:
    """The OpenAI error ``type`` of HTTP ``status``: ``radixserve.contracts.constants.ERROR_TYPES``, else
    ``invalid_request_error`` for any other 4xx and ``server_error`` for anything else (never a bare ``"error"``)."""
    listed = constants.ERROR_TYPES.get(status)
    if listed is not None:
        return listed
    return constants.CLIENT_ERROR_TYPE if 400 <= status < 500 else constants.SERVER_ERROR_TYPE


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``, the same for an HTTP answer and a
    mid-stream SSE event (docs/contracts.md, "Errors").

    ``type`` is ``error_type(status)``; ``code`` is the HTTP status (as vLLM sends it); ``param`` is the request field
    at fault (a path such as ``messages[0].content``) or None. The OpenAI SDK reads ``body["error"]`` into
    ``APIError.message``, ``.type``, ``.param`` and ``.code``.
    """
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


def random_id() -> str:
    """A fresh 32-hex-digit id (request ids, response ids)."""
    return uuid.uuid4().hex


def now() -> int:
    """Unix time in whole seconds (the ``created`` field)."""
    return int(time.time())


# Request models: unknown keys are accepted and ignored, as OpenAI clients send fields we do not use; known ones are
# type-checked strictly (module docstring). Strict still reads an int as a float (``"temperature": 1``), as OpenAI does.
_REQUEST_CONFIG = ConfigDict(extra="allow", strict=True)


class _Request(BaseModel):
    model_config = _REQUEST_CONFIG


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with empty ``choices`` and the request's usage;
    ``include_obfuscation`` (OpenAI's padding of stream events against size side channels) is accepted and ignored."""

    model_config = _REQUEST_CONFIG
    include_usage: bool = False
    include_obfuscation: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """``"include_usage": null`` is its default, false (regression: a 400)."""
        if isinstance(data, dict) and "include_usage" in data and data["include_usage"] is None:
            return {k: v for k, v in data.items() if k != "include_usage"}
        return data


class _SamplingExtras(_Request):
    """SGLang/vLLM extra sampling keys accepted by both OpenAI endpoints (passed to the engine's SamplingParams)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """``null`` for a field with a plain default means that default, as OpenAI's reference makes ``n``,
        ``stream``, ``logprobs`` and ``echo`` nullable (regression: ``"n": null`` was a 400)."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if not (v is None and k in _NULL_IS_DEFAULT)}

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: IntList | None = None
    min_tokens: int = 0  # vLLM's: tokens generated before an end token may come (the engine's min_new_tokens)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    # SGLang's constrained decoding keys (at most one, and not with a JSON ``response_format``): ``json_schema`` is a
    # JSON schema (object or JSON text), ``regex`` a regular expression, ``ebnf`` a grammar in xgrammar's EBNF.
    regex: str | None = None
    ebnf: str | None = None
    json_schema: Any = None
    # vLLM's prefix-cache salt: the router keys on it; the engine's cache ignores it (docs/openai-compat.md).
    cache_salt: str | None = None
    # OpenAI fields of both endpoints. ``user`` has no effect on the output (accepted and ignored).
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


# Request fields whose type is not nullable but whose null means the default (``_null_is_default``).
_NULL_IS_DEFAULT = frozenset(
    {"n", "stream", "logprobs", "echo", "ignore_eos", "skip_special_tokens", "no_stop_trim", "min_tokens"}
)


# ----------------------------------------------------------------------------------------------------------------------
# Chat completions
# ----------------------------------------------------------------------------------------------------------------------


class ContentPart(BaseModel):
    """One part of a message's ``content`` list: ``{"type": "text", "text": ...}`` or a non-text part."""

    model_config = _REQUEST_CONFIG
    type: str
    text: str | None = None


ContentParts = TypeAliasType("ContentParts", Annotated[list[ContentPart], FailFast()])


class ChatMessage(BaseModel):
    """One chat message. ``content`` is a string, a list of parts, or null (an assistant turn with tool calls).

    ``tool_calls``: an assistant turn's calls (OpenAI shape ``{"id", "type": "function", "function": {"name",
    "arguments": JSON text}}``); ``tool_call_id``: on a ``role: "tool"`` message, the call it answers.
    """

    model_config = _REQUEST_CONFIG
    role: str
    content: str | ContentParts | None = None
    name: str | None = None
    tool_calls: DictList | None = None
    tool_call_id: str | None = None


ChatMessages = TypeAliasType("ChatMessages", Annotated[list[ChatMessage], FailFast()])


class ChatCompletionRequest(_SamplingExtras):
    """``POST /v1/chat/completions`` body (OpenAI shape plus SGLang's extra sampling keys)."""

    model: str | None = None
    messages: ChatMessages
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | StrList | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # SGLang's and vLLM's extra variables for the chat template (``{"enable_thinking": false}`` for Qwen3).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI fields with no effect on the output, accepted and ignored (docs/openai-compat.md).
    metadata: dict[str, str] | None = None
    store: bool | None = None  # true (store the completion) is refused
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    # Declared so the server refuses them (400) instead of ignoring them: OpenAI's deprecated predecessors of tools /
    # tool_choice, and what a text-only server without reasoning controls cannot do (``modalities`` ``["text"]`` is
    # fine).
    functions: Any = None
    function_call: Any = None
    modalities: StrList | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None


class ChatLogprobTop(BaseModel):
    """One alternative in ``top_logprobs``: the token's text, its logprob and its UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(BaseModel):
    """One generated token in ``choices[].logprobs.content``."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """``choices[].logprobs`` of a chat completion: one entry per generated token."""

    content: list[ChatLogprobEntry] | None = None


class FunctionCall(BaseModel):
    """``tool_calls[].function``: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call in a response message: ``{"id": "call_...", "type": "function", "function": {...}}``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _drop_keys_if_none(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if not (k in keys and v is None)}


class ChatResponseMessage(BaseModel):
    """The assistant's message. ``content`` is null when the reply is only tool calls; ``tool_calls`` and
    ``reasoning_content`` (text between ``<think>`` tags, with a reasoning parser) are left out when absent."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict[str, Any]:
        return _drop_keys_if_none(handler(self), ("reasoning_content", "tool_calls"))


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """``usage.completion_tokens_details``: ``reasoning_tokens`` of the completion were reasoning (``<think>``)."""

    reasoning_tokens: int = 0


class Usage(BaseModel):
    """Token usage; ``prompt_tokens_details.cached_tokens`` counts prompt tokens served from the prefix cache.

    ``completion_tokens_details`` is only sent when a reasoning parser is enabled (left out when None)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict[str, Any]:
        return _drop_keys_if_none(handler(self), ("completion_tokens_details",))

    @classmethod
    def of(
        cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None = None
    ) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=(
                None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
            ),
        )


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallDelta(BaseModel):
    """One entry of a streamed ``delta.tool_calls``: ``index`` says which call it extends; the first delta of a
    call carries ``id``, ``type`` and ``function.name``, later ones append to ``function.arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] = Field(default_factory=dict)

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    """A streamed chat delta; unset fields are left out of the JSON (OpenAI sends ``{}`` on the last chunk)."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE chunk of a streamed chat completion. ``usage`` is only sent with ``stream_options.include_usage``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None


# ----------------------------------------------------------------------------------------------------------------------
# Legacy completions
# ----------------------------------------------------------------------------------------------------------------------


class CompletionRequest(_SamplingExtras):
    """``POST /v1/completions`` body. ``prompt``: a string, strings, token ids, or lists of token ids."""

    model: str | None = None
    prompt: str | StrList | IntList | IntLists
    suffix: str | None = None
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    stop: str | StrList | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy logprobs: parallel lists over the returned tokens; ``text_offset`` indexes into the choice's text.

    ``token_logprobs``/``top_logprobs`` entries are null where no logprob is known (echoed prompt tokens).
    """

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


CompletionChunk = CompletionResponse  # streamed chunks have the same shape, with incremental ``text``


# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "radixserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ----------------------------------------------------------------------------------------------------------------------
# Native /generate
# ----------------------------------------------------------------------------------------------------------------------


class GenerateReqInput(_Request):
    """Native ``POST /generate`` body (SGLang's ``GenerateReqInput``, see docs/contracts.md).

    Exactly one of ``text`` and ``input_ids``; a list of prompts (``[str]`` or ``[[int]]``) makes a batch and the
    response is a list. ``sampling_params`` is one dict for all prompts or a list with one per prompt.
    """

    text: str | StrList | None = None
    input_ids: IntList | IntLists | None = None
    sampling_params: dict[str, Any] | DictList | None = None
    stream: bool = False
    return_logprob: bool = False
    # With return_logprob: the logprobs of the prompt tokens from this position on (-1: none); one per prompt too.
    logprob_start_len: int | IntList = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    rid: str | StrList | None = None
