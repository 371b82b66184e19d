"""``--chat-template`` (vLLM's and SGLang's flag): a Jinja file or inline template replacing the tokenizer's, checked at
start-up. Regression (issue 11, item 11): there was no way to serve a model with another chat template."""

from __future__ import annotations

import pytest

from radixserve.contracts.protocol import ChatCompletionRequest
from radixserve.engine.server.chat import render_prompt
from radixserve.engine.tokenizer.chat_template import apply_chat_template_flag, load_chat_template
from radixserve.launch.cli import main

from fake_engine import load_tokenizer
from tiny_model import write_tiny_model

TINY = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)
CHAT = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}])


def test_file_and_inline_templates_load(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TINY)
    assert load_chat_template(str(path)) == TINY
    assert load_chat_template(TINY) == TINY  # inline: it holds Jinja characters


def test_the_template_replaces_the_tokenizers_and_is_saved_for_the_router(tmp_path):
    tok = load_tokenizer()
    assert render_prompt(tok, CHAT) != "[user] Hi\n>"  # the demo model's own template
    apply_chat_template_flag(tok, TINY)
    assert render_prompt(tok, CHAT) == "[user] Hi\n>"
    tok.save_pretrained(tmp_path)  # what /get_tokenizer_files serves the router
    saved = "".join(p.read_text() for p in tmp_path.iterdir() if p.suffix in (".jinja", ".json"))
    assert "[{{ m['role'] }}]" in saved


@pytest.mark.parametrize(
    "value, message",
    [
        ("/nonexistent/template.jinja", r"--chat-template '/nonexistent/template.jinja': no such file"),
        ("{% for m in messages %}{{ m }}", r"--chat-template: the template does not compile \(line 1\)"),
    ],
)
def test_a_missing_file_or_a_broken_template_is_a_start_up_error_naming_the_flag(value, message, capsys):
    with pytest.raises(ValueError, match=message):
        load_chat_template(value)
    for command in ("engine", "up"):  # refused by the parser's checks, before any model or engine is loaded
        assert main([command, "--chat-template", value]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"radixserve {command}: --chat-template") and len(err.strip().splitlines()) == 1


def test_the_engine_serves_with_the_flags_template(tmp_path):
    from radixserve.engine.config import EngineArgs
    from radixserve.engine.engine import Engine

    model = write_tiny_model(tmp_path / "tiny")
    engine = Engine(
        EngineArgs(model_path=model, device="cpu", dtype="float32", max_total_tokens=256, chat_template=TINY)
    )
    try:
        assert engine.tokenizer.chat_template == TINY
        assert render_prompt(engine.tokenizer, CHAT) == "[user] Hi\n>"
    finally:
        engine.shutdown()
