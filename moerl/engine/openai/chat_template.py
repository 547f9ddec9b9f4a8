"""Chat messages → prompt token ids with the checkpoint's own chat template
(``tokenizer.apply_chat_template``), as SGLang 0.5.23's ``serving_chat.py`` renders them
for a text-only model: content parts joined into one string, the template rendered to
text and tokenized without adding special tokens (the template holds them). A checkpoint
without a chat template is a 400 that says what to do instead (moerl's tiny checkpoints
carry a simple one, ``moerl.models.tokenizer.TINY_CHAT_TEMPLATE``)."""

from __future__ import annotations

from typing import Any

from moerl.engine.validate import RequestError, show

ROLES = ("system", "assistant", "tool", "function", "developer", "user")


def _text_of(content: Any, where: str) -> str | None:
    """A message's content as one string (SGLang's "string" content format): text parts
    joined; any other part is refused, the model being text-only."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, f"must be a string or a list of parts, got {show(content)}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RequestError(
                f"{where}[{j}]",
                f"Model only supports text input; received unsupported content type {show(kind)}",
            )
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates take them: roles checked, content as a string."""
    if not raw:
        raise RequestError("messages", "Messages cannot be empty.")
    out = []
    for i, message in enumerate(raw):
        role = message.get("role")
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise RequestError(f"messages[{i}].role", f"must be one of {ROLES}, got {show(role)}")
        content = _text_of(message.get("content"), f"messages[{i}].content")
        if role.lower() == "user" and content is None:
            raise RequestError(f"messages[{i}].content", "a user message needs content")
        item = {k: v for k, v in message.items() if v is not None}
        item["role"], item["content"] = role.lower(), content or ""
        out.append(item)
    return out


def apply_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    body: dict[str, Any],
    ctk: dict[str, Any],
) -> list[int]:
    """The prompt's token ids from the checkpoint's chat template (rendered to text, then
    tokenized without adding special tokens: the template holds them)."""
    if tokenizer is None:
        raise RequestError(
            "messages", "chat needs a tokenizer in the model directory; send input_ids"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(
            "messages",
            "the checkpoint's tokenizer has no chat template (tokenizer_config.json "
            "chat_template); use /v1/completions, or send the prompt as input_ids",
        )
    cont = bool(body.get("continue_final_message"))
    if cont and messages[-1]["role"] != "assistant":
        raise RequestError("continue_final_message", "the last message must be the assistant's")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=not cont,
            continue_final_message=cont,
            **ctk,
        )
    except Exception as err:  # a template's own raise_exception, a missing variable
        raise RequestError("messages", f"the chat template failed: {err}") from None
    return list(tokenizer(text, add_special_tokens=False).input_ids)
