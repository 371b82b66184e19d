"""radixserve.contracts.protocol: OpenAI/native request parsing and response serialization."""

import json

import pytest
from pydantic import ValidationError

from radixserve.contracts import constants
from radixserve.contracts.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    CompletionRequest,
    DeltaMessage,
    GenerateReqInput,
    Usage,
    error_body,
)


@pytest.mark.parametrize("status", sorted(constants.ERROR_TYPES))
def test_error_body_shape(status):
    body = error_body("bad thing", status, "max_tokens")
    # OpenAI's shape (no top-level "object": the flat {"object": "error", ...} body of earlier releases is gone)
    assert body == {
        "error": {"message": "bad thing", "type": constants.ERROR_TYPES[status], "param": "max_tokens", "code": status}
    }


def test_error_body_defaults():
    assert error_body("x", 400)["error"]["param"] is None
    # An unlisted status takes its class's OpenAI type, never a bare "error" (regression: the 405 said "type":"error").
    assert error_body("x", 418)["error"]["type"] == "invalid_request_error"
    assert error_body("x", 507)["error"]["type"] == "server_error"


def test_every_status_the_edge_answers_has_an_openai_type():
    """Issue 11 round 2, item 12: 405 and the rest have OpenAI's types: a client's mistake invalid_request_error (401
    authentication_error, 404 not_found_error, 429 rate_limit_error), a server's failure server_error."""
    for status in (401, 404, 405, 408, 409, 413, 415, 422, 429, 500, 502, 503, 504):
        assert status in constants.ERROR_TYPES
    assert {constants.ERROR_TYPES[s] for s in (400, 405, 408, 409, 413, 415, 422)} == {"invalid_request_error"}
    assert (constants.ERROR_TYPES[401], constants.ERROR_TYPES[404], constants.ERROR_TYPES[429]) == (
        "authentication_error",
        "not_found_error",
        "rate_limit_error",
    )
    assert {constants.ERROR_TYPES[s] for s in (500, 502, 503, 504)} == {"server_error"}
    assert "error" not in constants.ERROR_TYPES.values()


@pytest.mark.parametrize(
    "prompt, kind",
    [("hi", str), (["a", "b"], str), ([1, 2, 3], int), ([[1, 2], [3]], list)],
)
def test_completion_prompt_forms(prompt, kind):
    req = CompletionRequest(model="m", prompt=prompt)
    assert req.prompt == prompt
    first = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
    assert isinstance(first, kind)


def test_completion_defaults_and_unknown_keys():
    req = CompletionRequest.model_validate({"prompt": "x", "user": "u", "metadata": {"a": 1}})
    assert req.max_tokens == 16 and req.n == 1 and req.echo is False
    assert "max_tokens" not in req.model_fields_set


def test_completion_prompt_rejects_mixed():
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=[1, "a"])


def test_chat_content_forms():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]},
                {"role": "assistant", "content": None},
            ]
        }
    )
    assert req.messages[0].content == "s"
    assert [p.type for p in req.messages[1].content] == ["text", "image_url"]
    assert req.messages[2].content is None
    assert req.max_tokens is None and req.logprobs is False


def test_chat_requires_messages():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m"})


def test_delta_drops_unset_fields():
    assert DeltaMessage().model_dump() == {}
    assert DeltaMessage(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}
    chunk = ChatCompletionChunk(
        id="c", model="m", choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="x"))]
    )
    d = json.loads(chunk.model_dump_json())
    assert d["choices"][0] == {"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}
    assert d["object"] == "chat.completion.chunk"


def test_usage_totals_and_cached_tokens():
    u = Usage.of(10, 5, 7).model_dump()
    assert u == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 7},
    }


def test_generate_req_input_forms():
    a = GenerateReqInput.model_validate({"text": ["a", "b"], "sampling_params": {"max_new_tokens": 3}})
    assert a.text == ["a", "b"] and a.input_ids is None
    b = GenerateReqInput.model_validate({"input_ids": [[1, 2], [3]], "stream": True, "rid": "r"})
    assert b.input_ids == [[1, 2], [3]] and b.stream and b.rid == "r"
