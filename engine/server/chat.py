"""Chat messages → prompt text through the tokenizer's chat template (as SGLang's ``serving_chat`` and vLLM do)."""

from __future__ import annotations

from typing import Any

from radixserve.engine.io_struct import InvalidRequestError
from radixserve.protocol import ChatCompletionRequest, ChatMessage

_ROLES = {"system", "user", "assistant", "tool", "developer"}
_IMAGE_PARTS = {"image_url", "input_image", "image"}
_AUDIO_PARTS = {"input_audio", "audio"}


def flatten_content(message: ChatMessage, i: int) -> str:
    """A message's content as one string: text parts joined by newlines (vLLM's "string" content format).

    Raises ``InvalidRequestError`` for image or audio parts (this model takes text only) and unknown part types.
    """
    content = message.content
    if content is None:
        return ""  # an assistant turn that only carried tool calls
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        param = f"messages[{i}].content[{j}]"
        if part.type == "text":
            if part.text is None:
                raise InvalidRequestError("a text content part needs a 'text' string", param)
            texts.append(part.text)
        elif part.type in _IMAGE_PARTS:
            raise InvalidRequestError("The model does not accept image input", param)
        elif part.type in _AUDIO_PARTS:
            raise InvalidRequestError("The model does not accept audio input", param)
        else:
            raise InvalidRequestError(f"unsupported content part type {part.type!r}", param)
    return "\n".join(texts)


def check_unsupported(req: ChatCompletionRequest) -> None:
    """Refuse what would need constrained decoding or tool calling, never generate unconstrained instead."""
    fmt = req.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        raise InvalidRequestError(
            f"response_format {fmt.get('type')!r} is not supported yet (constrained decoding)", "response_format"
        )
    choice = req.tool_choice
    if req.tools:
        if choice != "none":
            raise InvalidRequestError(
                "tools are not supported yet (constrained decoding); only tool_choice 'none' is accepted", "tools"
            )
    elif choice is not None and choice != "none":
        raise InvalidRequestError("tool_choice is set but no tools were given", "tool_choice")


def render_prompt(tokenizer: Any, req: ChatCompletionRequest) -> str:
    """Render ``req.messages`` with the tokenizer's chat template and ``add_generation_prompt=True``.

    Raises ``InvalidRequestError`` for no messages, an unknown role, non-text content, or a template error.
    """
    if not req.messages:
        raise InvalidRequestError("messages must hold at least one message", "messages")
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise InvalidRequestError(f"unknown role {m.role!r}", f"messages[{i}].role")
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for the system role
        msg: dict[str, Any] = {"role": role, "content": flatten_content(m, i)}
        if m.name is not None:
            msg["name"] = m.name
        messages.append(msg)
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - jinja errors (e.g. a template refusing a role order) are client errors
        raise InvalidRequestError(f"the chat template could not render these messages: {e}", "messages") from e
    if not isinstance(prompt, str):  # pragma: no cover - tokenize=False returns a string
        raise InvalidRequestError("the chat template did not produce text", "messages")
    return prompt
