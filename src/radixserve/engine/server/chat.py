"""Chat messages → prompt text through the tokenizer's chat template (as SGLang's ``serving_chat`` and vLLM do).

Templates differ in what they take; ``TemplateCaps`` probes the template once: whether it renders ``tools`` (the
text changes when ``tools=`` is passed) and whether it takes ``content`` as a list of parts (vLLM's "openai" content
format) or only strings (vLLM's "string" format, the demo model's ChatML template). For a string-only template
text parts are joined by newlines; for a template without tool support the tool definitions go into the system
message and past calls into the assistant text (formats in ``engine/server/tools.py``).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any

from radixserve.contracts.protocol import ChatCompletionRequest, ChatMessage
from radixserve.engine.io_struct import InvalidRequestError
from radixserve.engine.server.tools import render_call_text, tools_prompt

_ROLES = {"system", "user", "assistant", "tool", "developer"}
_IMAGE_PARTS = {"image_url", "input_image", "image"}
_AUDIO_PARTS = {"input_audio", "audio"}
_PROBE = "radixserve-probe-7f3a"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "radixserve_probe_tool",
        "description": _PROBE,
        "parameters": {"type": "object", "properties": {}},
    },
}


@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template handles: ``tools`` (renders tool definitions), ``content_lists`` (takes ``content`` as
    ``[{"type": "text", "text": ...}]`` and renders the text, not the list's repr)."""

    tools: bool = False
    content_lists: bool = False

    @classmethod
    def probe(cls, tokenizer: Any) -> TemplateCaps:
        """Render two probe conversations. Templates that raise on a probe lack that feature."""
        msgs = [{"role": "user", "content": "hi"}]

        def render(messages: list[dict[str, Any]], **kw: Any) -> str | None:
            try:
                out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
            except Exception:  # noqa: BLE001 - a template refusing the probe lacks the feature
                return None
            return out if isinstance(out, str) else None

        if getattr(tokenizer, "chat_template", None) is None:
            return cls()
        plain = render(msgs)
        with_tools = render(msgs, tools=[_PROBE_TOOL])
        tools = plain is not None and with_tools is not None and with_tools != plain
        listed = render([{"role": "user", "content": [{"type": "text", "text": _PROBE}]}])
        content_lists = listed is not None and _PROBE in listed and "'text'" not in listed and '"text"' not in listed
        return cls(tools=tools, content_lists=content_lists)


@dataclass
class RenderOptions:
    """How to render one request: the tools to show the model (``None``: none), the template's ``caps``, and the
    compatibility switches ``flatten_tool_content`` and ``accept_bare_image_url`` (see ``EngineArgs``)."""

    functions: list[dict[str, Any]] | None = None
    caps: TemplateCaps | None = None  # None: probed on the tokenizer
    flatten_tool_content: bool = False
    accept_bare_image_url: bool = False


def _text_parts(message: ChatMessage, i: int, accept_bare_image_url: bool) -> list[str] | None:
    """The texts of a list ``content`` (None for string or null content).

    Raises ``InvalidRequestError`` for image or audio parts (this model takes text only), a bare-string
    ``image_url`` unless ``accept_bare_image_url``, and unknown part types."""
    content = message.content
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    for j, part in enumerate(content):
        param = f"messages[{i}].content[{j}]"
        if part.type == "text":
            if part.text is None:
                raise InvalidRequestError("a text content part needs a 'text' string", param)
            texts.append(part.text)
        elif part.type in _IMAGE_PARTS:
            image = (part.model_extra or {}).get(part.type)
            if isinstance(image, str):
                if not accept_bare_image_url:
                    raise InvalidRequestError(
                        f'{part.type} must be an object {{"url": ...}}, got a bare string', f"{param}.{part.type}"
                    )
                # Normalised to {"url": image}; it is still an image, which this text-only model refuses.
            raise InvalidRequestError("The model does not accept image input", param)
        elif part.type in _AUDIO_PARTS:
            raise InvalidRequestError("The model does not accept audio input", param)
        else:
            raise InvalidRequestError(f"unsupported content part type {part.type!r}", param)
    return texts


def flatten_content(message: ChatMessage, i: int, accept_bare_image_url: bool = False) -> str:
    """A message's content as one string: text parts joined by newlines (vLLM's "string" content format).

    Raises ``InvalidRequestError`` for image or audio parts (this model takes text only) and unknown part types.
    """
    texts = _text_parts(message, i, accept_bare_image_url)
    if texts is None:
        return message.content or ""  # type: ignore[return-value]  # null: an assistant turn that only called tools
    return "\n".join(texts)


def _arguments_object(call: Any) -> Any:
    """A past call for a template with tool support: ``arguments`` JSON text → the object (as Qwen/Llama templates
    expect, applying ``tojson`` themselves)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return {**call, "function": fn}


def check_tool_fields(message: ChatMessage, i: int) -> None:
    """OpenAI's checks of a message's tool fields (each a 400 naming the field):

    * a ``role: "tool"`` message needs ``tool_call_id`` (the call it answers) and non-null ``content``; so does a
      ``user``, ``system`` or ``developer`` message need ``content`` (regression: ``{"role": "user"}``, or a
      misspelled ``contnet``, was rendered as an empty turn);
    * each assistant ``tool_calls`` entry needs ``function.name`` (a non-empty string) and ``function.arguments``,
      JSON text (a JSON object given as such is accepted too, as Hugging Face templates take it).
    """
    where = f"messages[{i}]"
    if message.role in ("user", "system", "developer") and message.content is None:
        raise InvalidRequestError(f"a message with role {message.role!r} must have content", f"{where}.content")
    if message.role == "tool":
        if message.tool_call_id is None:
            raise InvalidRequestError(
                "a message with role 'tool' must have a 'tool_call_id' (the id of the call it answers)",
                f"{where}.tool_call_id",
            )
        if message.content is None:
            raise InvalidRequestError(
                "a message with role 'tool' must have content (the call's result)", f"{where}.content"
            )
    for j, call in enumerate(message.tool_calls or []):
        param = f"{where}.tool_calls[{j}]"
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(
                'a tool call needs a \'function\' object {"name", "arguments"}', f"{param}.function"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("a tool call's function needs a 'name' string", f"{param}.function.name")
        if "arguments" not in fn or fn["arguments"] is None:
            raise InvalidRequestError(
                "a tool call's function needs 'arguments' (JSON text)", f"{param}.function.arguments"
            )
        args = fn["arguments"]
        if isinstance(args, str):
            try:
                json.loads(args)
            except ValueError as e:
                raise InvalidRequestError(
                    f"a tool call's arguments must be valid JSON text: {e}", f"{param}.function.arguments"
                ) from None
        elif not isinstance(args, dict):
            raise InvalidRequestError(
                f"a tool call's arguments must be JSON text, got {type(args).__name__}", f"{param}.function.arguments"
            )


def _message_dicts(req: ChatCompletionRequest, opts: RenderOptions, caps: TemplateCaps) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise InvalidRequestError(f"unknown role {m.role!r}", f"messages[{i}].role")
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for the system role
        check_tool_fields(m, i)
        texts = _text_parts(m, i, opts.accept_bare_image_url)
        content: Any
        if texts is None:
            content = m.content or ""
        elif not caps.content_lists or (role == "tool" and opts.flatten_tool_content):
            content = "\n".join(texts)
        else:
            content = [{"type": "text", "text": t} for t in texts]
        msg: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            if role != "assistant":
                raise InvalidRequestError("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
            if caps.tools:
                msg["tool_calls"] = [_arguments_object(c) for c in m.tool_calls]
            else:
                calls = render_call_text(m.tool_calls)
                if isinstance(content, list):
                    msg["content"] = content + [{"type": "text", "text": calls}]
                else:
                    msg["content"] = f"{content}\n{calls}" if content else calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    if opts.functions and not caps.tools:
        prompt = tools_prompt(opts.functions)
        if messages and messages[0]["role"] == "system":
            first = messages[0]["content"]
            if isinstance(first, list):
                messages[0]["content"] = first + [{"type": "text", "text": prompt}]
            else:
                messages[0]["content"] = f"{first}\n\n{prompt}" if first else prompt
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def template_variables(tokenizer: Any, extra: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs``, the request's extra chat-template variables, checked: none may be an argument of
    ``apply_chat_template`` itself (``tokenize``, ``tools``, ``chat_template`` ...) nor ``messages``, which the
    server sets from the request (400 naming ``chat_template_kwargs.<key>``)."""
    if not extra:
        return {}
    reserved = {"messages", *inspect.signature(tokenizer.apply_chat_template).parameters} - {"kwargs"}
    for name in extra:
        if name in reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {name!r}: the server sets it from the request",
                f"chat_template_kwargs.{name}",
            )
    return dict(extra)


def render_prompt(tokenizer: Any, req: ChatCompletionRequest, opts: RenderOptions | None = None) -> str:
    """Render ``req.messages`` with the tokenizer's chat template and ``add_generation_prompt=True``, its
    ``chat_template_kwargs`` as extra template variables.

    ``opts``: tools to show and compatibility switches (default: none). Raises ``InvalidRequestError`` for no
    messages, an unknown role, non-text content, a reserved ``chat_template_kwargs`` key, or a template error.
    """
    opts = opts or RenderOptions()
    if not req.messages:
        raise InvalidRequestError("messages must hold at least one message", "messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
    caps = opts.caps if opts.caps is not None else TemplateCaps.probe(tokenizer)
    messages = _message_dicts(req, opts, caps)
    kwargs = template_variables(tokenizer, req.chat_template_kwargs)
    if opts.functions and caps.tools:
        kwargs["tools"] = [{"type": "function", "function": fn} for fn in opts.functions]
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja errors (e.g. a template refusing a role order) are client errors
        raise InvalidRequestError(f"the chat template could not render these messages: {e}", "messages") from e
    if not isinstance(prompt, str):  # pragma: no cover - tokenize=False returns a string
        raise InvalidRequestError("the chat template did not produce text", "messages")
    return prompt
