"""radixserve.lang's HTTP backend and chat templates without a server: ``RuntimeEndpoint`` over an httpx mock
transport (request shapes, SSE, select's one scoring request, errors, where the chat template comes from), role
markers read off Jinja templates, and the choices methods."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import radixserve.lang as sgl
from radixserve.lang.backend.runtime_endpoint import RuntimeEndpoint, RuntimeEndpointError, merge_stream_meta
from radixserve.lang.chat_template import ChatTemplateError, from_jinja, from_tokenizer_files, match_chat_template
from radixserve.lang.choices import choice_tokens, greedy_token_selection, unconditional_likelihood_normalized
from radixserve.lang.ir import SglSamplingParams

ROOT = Path(__file__).resolve().parents[1]
SMOL_JINJA = ROOT / "models" / "smollm2-135m-instruct" / "chat_template.jinja"
CHATML_DEFAULT = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are SmolLM.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

Handler = Callable[[httpx.Request], httpx.Response]


def endpoint(handler: Handler, **kwargs: Any) -> tuple[RuntimeEndpoint, list[tuple[str, Any]]]:
    """A RuntimeEndpoint whose requests go to ``handler``; the list records (path, JSON body or None)."""
    seen: list[tuple[str, Any]] = []

    def record(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.url.path, body))
        return handler(request)

    client = httpx.Client(transport=httpx.MockTransport(record))
    return RuntimeEndpoint("http://server:1", http_client=client, **kwargs), seen


def meta(**extra: Any) -> dict[str, Any]:
    return {"id": "r", "prompt_tokens": 10, "completion_tokens": 2, "cached_tokens": 0, **extra}


# -- chat templates ------------------------------------------------------------------------------------------------


def test_markers_of_a_chatml_template_with_a_default_system_prompt() -> None:
    t = from_jinja(CHATML_DEFAULT)
    assert t.default_system_prompt == "You are SmolLM."
    assert t.role_prefix_and_suffix == {
        r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant")
    }
    assert t.stop_str == ("<|im_end|>",)


def test_the_demo_models_template_file() -> None:
    if not SMOL_JINJA.exists():
        pytest.skip("demo model not converted")
    t = from_tokenizer_files({"chat_template.jinja": SMOL_JINJA.read_text(), "tokenizer_config.json": "{}"})
    assert t is not None and t.default_system_prompt and "SmolLM" in t.default_system_prompt


def test_markers_of_llama3_and_of_a_template_without_system_role() -> None:
    t = from_jinja(LLAMA3, bos_token="<|begin_of_text|>")
    assert t.role_prefix_and_suffix["system"] == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n",
        "<|eot_id|>",
    )
    assert t.role_prefix_and_suffix["user"] == ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>")
    assert from_jinja(LLAMA3).role_prefix_and_suffix["system"][0] == "<|start_header_id|>system<|end_header_id|>\n\n"
    g = from_jinja(NO_SYSTEM)
    assert g.role_prefix_and_suffix["system"] == ("", "") and g.default_system_prompt is None
    assert g.role_prefix_and_suffix["assistant"] == ("<start_of_turn>model\n", "<end_of_turn>\n")


def test_templates_from_tokenizer_config_and_unusable_ones() -> None:
    config = {"chat_template": [{"name": "default", "template": CHATML_DEFAULT}], "eos_token": {"content": "</s>"}}
    t = from_tokenizer_files({"tokenizer_config.json": json.dumps(config)})
    assert t is not None and t.default_system_prompt == "You are SmolLM."
    assert from_tokenizer_files({"tokenizer_config.json": "{}"}) is None
    with pytest.raises(ChatTemplateError):
        from_jinja("{{ messages[0]['content'] | upper }}")  # rewrites the content
    with pytest.raises(ChatTemplateError):
        from_jinja("{{ raise_exception('no') }}")


def test_matching_by_model_name() -> None:
    assert match_chat_template("/models/Meta-Llama-3-8B-Instruct").name == "llama-3-instruct"
    assert match_chat_template("Qwen2.5-0.5B-Instruct").name == "qwen"
    assert match_chat_template("smollm2-135m-instruct").name == "chatml"
    assert match_chat_template("mystery").name == "default"


# -- where RuntimeEndpoint gets its chat template ------------------------------------------------------------------


def test_chat_template_from_the_engines_tokenizer_files() -> None:
    files = {"chat_template.jinja": CHATML_DEFAULT, "tokenizer_config.json": "{}"}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/get_tokenizer_files"
        return httpx.Response(200, json={"model": "m", "files": files})

    ep, seen = endpoint(handler)
    assert ep.get_chat_template().default_system_prompt == "You are SmolLM."
    ep.get_chat_template()
    assert len(seen) == 1  # found once, then kept
    assert ep.chat_template_source is not None and "model's own" in ep.chat_template_source


def test_chat_template_behind_a_router_comes_from_an_engine_it_lists() -> None:
    files = {"chat_template.jinja": LLAMA3}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "server":
            if request.url.path == "/health":
                workers = [{"url": "http://down:2", "state": "ejected"}, {"url": "http://up:3", "state": "healthy"}]
                return httpx.Response(200, json={"status": "degraded", "workers": workers})
            return httpx.Response(404, json={"error": {"message": "Not Found"}})
        assert request.url.host == "up" and request.headers["authorization"] == "Bearer k"
        return httpx.Response(200, json={"model": "m", "files": files})

    ep, seen = endpoint(handler, api_key="k")
    assert ep.get_chat_template().stop_str == ("<|eot_id|>",)
    assert [p for p, _ in seen] == ["/get_tokenizer_files", "/health", "/get_tokenizer_files"]


def test_chat_template_by_model_name_or_by_name_given() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "qwen2.5-7b-instruct"}]})
        return httpx.Response(404, json={"error": {"message": "Not Found"}})

    ep, _ = endpoint(handler)
    assert ep.get_chat_template().name == "qwen"
    named, seen = endpoint(handler, chat_template_name="llama-3-instruct")
    assert named.get_chat_template().name == "llama-3-instruct" and seen == []


# -- gen and streams -----------------------------------------------------------------------------------------------


def test_generate_sends_sglangs_fields_only_when_set() -> None:
    ep, seen = endpoint(lambda r: httpx.Response(200, json={"text": " Paris", "output_ids": [1], "meta_info": meta()}))
    params = SglSamplingParams(max_new_tokens=8, stop="\n", temperature=0.0, regex="[A-Z].*", return_logprob=True)
    assert ep.generate("Capital:", params) == (" Paris", meta())
    assert seen == [
        (
            "/generate",
            {
                "text": "Capital:",
                "sampling_params": {"max_new_tokens": 8, "stop": ["\n"], "temperature": 0.0, "regex": "[A-Z].*"},
                "return_logprob": True,
            },
        )
    ]


def test_error_statuses_name_the_servers_message() -> None:
    ep, _ = endpoint(lambda r: httpx.Response(400, json={"error": {"message": "regex is invalid", "param": "regex"}}))
    with pytest.raises(RuntimeEndpointError, match="400: regex is invalid") as e:
        ep.generate("x", SglSamplingParams())
    assert e.value.status_code == 400


def test_a_result_the_server_aborted_raises_instead_of_reading_as_empty_text() -> None:
    # Regression (new-user try): gen(regex=r"[^\s\S]") came back as s["x"] == "" with no error, because /generate
    # answers 200 with finish_reason {"type": "abort", "status_code": 500} and lang read only the text.
    aborted = meta(finish_reason={"type": "abort", "message": "the grammar rejected token 0", "status_code": 500})
    ep, _ = endpoint(lambda r: httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": aborted}))
    with pytest.raises(RuntimeEndpointError, match="500: the server aborted the request: the grammar rejected") as e:
        ep.generate("x", SglSamplingParams())
    assert e.value.status_code == 500
    body = sse({"text": "", "meta_info": aborted, "index": 0}, b"[DONE]")
    streamed, _ = endpoint(lambda r: httpx.Response(200, content=body))
    with pytest.raises(RuntimeEndpointError, match="the server aborted the request"):
        list(streamed.generate_stream("x", SglSamplingParams()))


def sse(*events: Any) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def test_stream_pieces_and_merged_logprobs() -> None:
    lp1, lp2 = [[-0.1, 5, "a"]], [[-0.2, 6, "b"]]
    body = sse(
        {"text": "a", "output_ids": [5], "meta_info": meta(output_token_logprobs=lp1), "index": 0},
        {"text": "b", "output_ids": [6], "meta_info": meta(output_token_logprobs=lp2), "index": 0},
        b"[DONE]",
    )
    ep, seen = endpoint(lambda r: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"}))
    pieces = list(ep.generate_stream("x", SglSamplingParams(return_logprob=True)))
    assert [p for p, _ in pieces] == ["a", "b"]
    assert pieces[-1][1]["output_token_logprobs"] == lp1 + lp2
    assert seen[0][1]["stream"] is True
    assert merge_stream_meta({}, {"a": 1}) == {"a": 1}


def test_a_stream_error_event_raises() -> None:
    body = sse({"text": "a", "meta_info": meta()}, {"error": {"message": "engine died", "code": 500}})
    ep, _ = endpoint(lambda r: httpx.Response(200, content=body))
    with pytest.raises(RuntimeEndpointError, match="engine died"):
        list(ep.generate_stream("x", SglSamplingParams()))
    bad, _ = endpoint(lambda r: httpx.Response(429, json={"error": {"message": "queue full"}}))
    with pytest.raises(RuntimeEndpointError, match="429: queue full"):
        list(bad.generate_stream("x", SglSamplingParams()))


# -- select ----------------------------------------------------------------------------------------------------------


def scored(texts: list[str], start: int, prompt_tokens: int) -> list[dict[str, Any]]:
    """Fake prompt logprobs: the prompt is ``prompt_tokens`` tokens of one character each... up to the choice, whose
    characters are tokens too; logprob -1 per token, better (-0.5) for characters of "yes"."""
    out = []
    for text in texts:
        n = len(text)
        entries = [[None if i == 0 else (-0.5 if text[i] in "yes" else -1.0), i, text[i]] for i in range(start, n)]
        out.append({"text": "", "output_ids": [], "meta_info": meta(prompt_tokens=n, input_token_logprobs=entries)})
    return out


def test_select_scores_every_choice_in_one_request_from_the_known_prefix() -> None:
    prompt = "Is it? Answer: "

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        return httpx.Response(200, json=scored(body["text"], body["logprob_start_len"], len(prompt)))

    ep, seen = endpoint(handler)
    decision = ep.select(prompt, ["yes", "no"], sgl.token_length_normalized, (len(prompt), len(prompt)))
    assert decision.decision == "yes"
    assert len(seen) == 1  # one request: the prefix was known
    body = seen[0][1]
    assert body["text"] == [prompt + "yes", prompt + "no"]
    assert body["sampling_params"] == {"max_new_tokens": 0, "temperature": 0}
    assert body["return_logprob"] is True and body["return_text_in_logprobs"] is True
    assert body["logprob_start_len"] == len(prompt) - RuntimeEndpoint.HEALING_TOKENS
    m = decision.meta_info
    assert [len(t) for t in m["input_token_logprobs"]] == [3, 2]  # exactly the choices' tokens
    assert m["normalized_prompt_logprobs"] == [-0.5, pytest.approx((-1.0 + -1.0) / 2)]
    assert m["prompt_tokens"] == [len(prompt) + 3, len(prompt) + 2]


def test_select_without_a_known_prefix_caches_and_measures_it_first() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if isinstance(body["text"], str):
            return httpx.Response(200, json={"text": ".", "meta_info": meta(prompt_tokens=len(body["text"]))})
        return httpx.Response(200, json=scored(body["text"], body["logprob_start_len"], 0))

    ep, seen = endpoint(handler)
    assert ep.select("Q? ", ["yes", "no"], sgl.token_length_normalized, None).decision == "yes"
    assert seen[0][1] == {"text": "Q? ", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    assert seen[1][1]["logprob_start_len"] == 1


def test_select_on_an_empty_text_sends_one_request() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        return httpx.Response(200, json=scored(body["text"], body["logprob_start_len"], 0))

    ep, seen = endpoint(handler)
    assert ep.select("", ["yes", "no"], sgl.token_length_normalized, None).decision == "yes"
    assert len(seen) == 1 and seen[0][1]["logprob_start_len"] == 0


def test_select_scores_again_from_the_start_when_the_prefix_guess_was_too_long() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        return httpx.Response(200, json=scored(body["text"], body["logprob_start_len"], 0))

    ep, seen = endpoint(handler)
    decision = ep.select("Q? ", ["yes", "no"], sgl.token_length_normalized, (3, 50))
    assert decision.decision == "yes" and [b["logprob_start_len"] for _, b in seen] == [48, 0]


def test_select_says_when_the_server_has_no_prompt_logprobs() -> None:
    no_logprobs = [{"text": "", "meta_info": meta()}, {"text": "", "meta_info": meta()}]
    ep, _ = endpoint(lambda r: httpx.Response(200, json=no_logprobs))
    with pytest.raises(RuntimeEndpointError, match="input_token_logprobs"):
        ep.select("x", ["a", "b"], sgl.token_length_normalized, (1, 1))


def test_select_unconditional_likelihood_sends_the_choice_tokens_alone() -> None:
    prompt = "P: "

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if "input_ids" in body:
            res = [
                {"meta_info": meta(input_token_logprobs=[[None, t, None] for t in ids])} for ids in body["input_ids"]
            ]
            return httpx.Response(200, json=res)
        return httpx.Response(200, json=scored(body["text"], body["logprob_start_len"], 0))

    ep, seen = endpoint(handler)
    d = ep.select(prompt, ["yes", "no"], unconditional_likelihood_normalized, (3, 3))
    assert d.decision == "yes" and "normalized_unconditional_prompt_logprobs" in d.meta_info
    assert seen[1][1]["input_ids"] == [[3, 4, 5], [3, 4]]


# -- choices ---------------------------------------------------------------------------------------------------------


def test_choice_tokens_walks_back_over_the_choice_and_keeps_a_merged_token() -> None:
    entries = [[-1.0, 1, "Answer"], [-1.0, 2, ":"], [-0.3, 3, " yes"], [-0.2, 4, "ter"]]
    assert choice_tokens(entries, "yester") == [[-0.3, 3, " yes"], [-0.2, 4, "ter"]]  # " yes" holds the space too
    assert choice_tokens(entries, ":" + " yester") == entries[1:]
    assert choice_tokens(entries[2:], "Answer: yester") is None
    assert choice_tokens([[None, 1, None]], "a") is None


def test_greedy_token_selection_pads_short_choices_with_their_mean() -> None:
    tokens = [[[-0.1, 1, "a"], [-3.0, 2, "b"]], [[-0.1, 1, "a"]]]
    d = greedy_token_selection(
        choices=["ab", "a"],
        normalized_prompt_logprobs=[-1.55, -0.1],
        input_token_logprobs=tokens,
        output_token_logprobs=[[], []],
    )
    assert d.decision == "a" and d.meta_info["greedy_logprob_matrix"] == [[-0.1, -3.0], [-0.1, -0.1]]
    assert math.isinf(sgl.choices.mean_logprob([[None, 1, "x"]]))
