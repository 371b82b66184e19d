"""radixserve.lang's interpreter on an in-process fake backend: state, variables, sampling defaults, roles, select,
forks (concurrent, both joins), streaming, run_batch (order, progress bar, the traced prefix cached once), errors."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest

import radixserve.lang as sgl
from radixserve.lang.chat_template import ChatTemplate, get_chat_template
from radixserve.lang.choices import ChoicesDecision, ChoicesSamplingMethod, mean_logprob
from radixserve.lang.interpreter import extract_prefix_by_tracing
from radixserve.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, SglSamplingParams

SMOL = ChatTemplate(
    name="smol",
    default_system_prompt="You are helpful.",
    role_prefix_and_suffix={r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant")},
    stop_str=("<|im_end|>",),
)


def default_reply(text: str, params: SglSamplingParams) -> str:
    by_regex = {REGEX_INT: "42", REGEX_FLOAT: "3.5", REGEX_BOOL: "True", REGEX_STR: '"Ada Lovelace"'}
    if params.regex in by_regex:
        return by_regex[params.regex]
    return "alpha beta\ngamma"


class FakeBackend:
    """Answers gens with ``reply(text, params)`` cut at the first stop string; scores a select's choices by how often
    each occurs in the text (one fake token per character). Records every call as (kind, text, params)."""

    def __init__(self, template: ChatTemplate = SMOL, reply: Any = default_reply, delay_s: float = 0.0):
        self.template = template
        self.reply = reply
        self.delay_s = delay_s
        self.calls: list[tuple[str, str, Any]] = []
        self.lock = threading.Lock()

    def _record(self, kind: str, text: str, extra: Any) -> None:
        with self.lock:
            self.calls.append((kind, text, extra))

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]

    def get_chat_template(self) -> ChatTemplate:
        return self.template

    def generate(self, text: str, params: SglSamplingParams) -> tuple[str, dict[str, Any]]:
        self._record("generate", text, params)
        if self.delay_s:
            time.sleep(self.delay_s)
        out = self.reply(text, params)
        for stop in params.stop_list():
            if stop in out:
                out = out[: out.index(stop)]
        return out, {"prompt_tokens": len(text), "completion_tokens": len(out), "cached_tokens": 0}

    def generate_stream(self, text: str, params: SglSamplingParams) -> Any:
        out, meta = self.generate(text, params)
        for i in range(0, len(out), 3):
            time.sleep(0.01)  # a reader sees the pieces arrive one by one
            yield out[i : i + 3], meta

    def select(self, text: str, choices: Any, method: ChoicesSamplingMethod, prefix: Any) -> ChoicesDecision:
        self._record("select", text, prefix)
        tokens = [[[-1.0 / (1 + text.count(c)), i, ch] for i, ch in enumerate(c)] for c in choices]
        decision = method(
            choices=list(choices),
            normalized_prompt_logprobs=[mean_logprob(t) for t in tokens],
            input_token_logprobs=tokens,
            output_token_logprobs=[[] for _ in choices],
        )
        decision.meta_info["prompt_tokens"] = [len(text + c) for c in choices]
        return decision

    def cache_prefix(self, text: str) -> int:
        self._record("cache_prefix", text, None)
        return len(text)

    def flush_cache(self) -> None:
        self._record("flush_cache", "", None)

    def get_server_info(self) -> dict[str, Any]:
        return {"model_path": "fake"}


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


def test_text_variables_and_meta_info(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s: Any, topic: str) -> None:
        s += "Topic: " + topic + "\n"
        s += "Line: " + sgl.gen("line", stop="\n") + "\n"

    state = prog.run(topic="cats", backend=backend)
    assert state["line"] == "alpha beta"
    assert state.text() == "Topic: cats\nLine: alpha beta\n"
    assert state.get_meta_info("line")["prompt_tokens"] == len("Topic: cats\nLine: ")
    assert "line" in state and "other" not in state
    with pytest.raises(KeyError):
        state["other"]
    (_, prompt, params) = backend.calls[0]
    assert prompt == "Topic: cats\nLine: "
    assert params.stop_list() == ["\n", "<|im_end|>"]  # the chat template's stop string added, as SGLang does


def test_sampling_defaults_from_run_under_the_gens_own() -> None:
    backend = FakeBackend()

    @sgl.function(num_api_spec_tokens=64)  # accepted and ignored
    def prog(s: Any) -> None:
        s += sgl.gen("a", max_tokens=7, top_k=5)
        s += sgl.gen("b")

    prog.run(backend=backend, temperature=0.3, max_tokens=11, top_p=0.9)
    a, b = (c[2] for c in backend.calls)
    assert (a.max_new_tokens, a.temperature, a.top_k, a.top_p) == (7, 0.3, 5, 0.9)
    assert (b.max_new_tokens, b.temperature, b.top_k, b.top_p) == (11, 0.3, None, 0.9)
    # Unset fields are not sent: the server's defaults apply (radixserve up: greedy).
    assert b.to_srt_kwargs() == {"max_new_tokens": 11, "stop": ["<|im_end|>"], "temperature": 0.3, "top_p": 0.9}

    @sgl.function
    def takes_max_tokens(s: Any, max_tokens: int) -> None:  # a parameter named like a sampling default is its own
        s += sgl.gen("a", max_tokens=max_tokens)

    takes_max_tokens.run(max_tokens=3, temperature=0.5, backend=backend)
    last = backend.calls[-1][2]
    assert (last.max_new_tokens, last.temperature) == (3, 0.5)


def test_dtype_gens_become_regexes_and_parse(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s: Any) -> None:
        s += "n=" + sgl.gen_int("n") + " x=" + sgl.gen("x", dtype=float) + " ok=" + sgl.gen("ok", dtype=bool)
        s += " name=" + sgl.gen_string("name")

    state = prog.run(backend=backend)
    assert int(state["n"]) == 42 and float(state["x"]) == 3.5 and state["ok"] == "True"
    assert state["name"] == '"Ada Lovelace"'
    params = {c[2].regex: c[2] for c in backend.calls}
    assert set(params) == {REGEX_INT, REGEX_FLOAT, REGEX_BOOL, REGEX_STR}
    assert params[REGEX_INT].stop_list()[-2:] == [" ", "\n"] and params[REGEX_FLOAT].stop_list()[-2:] == [" ", "\n"]
    assert params[REGEX_BOOL].stop_list() == ["<|im_end|>"]
    assert all(p.dtype is None for p in params.values())


def test_gen_arguments() -> None:
    g = sgl.gen("j", json_schema={"type": "object"}, max_new_tokens=9)
    assert g.sampling_params.json_schema == '{"type": "object"}' and g.sampling_params.max_new_tokens == 9  # type: ignore[attr-defined]
    with pytest.raises(re.error):
        sgl.gen("r", regex="[unclosed")
    with pytest.raises(ValueError, match="stop_regex"):
        sgl.gen("r", stop_regex="x")
    # min_tokens reaches the engine as min_new_tokens (it was a ValueError before the engine had it)
    sent = sgl.gen("m", min_tokens=4).sampling_params.to_srt_kwargs()  # type: ignore[attr-defined]
    assert sent["min_new_tokens"] == 4
    with pytest.raises(ValueError, match="non-empty"):
        sgl.select("c", [])
    assert isinstance(sgl.gen("c", choices=["a", "b"]), sgl.api.SglSelect)
    with pytest.raises(ValueError, match="invalid dtype"):
        SglSamplingParams(dtype=list).with_dtype_regex()


def test_roles_render_with_the_template_and_messages_keep_their_order(backend: FakeBackend) -> None:
    @sgl.function
    def chat(s: Any) -> None:
        s += sgl.user("Hi!")
        s += sgl.assistant(sgl.gen("reply", stop="\n"))
        with s.user():
            s += "More?"
        s += sgl.assistant_begin()
        s += sgl.gen("second", stop="\n")
        s += sgl.assistant_end()

    state = chat.run(backend=backend)
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert state.messages()[0]["content"] == "You are helpful."  # the template's default system prompt
    assert state.messages()[2] == {"role": "assistant", "content": "alpha beta"}
    assert state.text().startswith("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n")
    assert backend.calls[0][1].endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


def test_an_explicit_system_message_replaces_the_default(backend: FakeBackend) -> None:
    @sgl.function
    def chat(s: Any) -> None:
        s += sgl.system("Be brief.")
        s += sgl.user("Hi")

    assert [m["content"] for m in chat.run(backend=backend).messages()] == ["Be brief.", "Hi"]


def test_select_picks_a_choice_with_logprobs_and_passes_the_known_prefix(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s: Any) -> None:
        s += "weather weather chat. Intent: " + sgl.gen("first", max_tokens=2)
        s += " Answer: " + sgl.select("intent", choices=["weather", "chat"])

    state = prog.run(backend=backend)
    assert state["intent"] == "weather"
    meta = state.get_meta_info("intent")
    assert len(meta["normalized_prompt_logprobs"]) == 2 and len(meta["input_token_logprobs"][0]) == len("weather")
    gen_call, select_call = backend.calls
    assert select_call[0] == "select"
    assert select_call[2] == (len(gen_call[1]), len(gen_call[1]))  # the gen's prompt: (chars, its prompt tokens)
    assert state.text().endswith(" Answer: weather")


def test_select_with_greedy_token_selection_and_temperature(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s: Any) -> None:
        s += "b b b " + sgl.select("x", ["a", "b"], choices_method=sgl.greedy_token_selection)

    state = prog.run(backend=backend)
    assert state["x"] == "b" and "greedy_logprob_matrix" in state.get_meta_info("x")

    @sgl.function
    def hot(s: Any) -> None:
        s += "x" + sgl.select("x", ["a", "b"], temperature=0.7)

    failed = hot.run(backend=backend)
    assert isinstance(failed.error(), ValueError)
    with pytest.raises(sgl.ProgramError, match="temperature"):
        failed["x"]


def test_forks_run_concurrently_and_join_both_ways() -> None:
    barrier = threading.Barrier(3, timeout=5)  # three forks must be in generate at the same time

    def reply(text: str, params: SglSamplingParams) -> str:
        if text.endswith("Tip:"):
            barrier.wait()
            return f" tip{text.count('#')}"
        return "alpha"

    backend = FakeBackend(reply=reply)

    intro = "Here are tips for a healthy life, each expanded by a fork of its own, in parallel. "

    @sgl.function
    def tips(s: Any, mode: str) -> None:
        s += intro
        forks = s.fork(3)
        forks += lambda i: "#" * (i + 1) + " Tip:"
        forks += sgl.gen("tip", max_tokens=4)
        assert len(forks) == 3 and [f["tip"] for f in forks] == [" tip1", " tip2", " tip3"]
        forks.join(mode)

    gathered = tips.run(mode="gather_variable", backend=backend)
    assert gathered.error() is None
    assert gathered["tip"] == [" tip1", " tip2", " tip3"]
    assert gathered.text() == intro
    assert backend.kinds().count("cache_prefix") == 1  # the shared prefix is prefilled once, before the forks
    assert backend.calls[0] == ("cache_prefix", intro, None)

    appended = tips.run(mode="concate_and_append", backend=backend)
    assert appended.text() == intro + "# Tip: tip1## Tip: tip2### Tip: tip3"
    assert "tip" not in appended


def test_no_prefill_before_a_fork_when_the_server_has_the_text_already(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s: Any) -> None:
        s += "A long enough introduction that it would be worth prefilling before forking. "
        s += sgl.gen("first", stop="\n")
        s += " and then"  # a short tail the forks prefill themselves
        forks = s.fork(2)
        forks += sgl.gen("x", stop=" ")
        forks.join()

    state = prog.run(backend=backend)
    assert state["x"] == ["alpha", "alpha"] and "cache_prefix" not in backend.kinds()


def test_fork_items_from_a_list_and_copy(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s: Any) -> None:
        s += "Start. "
        forks = s.fork(2)
        forks += ["A", sgl.gen("g", stop="\n")]
        forks.join()
        with s.copy() as c:
            c += sgl.gen("copied", stop=" ")

    state = prog.run(backend=backend)
    assert state["g"] == ["alpha beta"] and state["copied"] == ["alpha"]
    with pytest.raises(ValueError, match="2 forks"):
        s = sgl.ProgramState(sgl.interpreter.StreamExecutor(backend, {}, SglSamplingParams()))
        group = s.fork(2)
        group += ["only one"]


def test_var_scope_captures_the_text_inside(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s: Any) -> None:
        with s.var_scope("part"):
            s += "Q: " + sgl.gen("a", stop="\n")
        s += "!"

    state = prog.run(backend=backend)
    assert state["part"] == "Q: alpha beta" and state.text() == "Q: alpha beta!"


def test_streamed_pieces_join_to_the_variable_and_the_text() -> None:
    backend = FakeBackend(reply=lambda text, params: "one two three four five")

    @sgl.function
    def prog(s: Any) -> None:
        s += "Say: " + sgl.gen("said", max_tokens=8)
        s += " Then: " + sgl.gen("then", max_tokens=8)

    state = prog.run(stream=True, backend=backend)
    pieces = list(state.text_iter("then"))
    assert len(pieces) > 1 and "".join(pieces) == state["then"] == "one two three four five"
    state2 = prog.run(stream=True, backend=backend)
    assert "".join(state2.text_iter()) == state2.text() == "Say: one two three four five Then: one two three four five"
    plain = prog.run(backend=backend)
    assert list(plain.text_iter("said")) == ["one two three four five"]


def test_run_batch_returns_one_state_per_input_in_order(backend: FakeBackend, capsys: Any) -> None:
    few_shot = "Q: 1+1? A: 2\nQ: 2+2? A: 4\nQ: 3+3? A: 6\nQ: 4+4? A: 8\nQ: 5+5? A: 10\n"

    @sgl.function
    def qa(s: Any, question: str) -> None:
        s += few_shot
        s += "Q: " + question + " A:" + sgl.gen("answer", stop="\n")

    states = qa.run_batch([{"question": f"{i}+{i}?"} for i in range(6)], backend=backend, progress_bar=True)
    assert [s.text().split("Q: ")[-1].split(" A:")[0] for s in states] == [f"{i}+{i}?" for i in range(6)]
    assert all(s["answer"] == "alpha beta" for s in states)
    assert "6/6" in capsys.readouterr().err  # tqdm's bar
    # The prefix every program starts with was traced and cached once, before the programs ran.
    assert backend.calls[0] == ("cache_prefix", few_shot + "Q: ", None)
    assert backend.kinds().count("cache_prefix") == 1

    positional = qa.run_batch([("7+7?",), ["8+8?"]], backend=backend, num_threads=1)
    assert [s.text().count("Q: 7+7?") for s in positional] == [1, 0]
    with pytest.raises(TypeError):
        qa.run_batch([("a", "b")], backend=backend)
    with pytest.raises(TypeError, match="unexpected"):
        qa.run_batch([{"question": "x"}], backend=backend, stream=True)
    assert qa.run_batch([], backend=backend) == []


def test_tracing_stops_where_the_arguments_are_used(backend: FakeBackend) -> None:
    @sgl.function
    def fstring(s: Any, name: str) -> None:
        s += sgl.system("You sort mail.")
        s += f"Dear {name}"

    @sgl.function
    def concat(s: Any, name: str) -> None:
        s += "Dear " + name + sgl.gen("x")

    system_only = "<|im_start|>system\nYou sort mail.<|im_end|>\n"
    assert extract_prefix_by_tracing(fstring, backend, ["name"]) == system_only
    assert extract_prefix_by_tracing(concat, backend, ["name"]) == "Dear "
    assert backend.calls == []  # tracing sends nothing


def test_errors_surface_where_results_are_read() -> None:
    def broken(text: str, params: SglSamplingParams) -> str:
        raise RuntimeError("engine down")

    backend = FakeBackend(reply=broken)

    @sgl.function
    def prog(s: Any) -> None:
        s += "x" + sgl.gen("a") + sgl.gen("b")

    state = prog.run(backend=backend)
    assert isinstance(state.error(), RuntimeError)
    with pytest.raises(sgl.ProgramError, match="engine down"):
        state["b"]
    assert len(backend.calls) == 1  # nothing runs after the failure

    @sgl.function
    def raises(s: Any) -> None:
        raise LookupError("in the program")

    with pytest.raises(LookupError):
        raises.run(backend=backend)


def test_function_surface(backend: FakeBackend) -> None:
    @sgl.function
    def prog(s: Any, a: str, b: str = "B") -> str:
        s += a + b
        return "done"

    assert prog(a="A", backend=backend).text() == "AB"
    assert prog.bind(b="C").run(a="A", backend=backend).text() == "AC"
    assert prog.run("Z", backend=backend).ret_value == "done"
    with pytest.raises(TypeError):
        prog.bind(c=1)
    with pytest.raises(TypeError, match='"s"'):
        sgl.function(lambda x: None)
    sgl.global_config.default_backend = None
    with pytest.raises(ValueError, match="no backend"):
        prog.run(a="A")
    sgl.set_default_backend(backend)
    try:
        assert prog.run(a="D").text() == "DB"
        assert sgl.flush_cache() and backend.calls[-1][0] == "flush_cache"
        assert sgl.get_server_info() == {"model_path": "fake"}
    finally:
        sgl.global_config.default_backend = None
    assert sgl.flush_cache() is False and sgl.get_server_info() is None


def test_registered_templates() -> None:
    llama3 = get_chat_template("llama-3-instruct")
    assert llama3.get_prompt([{"role": "user", "content": "x"}]) == (
        "<|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|>"
    )
    assert (
        get_chat_template("qwen")
        .get_prompt([{"role": "system", "content": None}])
        .startswith("<|im_start|>system\nYou are a helpful assistant.")
    )
    with pytest.raises(KeyError, match="registered"):
        get_chat_template("nope")
