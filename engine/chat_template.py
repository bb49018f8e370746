"""A conversation to prompt token ids through the tokenizer's chat template.

Light on purpose (no torch, no engine): the router renders chat prompts with it, and the
offline `LLM.chat` does the same, so both refuse the same conversations the same way.
"""

from __future__ import annotations

import json
from dataclasses import field
from typing import Any

from pdmesh.config import about

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles of OpenAI's chat API. Anything else would be rendered into the prompt verbatim
by permissive templates (a "wizard" turn the model was never trained on), so it is refused."""

RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "add_generation_prompt", "chat_template", "tokenize",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "padding", "truncation", "max_length", "sanitize_control_tokens",
})
"""`chat_template_kwargs` keys refused: what the request sets by its own fields (messages,
tools, add_generation_prompt), and HF's render arguments that would change what comes back
(vLLM refuses `chat_template` and `tokenize` likewise). Everything else reaches the template
as a variable (`enable_thinking`, `documents`, ...)."""

MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
"""`chat_template_kwargs` as JSON text: the variables of a template, not a second prompt."""


def check_template_kwargs(kwargs: object) -> dict[str, Any]:
    """A request's `chat_template_kwargs`: a JSON object of at most MAX_TEMPLATE_KWARGS_BYTES
    whose keys the render does not set itself; ValueError naming the problem otherwise."""
    if not isinstance(kwargs, dict):
        raise ValueError(f"a JSON object is required, got {type(kwargs).__name__}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"{', '.join(reserved)} cannot be set here: the request's own "
                         f"fields and the render set them")
    size = len(json.dumps(kwargs, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON are allowed, "
                         f"got {size}")
    return kwargs


def template_defaults_field() -> Any:
    """`--default-chat-template-kwargs`, declared once for the configs that read it: the
    router's (it renders prompts) and the gateway's (it reads whether a request thinks)."""
    return field(default="", metadata=about(
        "a JSON object of variables every chat template render gets (vLLM's flag), e.g. "
        "'{\"enable_thinking\": false}'; a request's chat_template_kwargs win key by key"))


def parse_template_defaults(text: str) -> dict[str, Any]:
    """`--default-chat-template-kwargs` (JSON text) as the variables every render gets;
    ValueError naming the flag when it is not what a request's `chat_template_kwargs` may be."""
    if not text.strip():
        return {}
    try:
        return check_template_kwargs(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--default-chat-template-kwargs: not valid JSON: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"--default-chat-template-kwargs: {exc}") from None


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None, add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of a conversation; `tools` (OpenAI function tools) reach the template as HF's
    `tools=`, `template_kwargs` (vLLM's chat_template_kwargs, `check_template_kwargs`) as
    variables. Refuses a model without a template and roles outside OpenAI's.

    `add_special_tokens` (vLLM's chat field, off by default: the template places BOS and the
    like itself) tokenizes the rendered text with the tokenizer's special tokens on top."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model has no chat template")
    for i, m in enumerate(messages):
        if "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}]: needs 'role' and 'content'")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}].role: unknown role {m['role']!r}; expected one of "
                + ", ".join(CHAT_ROLES)
            )
    rendered = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt,
        tokenize=not add_special_tokens, **check_template_kwargs(template_kwargs or {}),
    )
    ids = tokenizer(rendered, add_special_tokens=True) if add_special_tokens else rendered
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
