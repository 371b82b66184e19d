"""``--chat-template``: a Jinja chat template, from a file or given inline, that replaces the tokenizer's own.

Resolution as vLLM's ``load_chat_template``: a path that opens is read as a file; a value holding Jinja or line
characters (``{``, ``}``, a newline) is the template itself; anything else names a file that is not there, an error
rather than a one-line "template" that would render every chat as that path. The template is compiled the way
``apply_chat_template`` compiles it (transformers' sandboxed Jinja environment), so a syntax error is a start-up
error, not a 500 on the first chat request.
"""

from __future__ import annotations

from typing import Any

FLAG = "--chat-template"
_TEMPLATE_CHARS = ("{", "}", "\n")


def load_chat_template(value: str) -> str:
    """The template text of ``value`` (a file path or the template itself), compiled once to check it.

    Raises ValueError naming ``--chat-template``: a file that cannot be read, a value that is neither a readable file
    nor template text, or a template that does not compile (with Jinja's message and line)."""
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        if not any(c in value for c in _TEMPLATE_CHARS):
            raise ValueError(f"{FLAG} {value!r}: no such file ({e.strerror}), nor Jinja template text") from e
        text = value
    except UnicodeDecodeError as e:
        raise ValueError(f"{FLAG} {value!r} is not a UTF-8 text file: {e}") from e
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateError as e:
        line = f" (line {e.lineno})" if isinstance(e, jinja2.TemplateSyntaxError) else ""
        raise ValueError(f"{FLAG}: the template does not compile{line}: {e}") from e
    return text


def apply_chat_template_flag(tokenizer: Any, value: str | None) -> None:
    """Install ``--chat-template`` ``value`` on ``tokenizer`` (no-op for None). The tokenizer's saved files then carry
    it too, so a router rebuilding the tokenizer from ``/get_tokenizer_files`` renders prompts the same way.

    Raises ValueError as ``load_chat_template``."""
    if value is not None:
        tokenizer.chat_template = load_chat_template(value)
