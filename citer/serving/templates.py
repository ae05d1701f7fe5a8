"""How a chat becomes a prompt, and what a client sending a raw completion should send.

The prompt template is part of the model: a tokenizer with its own chat template (real instruct pairs such as Qwen2
or Llama instruct carry one) formats chats with it; otherwise, and for the embedded tokenizer, whose template is
:data:`~citer.data.prompts.CHAT_TEMPLATE`, the training template :func:`~citer.data.prompts.build_prompt` does (for
the task's own message forms the two render the same text, and ``build_prompt`` also checks the mc form).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from citer.data.prompts import ANSWER_CUE, CHAT_TEMPLATE, build_prompt
from citer.serving.errors import RequestError

_CHOICE = re.compile(r"\(([A-Za-z0-9])\)\s*")
# What a raw completion prompt of the training template looks like, per prompt format.
COMPLETION_PROMPTS = {
    "math": f"Question: {{problem}}\n{ANSWER_CUE}",
    "mc": f"Question: {{question}}\nChoices: (A) {{text}} (B) {{text}} ...\n{ANSWER_CUE}",
    "raw": "{text}",
}


def own_template(tokenizer: Any) -> str | None:
    """The tokenizer's chat template when it is its own (not the embedded task's); None otherwise."""
    t = getattr(tokenizer, "chat_template", None)
    if not isinstance(t, str) or not t.strip() or t == CHAT_TEMPLATE:
        return None
    return t


def template_info(fmt: str, tokenizer: Any) -> dict[str, Any]:
    """What ``/v1/models`` tells clients about prompts: which template formats a chat, and which text a raw
    completion should send to get what the models were trained on."""
    own = own_template(tokenizer)
    if fmt == "raw":
        chat = "raw: the last user message as is"
    elif own is not None:
        chat = "tokenizer: the model's own chat template"
    else:
        chat = f"citer: the training template ({fmt})"
    return {
        "prompt_format": fmt,
        "chat": chat,
        "completion_prompt": (
            "the tokenizer's chat template applied to [{role: user, content: question}] with a generation prompt"
            if own is not None and fmt != "raw"
            else COMPLETION_PROMPTS[fmt]
        ),
        "chat_template": CHAT_TEMPLATE if own is None else own,
    }


def _message_text(msg: dict[str, Any], i: int) -> str:
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts carry anything a text model can read
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"messages[{i}].content[{j}]: only text parts are supported", param="messages"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts", param="messages")


def _mc_row(text: str) -> dict[str, Any]:
    """``"question\\nChoices: (A) x (B) y"`` -> an mc row, so the prompt is built by the training template."""
    question, sep, rest = text.partition("\nChoices:")
    parts = _CHOICE.split(rest.strip()) if sep else []
    # split gives ['', 'A', 'x ', 'B', 'y']: labels at odd positions, texts after them.
    if len(parts) < 5 or parts[0].strip():
        raise RequestError(
            "mc format: the user message must be 'question\\nChoices: (A) text (B) text ...'",
            param="messages",
        )
    labels = parts[1::2]
    texts = [t.strip() for t in parts[2::2]]
    return {"question": question.strip(), "choices": {"label": labels, "text": texts}}


def chat_prompt(messages: Sequence[dict[str, Any]], fmt: str, tokenizer: Any = None) -> str:
    """The prompt for a chat: ``fmt`` raw sends the last user message as is; otherwise the tokenizer's own chat
    template renders the whole chat when it has one, else the training template the last user message."""
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            text = _message_text(messages[i], i)
            break
    else:
        raise RequestError("messages hold no message with role 'user'", param="messages")
    if not text.strip():
        raise RequestError(f"messages[{i}].content is empty", param="messages")
    if fmt == "raw":
        return text
    if own_template(tokenizer) is not None:
        chat = [{"role": str(m.get("role")), "content": _message_text(m, j)} for j, m in enumerate(messages)]
        try:
            return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template refuses this chat (roles out of order, a role it lacks)
            raise RequestError(
                f"the model's chat template refuses these messages: {exc}", param="messages"
            ) from exc
    if fmt == "mc":
        return build_prompt(_mc_row(text), "mc")
    return build_prompt({"problem": text.strip()}, "math")
