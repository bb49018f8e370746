"""Tool-calling chat templates shipped with pdmesh, chosen by name (`--chat-template hermes`),
as vLLM ships its `tool_chat_template_*.jinja`: a model whose own template ignores `tools`
(SmolLM2's) can call tools without a path into a source checkout.

Each pairs with the `--tool-call-parser` of the same name (gateway/tool_parsers.py): the
template asks for calls in the format that parser reads. Imports nothing heavy: the router
(which imports no torch) resolves `--chat-template` with it.
"""

from __future__ import annotations

from importlib import resources

CHAT_TEMPLATES = {
    "hermes": "tool_chat_template_hermes.jinja",
    "llama3_json": "tool_chat_template_llama3_json.jinja",
}
"""Template name → its file in this package."""


def named_chat_template(name: str) -> str | None:
    """The shipped template called `name`, or None when there is none."""
    file = CHAT_TEMPLATES.get(name)
    if file is None:
        return None
    return resources.files(__package__).joinpath(file).read_text(encoding="utf-8")
