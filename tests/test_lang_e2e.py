"""radixserve.lang against the real stack: ``radixserve up`` (router + one engine on the demo model, eager, greedy by
the stack's default), started once for the module. Every example in examples/lang/ runs and is checked for
behaviour, not world knowledge (the model is 135M): dtype gens parse, stops hold, regex gens match in full, select
returns one of its choices with their logprobs, forks join both ways, messages keep their roles in order, streamed
pieces join to the variable, run_batch gives one state per input with a progress bar; and the prefix reuse shows in
the engine's counters (few-shot run_batch, forks, multi-turn chat).

The select tests need the engine's prompt logprobs (native /generate ``logprob_start_len``, issue 15's engine
side); ``needs_prompt_logprobs`` skips them, saying so, where the engine does not return them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

import radixserve.lang as sgl
from radixserve.lang.ir import REGEX_INT, REGEX_STR

from conftest import MODEL_DIR, ROOT, free_port, requires_model, wait_healthy

pytestmark = [requires_model, pytest.mark.slow, pytest.mark.timeout(600)]
EXAMPLES = Path(ROOT) / "examples" / "lang"


def load_example(name: str) -> ModuleType:
    """examples/lang/<name>.py as a module (examples/lang/ on sys.path for its ``_common``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"lang_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(router URL, engine URL) of a ``radixserve up`` with one engine."""
    port, engine_port = free_port(), free_port()
    log_path = tmp_path_factory.mktemp("lang") / "up.log"
    argv = [sys.executable, "-m", "radixserve", "up", "--model-path", MODEL_DIR, "--engines", "1"]
    argv += ["--port", str(port), "--engine-base-port", str(engine_port), "--num-threads", "2"]
    argv += ["--disable-torch-compile", "--max-total-tokens", "16384", "--context-length", "4096"]
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        try:
            router = f"http://127.0.0.1:{port}"
            wait_healthy(router, proc, 300, log_path)
            yield router, f"http://127.0.0.1:{engine_port}"
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def backend(stack: tuple[str, str]) -> Iterator[sgl.RuntimeEndpoint]:
    """A RuntimeEndpoint on the router, the default backend of the module's programs."""
    endpoint = sgl.RuntimeEndpoint(stack[0])
    sgl.set_default_backend(endpoint)
    yield endpoint
    sgl.global_config.default_backend = None
    endpoint.close()


@pytest.fixture(scope="module")
def prompt_logprobs(stack: tuple[str, str]) -> bool:
    """Whether the engine returns prompt-token logprobs (what select needs)."""
    body = {"text": ["Hello there", "Hello world"], "sampling_params": {"max_new_tokens": 0}}
    body |= {"return_logprob": True, "logprob_start_len": 1, "return_text_in_logprobs": True}
    r = httpx.post(stack[1] + "/generate", json=body, timeout=60)
    return r.status_code == 200 and all(isinstance(x["meta_info"].get("input_token_logprobs"), list) for x in r.json())


@pytest.fixture
def needs_prompt_logprobs(prompt_logprobs: bool) -> None:
    if not prompt_logprobs:
        pytest.skip("the engine returns no input_token_logprobs yet (issue 15's engine side): select cannot score")


def engine_counters(engine: str) -> dict[str, float]:
    """The engine's prompt and cached token counters (``radixserve_engine_*_tokens_total``)."""
    text = httpx.get(engine + "/metrics", timeout=10).text
    out = {}
    for name in ("prompt_tokens_total", "cached_tokens_total"):
        m = re.search(rf"^radixserve_engine_{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        assert m, name
        out[name] = float(m.group(1))
    return out


def prompt_tokens(engine: str, text: str) -> int:
    """How many tokens ``text`` is as a /generate prompt."""
    r = httpx.post(engine + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 0}}, timeout=60)
    r.raise_for_status()
    return int(r.json()["meta_info"]["prompt_tokens"])


def test_the_chat_template_is_the_models_own_through_router_and_engine(stack: tuple[str, str], backend: Any) -> None:
    template = backend.get_chat_template()
    assert template.default_system_prompt and "SmolLM" in template.default_system_prompt
    assert template.role_prefix_and_suffix["user"] == ("<|im_start|>user\n", "<|im_end|>\n")
    assert stack[1] in (backend.chat_template_source or "")  # the router listed the engine that served it
    direct = sgl.RuntimeEndpoint(stack[1])
    assert direct.get_chat_template() == template
    direct.close()


def test_multi_turn_chat_keeps_roles_in_order_and_reuses_each_turn(backend: Any) -> None:
    example = load_example("multi_turn_chat")
    state = example.run_example()
    assert state.error() is None
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system"] + ["user", "assistant"] * len(example.QUESTIONS)
    answers = [state[f"answer_{i}"] for i in range(len(example.QUESTIONS))]
    assert all(isinstance(a, str) and "\n" not in a for a in answers)  # the stop string holds
    assert [m["content"] for m in state.messages() if m["role"] == "assistant"] == [a.lstrip() for a in answers]
    # Each turn's prompt is the conversation so far: the turn before it is served from the radix cache.
    first, last = state.get_meta_info("answer_0"), state.get_meta_info("answer_2")
    assert last["cached_tokens"] >= first["prompt_tokens"]


def test_few_shot_run_batch_shares_the_prefix(stack: tuple[str, str], backend: Any, capsys: Any) -> None:
    example = load_example("few_shot_qa")
    shared = prompt_tokens(stack[1], example.FEW_SHOT)
    before = engine_counters(stack[1])
    states = example.run_example()
    after = engine_counters(stack[1])
    assert len(states) == len(example.QUESTIONS)
    for question, state in zip(example.QUESTIONS, states):
        assert state.error() is None and question in state.text()
        assert isinstance(state["answer"], str) and "\n" not in state["answer"]
    assert f"{len(states)}/{len(states)}" in capsys.readouterr().err  # tqdm's progress bar
    # Traced and cached once before the batch: every program's gen finds the few-shot prefix in the cache.
    cached = after["cached_tokens_total"] - before["cached_tokens_total"]
    assert cached >= (len(states) - 1) * shared, (cached, shared)
    assert all(s.get_meta_info("answer")["cached_tokens"] >= shared - 1 for s in states)


def test_fork_tips_join_both_ways_with_the_prefix_prefilled_once(stack: tuple[str, str], backend: Any) -> None:
    example = load_example("fork_tips")
    gathered, appended = example.run_example()
    assert gathered.error() is None and appended.error() is None
    tips = gathered["detailed_tip"]
    assert isinstance(tips, list) and len(tips) == len(example.TIPS) and all(isinstance(t, str) for t in tips)
    assert all(t.strip() and "\n" not in t for t in tips)
    text = appended.text()
    positions = [text.index(f"expand tip {i + 1} into a sentence") for i in range(len(example.TIPS))]
    assert positions == sorted(positions)  # each fork's text appended in order
    assert "detailed_tip" not in appended and isinstance(appended["summary"], str)
    # The text before the fork was prefilled once (before the forks): every fork found it cached.
    shared = prompt_tokens(stack[1], example.INTRO)
    for fork in gathered.ret_value:
        assert fork.get_meta_info("detailed_tip")["cached_tokens"] >= shared - 1


def test_json_program_parses_with_typed_values(backend: Any) -> None:
    example = load_example("json_program")
    state = example.run_example()
    assert state.error() is None
    record = example.record(state)
    assert isinstance(record["name"], str) and isinstance(record["age"], int) and isinstance(record["hero"], bool)
    assert re.fullmatch(REGEX_STR, state["name"]) and re.fullmatch(REGEX_INT, state["age"])
    assert re.fullmatch(example.EMAIL_REGEX, state["email"])  # the regex gen matches in full
    assert int(state["age"]) == record["age"]


def test_tool_use_feeds_the_functions_result_back(backend: Any) -> None:
    example = load_example("tool_use")
    state = example.run_example()
    assert state.error() is None
    city = state["city"]
    assert re.fullmatch(example.CITY_REGEX, city) and example.CALLS == [city.strip()]
    assert f'"city": "{city.strip()}"' in state.text()  # the tool's result is in the prompt of the answer
    assert isinstance(state["answer"], str) and state["answer"].strip()


def test_dtype_gens_parse_and_stops_hold(backend: Any) -> None:
    @sgl.function
    def numbers(s: Any) -> None:
        s += "Pi is about " + sgl.gen("pi", dtype=float, max_tokens=6) + "\n"
        s += "A week has " + sgl.gen_int("days", max_tokens=3) + " days.\n"
        s += "Is water wet? " + sgl.gen("wet", dtype=bool) + "\n"
        s += "List three fruits separated by commas: " + sgl.gen("fruits", max_tokens=24, stop=[",", "\n"])

    state = numbers.run()
    assert state.error() is None
    float(state["pi"]), int(state["days"])
    assert state["wet"] in ("True", "False")
    assert "," not in state["fruits"] and "\n" not in state["fruits"]


def test_streamed_pieces_join_to_the_variable(backend: Any) -> None:
    @sgl.function
    def story(s: Any) -> None:
        s += sgl.user("Tell me a very short story about a robot.")
        s += sgl.assistant(sgl.gen("story", max_tokens=16, ignore_eos=True))

    state = story.run(stream=True)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1 and "".join(pieces) == state["story"]
    assert state.get_meta_info("story")["completion_tokens"] == 16
    whole = story.run(stream=True)
    assert "".join(whole.text_iter()) == whole.text()


@pytest.mark.usefixtures("needs_prompt_logprobs")
def test_select_returns_a_choice_with_its_logprobs(backend: Any) -> None:
    example = load_example("select_choice")
    state = example.run_example()
    assert state.error() is None
    assert state["color"] in example.OPTIONS and state["again"] in example.OPTIONS
    meta = state.get_meta_info("color")
    scores = meta["normalized_prompt_logprobs"]
    assert len(scores) == len(example.OPTIONS) and all(isinstance(x, float) and x <= 0 for x in scores)
    assert scores.index(max(scores)) == example.OPTIONS.index(state["color"])
    assert [len(t) for t in meta["input_token_logprobs"]] == [1, 1, 1]  # each color is one token after " is "
    assert "greedy_logprob_matrix" in state.get_meta_info("again")


@pytest.mark.usefixtures("needs_prompt_logprobs")
def test_select_scores_the_shared_prefix_once(stack: tuple[str, str], backend: Any) -> None:
    choices = ["alpha", "beta", "gamma", "delta"]

    @sgl.function
    def pick(s: Any, filler: str) -> None:
        s += filler + " Pick a Greek letter:" + sgl.gen("warmup", max_tokens=1)
        s += " The letter is " + sgl.select("letter", choices)

    filler = " ".join(f"item{i}" for i in range(150))
    state = pick.run(filler=filler)
    assert state.error() is None and state["letter"] in choices
    meta = state.get_meta_info("letter")
    # One request, starting its logprobs HEALING_TOKENS before the warm-up's prompt ended: the engine served each
    # choice's prompt from the cache up to just before that start (it caps the match there).
    prefix = state.get_meta_info("warmup")["prompt_tokens"]
    least = prefix - sgl.RuntimeEndpoint.HEALING_TOKENS - 1
    assert all(c >= least for c in meta["cached_tokens"]), (meta["cached_tokens"], prefix)


@pytest.mark.usefixtures("needs_prompt_logprobs")
def test_intent_routing_answers_by_branch(backend: Any) -> None:
    example = load_example("intent_routing")
    states = example.run_example()
    assert len(states) == len(example.MESSAGES)
    for state in states:
        assert state.error() is None and state["intent"] in example.INTENTS
        branch = "as a forecaster would" if state["intent"] == "weather" else "one friendly sentence"
        assert branch in state.text() and isinstance(state["answer"], str)
        assert "\n" not in state["answer"]
