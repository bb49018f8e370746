"""A conversation to prompt token ids through the tokenizer's chat template.

Light on purpose (no torch, no engine): the router renders chat prompts with it, and the
offline `LLM.chat` does the same, so both refuse the same conversations the same way.
"""

from __future__ import annotations

from typing import Any

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles of OpenAI's chat API. Anything else would be rendered into the prompt verbatim
by permissive templates (a "wizard" turn the model was never trained on), so it is refused."""


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation; `tools` (OpenAI function tools) reach the template as HF's
    `tools=`. Refuses a model without a template and roles outside OpenAI's."""
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
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
