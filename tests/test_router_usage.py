"""router/usage.py: cached_tokens read from parsed answers, and the router's usage chunk hidden from the client."""

from __future__ import annotations

import json

from radixserve.router.usage import StreamUsage, cached_tokens_in_body, cached_tokens_of


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def usage(cached: int) -> dict[str, object]:
    return {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": cached}}


def test_openai_and_native_answers():
    assert cached_tokens_of({"choices": [], "usage": usage(32)}) == {0: 32}
    assert cached_tokens_of([{"meta_info": {"cached_tokens": 16}}, {"meta_info": {"cached_tokens": 8}}]) == {
        0: 16,
        1: 8,
    }
    assert cached_tokens_of({"index": 3, "meta_info": {"cached_tokens": 5}}) == {3: 5}
    assert cached_tokens_of({"usage": {"prompt_tokens_details": {"cached_tokens": True}}}) == {}
    assert cached_tokens_of({"usage": None}) == {}


def test_text_that_looks_like_usage_is_not_counted():
    # Regression guard: the regex over raw bytes this replaced could match JSON-looking generated text.
    answer = {"choices": [{"text": '{"cached_tokens": 999}'}], "usage": usage(7)}
    assert cached_tokens_in_body(json.dumps(answer).encode()) == 7
    assert cached_tokens_in_body(b'{"cached_tokens": 3') == 0  # cut short: not JSON, nothing counted


def test_a_stripped_stream_is_the_bytes_the_client_would_get_without_include_usage():
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
    upstream = (
        event({**chunk, "usage": None}) + event({"id": "c", "choices": [], "usage": usage(24)}) + b"data: [DONE]\n\n"
    )
    s = StreamUsage(strip=True)
    assert s.events(upstream) == event(chunk) + b"data: [DONE]\n\n"
    assert s.cached_tokens == 24


def test_another_servers_spaced_usage_null_is_removed_after_parsing():
    s = StreamUsage(strip=True)
    out = s.events(b'data: {"id": "c", "choices": [], "usage": null}\n\n')
    assert json.loads(out[6:]) == {"id": "c", "choices": []}


def test_a_client_that_asked_for_usage_gets_it_untouched():
    upstream = event({"id": "c", "choices": [], "usage": usage(12)})
    s = StreamUsage(strip=False)
    assert s.events(upstream) == upstream and s.cached_tokens == 12


def test_native_streams_count_the_latest_value_of_each_result():
    s = StreamUsage(strip=False)
    for index, cached in [(0, 16), (1, 16), (0, 16), (1, 16)]:
        s.events(event({"text": "x", "index": index, "meta_info": {"cached_tokens": cached}}))
    assert s.cached_tokens == 32


def test_an_event_that_is_not_json_passes_through():
    s = StreamUsage(strip=True)
    assert s.events(b'data: {"usage": oops\n\n') == b'data: {"usage": oops\n\n'
    assert s.cached_tokens == 0
