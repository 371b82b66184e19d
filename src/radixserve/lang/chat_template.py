"""Chat templates as role markers: the text before and after each role's content (SGLang's ``ChatTemplate``).

A program's ``s.user(...)`` / ``s.assistant(...)`` blocks are plain text in the prompt; rendering them needs only each
role's prefix and suffix, the system prompt a template inserts by itself, and the stop string that ends an assistant
turn. ``from_jinja`` reads them off the model's own Jinja chat template (what the engine's chat endpoints render) by
rendering a conversation of sentinel messages; ``get_chat_template`` / ``match_chat_template`` are a small registry of
SGLang's named templates for servers that do not hand out their template.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    """Role markers of one chat format.

    Attributes:
        name: the template's name (a registry name, or ``"jinja"`` for one read off a model's template).
        default_system_prompt: the system message the template inserts when a conversation has none, or None.
        role_prefix_and_suffix: ``{role: (prefix, suffix)}``; an unknown role gets ``("", "")``.
        stop_str: strings that end an assistant turn; added to every ``gen``'s stop strings, as SGLang does.
    """

    name: str
    default_system_prompt: str | None
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    stop_str: tuple[str, ...] = ()

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict[str, Any]]) -> tuple[str, str]:
        """The text before and after a ``role`` message (``hist_messages``, the messages so far, is SGLang's
        signature; the plain templates here do not depend on it)."""
        return self.role_prefix_and_suffix.get(role, ("", ""))

    def get_prompt(self, messages: list[dict[str, Any]]) -> str:
        """``messages`` (``{"role", "content"}``) rendered with the markers; a system message with content None
        takes the default system prompt (and is left out when there is none)."""
        prompt = ""
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            if role == "system" and content is None:
                content = self.default_system_prompt
                if content is None:
                    continue
            prefix, suffix = self.get_prefix_and_suffix(role, messages[:i])
            prompt += f"{prefix}{content}{suffix}"
        return prompt


_REGISTRY: dict[str, ChatTemplate] = {}


def register_chat_template(template: ChatTemplate) -> None:
    """Add ``template`` to the registry under its name (replacing one of the same name)."""
    _REGISTRY[template.name] = template


def get_chat_template(name: str) -> ChatTemplate:
    """The registered template ``name``. Raises KeyError naming the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown chat template {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def _chatml(name: str, default_system_prompt: str | None) -> ChatTemplate:
    return ChatTemplate(
        name=name,
        default_system_prompt=default_system_prompt,
        role_prefix_and_suffix={r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES},
        stop_str=("<|im_end|>",),
    )


register_chat_template(
    ChatTemplate(
        name="default",
        default_system_prompt=None,
        role_prefix_and_suffix={r: (f"{r.upper()}:", "\n") for r in ROLES},
    )
)
register_chat_template(_chatml("chatml", None))
register_chat_template(_chatml("qwen", "You are a helpful assistant."))
register_chat_template(
    ChatTemplate(
        name="llama-3-instruct",
        default_system_prompt=None,
        role_prefix_and_suffix={r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ROLES},
        stop_str=("<|eot_id|>",),
    )
)

# (substring of the lower-cased model path or name, template name), first match wins; else "default".
_NAME_RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("llama-3", "llama3"), "llama-3-instruct"),
    (("qwen",), "qwen"),
    (("smollm", "chatml", "hermes", "tinyllama"), "chatml"),
)


def match_chat_template(model_path: str) -> ChatTemplate:
    """The registered template for a model path or name, by SGLang's kind of name matching (``"default"`` when
    nothing matches)."""
    lowered = model_path.lower()
    for needles, name in _NAME_RULES:
        if any(n in lowered for n in needles):
            return get_chat_template(name)
    return get_chat_template("default")


# ----------------------------------------------------------------------------------------------------------------------
# Markers read off a Jinja chat template
# ----------------------------------------------------------------------------------------------------------------------

_SENTINEL = {"system": "QsysSENTINELq", "user": "QuserSENTINELq", "assistant": "QasstSENTINELq"}


class ChatTemplateError(ValueError):
    """A Jinja chat template whose role markers cannot be read off it (it renders roles out of order, rewrites the
    content, or fails to render a plain system / user / assistant conversation)."""


def _jinja_renderer(source: str, bos_token: str, eos_token: str) -> Callable[..., str]:
    """``render(messages, add_generation_prompt)`` with ``source`` in a sandbox, with the globals and filters Hugging
    Face templates use (``raise_exception``, ``strftime_now``, ``tojson``)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    template = env.from_string(source)

    def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=None,
        )

    return render


def from_jinja(source: str, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
    """Role markers of the Jinja chat template ``source`` (a tokenizer's ``chat_template``).

    Renders system / user / assistant conversations of sentinel contents and cuts the markers out between them. The
    BOS token is rendered empty by default: a text prompt sent to ``/generate`` gets it from the tokenizer. A
    template that cannot render a system message gets empty system markers. Raises ``ChatTemplateError`` when the
    markers cannot be read off.
    """
    from jinja2.exceptions import TemplateError

    render = _jinja_renderer(source, bos_token, eos_token)
    S, U, A = (_SENTINEL[r] for r in ROLES)

    def msg(role: str) -> dict[str, str]:
        return {"role": role, "content": _SENTINEL[role]}

    def cut(text: str, start: str | None, end: str | None) -> str:
        """The text between sentinel ``start`` (or the beginning) and sentinel ``end`` (or the end)."""
        i = 0 if start is None else text.index(start) + len(start)
        j = len(text) if end is None else text.index(end)
        if j < i:
            raise ChatTemplateError("the template renders the roles out of order")
        return text[i:j]

    def drop_prefix(text: str, prefix: str) -> str:
        return text[len(prefix) :] if prefix and text.startswith(prefix) else text

    try:
        try:
            full = render([msg("system"), msg("user"), msg("assistant")])
            system_only = render([msg("system")])
            has_system = S in full and S in system_only
        except TemplateError:
            has_system = False
        if has_system:
            system_prefix = cut(full, None, S)
            system_suffix = cut(system_only, S, None)
            user_prefix = drop_prefix(cut(full, S, U), system_suffix)
            with_user = render([msg("system"), msg("user")])
            history = [msg("system"), msg("user")]
        else:
            system_prefix = system_suffix = ""
            full = render([msg("user"), msg("assistant")])
            with_user = render([msg("user")])
            user_prefix = cut(full, None, U)
            history = [msg("user")]
        user_suffix = cut(with_user, U, None)
        assistant_prefix = drop_prefix(cut(full, U, A), user_suffix)
        assistant_suffix = cut(full, A, None)
        generation_prompt = render(history, True)
        if generation_prompt.startswith(with_user) and len(generation_prompt) > len(with_user):
            assistant_prefix = generation_prompt[len(with_user) :]  # where generation starts wins over history
        default_system = None
        if has_system:
            before_user = cut(render([msg("user")]), None, U)
            if before_user.endswith(user_prefix):
                before_user = before_user[: len(before_user) - len(user_prefix)]
            if before_user.startswith(system_prefix) and before_user.endswith(system_suffix) and before_user:
                inner = before_user[len(system_prefix) : len(before_user) - len(system_suffix)]
                default_system = inner or None
    except (TemplateError, ValueError) as e:  # ValueError: str.index found no sentinel (the content was rewritten)
        if isinstance(e, ChatTemplateError):
            raise
        raise ChatTemplateError(f"cannot read role markers off the chat template: {e}") from e
    for sentinel in (S, U, A):
        for marker in (system_prefix, system_suffix, user_prefix, user_suffix, assistant_prefix, assistant_suffix):
            if sentinel in marker:
                raise ChatTemplateError("the template repeats a message's content outside its turn")
    stop = assistant_suffix.strip()
    return ChatTemplate(
        name="jinja",
        default_system_prompt=default_system,
        role_prefix_and_suffix={
            "system": (system_prefix, system_suffix),
            "user": (user_prefix, user_suffix),
            "assistant": (assistant_prefix, assistant_suffix),
        },
        stop_str=(stop,) if stop else (),
    )


def special_token_text(value: Any) -> str:
    """A tokenizer_config.json special token (a string, or an ``AddedToken`` dict with ``content``) as text; ``""``
    for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def from_tokenizer_files(files: dict[str, str]) -> ChatTemplate | None:
    """The markers of the chat template in a tokenizer's files (an engine's ``GET /get_tokenizer_files`` ``files``):
    ``chat_template.jinja``, else tokenizer_config.json's ``chat_template`` (a string, or a list of named templates:
    the ``default`` one). None when there is no template. Raises ``ChatTemplateError`` as ``from_jinja``."""
    try:
        config = json.loads(files.get("tokenizer_config.json", "{}"))
    except json.JSONDecodeError:
        config = {}
    if not isinstance(config, dict):
        config = {}
    source: Any = files.get("chat_template.jinja") or config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source.strip():
        return None
    return from_jinja(source, eos_token=special_token_text(config.get("eos_token")))
