"""The router's prompt tokenizer: a small thread pool, a lane kept for short prompts, and a
refusal of provably too-long prompts before any tokenizing.

HF fast tokenizers encode in Rust with the GIL released, so the event loop and the other
workers keep going while one long prompt is tokenized. Each worker has its own tokenizer copy
(a Rust tokenizer object takes a mutable borrow for its truncation/padding settings, so sharing
one across threads can fail with "Already borrowed").

Prompts over LARGE_PROMPT_BYTES may occupy at most `pool_size - 1` workers: with two or more
workers one is always free for short prompts, so a burst of big prompts delays big prompts and
never a chat turn. A prompt whose byte length alone proves it cannot fit in `max_model_len`
is refused first (`PromptBound`); that also caps what one prompt can cost the pool at about
`bytes_per_token * max_model_len` bytes of tokenizing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prometheus_client import Histogram

from pdmesh.chat_templates import CHAT_TEMPLATES, named_chat_template
from pdmesh.engine.bad_words import tokenize_bad_words
from pdmesh.engine.chat_template import (
    MAX_TEMPLATE_KWARGS_BYTES,
    apply_chat_template,
    check_template_kwargs,
)
from pdmesh.engine.model_store import resolve_tokenizer
from pdmesh.engine.request_rules import RuleViolation, truncate_prompt
from pdmesh.engine.tokenizing import load_tokenizer_from
from pdmesh.router.admission import InvalidRequest
from pdmesh.router.prompt_bound import NoBound, PromptBound

logger = logging.getLogger(__name__)

LARGE_PROMPT_BYTES = 32 * 1024
"""Above this a prompt takes a large-prompt lane (tens of milliseconds of tokenizing and up)."""


class PromptTokenizer:
    """Tokenizes Generate/Tokenize requests' prompts (text, token ids or chat) off the loop."""

    def __init__(self, model: str, pool_size: int = 2, chat_template: str | None = None,
                 wait: Histogram | None = None, *,
                 template_defaults: Mapping[str, Any] | None = None) -> None:
        """`wait`, labelled by lane, observes how long each piece of work waited for a
        thread: the one sign that the pool is too small (or that big prompts crowd it).
        `template_defaults` (`--default-chat-template-kwargs`, checked) are every chat
        render's variables under the request's own `chat_template_kwargs`."""
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        model_dir = resolve_tokenizer(model)
        copies = [load_tokenizer_from(model_dir) for _ in range(pool_size)]
        template = load_chat_template(chat_template)
        if template is not None:
            for copy in copies:
                copy.chat_template = template
        config_file = model_dir / "config.json"  # a tokenizer-only --tokenizer may lack one
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.vocab_size = int(config.get("vocab_size") or len(copies[0]))
        self.model_dir = model_dir
        self.template_defaults = dict(template_defaults or {})
        self.pool_size = pool_size
        self.bound = _bound_of(copies[0])
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for copy in copies:
            self._idle.put(copy)
        self._executor = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="tokenizer")
        self._large_lanes = asyncio.Semaphore(max(1, pool_size - 1))
        self._wait = wait

    async def encode(self, request: Any, max_model_len: int | None = None, *,
                     context_len: int | None = None) -> list[int]:
        """The prompt's token ids, cut to the request's `truncate_prompt_tokens` (the one
        place a prompt is tokenized, so usage counts what was kept). With `max_model_len`, a
        text or chat prompt that provably leaves no room to generate raises InvalidRequest
        without being tokenized (unless it is to be truncated); `context_len` (default
        `max_model_len`) is the limit truncation works within."""
        keep = (request.truncate_prompt_tokens
                if request.HasField("truncate_prompt_tokens") else None)
        context_len = max_model_len if context_len is None else context_len
        ids = await self._encode(request, None if keep is not None else max_model_len)
        try:
            return truncate_prompt(ids, keep, context_len)
        except RuleViolation as exc:
            raise InvalidRequest(exc.field, str(exc)) from None

    async def _encode(self, request: Any, max_model_len: int | None) -> list[int]:
        kind = request.WhichOneof("prompt" if hasattr(request, "token_ids") else "input")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "text":
            text = request.text
            if max_model_len is not None and self.bound is not None:
                self.bound.check(text, max_model_len)
            special = _add_special_tokens(request, default=True)
            return await self._run(len(text), self._encode_text, text, special)
        if kind == "chat":
            messages = chat_messages(request.chat)
            if not messages:
                raise InvalidRequest("chat.messages", "a chat needs at least one message")
            tools = chat_tools(request.chat)
            kwargs = {**self.template_defaults, **(chat_template_kwargs(request.chat) or {})}
            add = (
                request.chat.add_generation_prompt
                if request.chat.HasField("add_generation_prompt")
                else True
            )
            size = request.chat.ByteSize()
            return await self._run(size, self._encode_chat, messages, add, max_model_len, tools,
                                   kwargs, _add_special_tokens(request, default=False))
        raise InvalidRequest("prompt", "one of text, token_ids or chat is required")

    async def bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """`bad_words` as the token sequences engines ban (engine/bad_words.py);
        InvalidRequest names the field."""
        try:
            return await self._run(sum(map(len, words)),  # type: ignore[return-value]
                                   self._tokenize_bad_words, list(words))
        except ValueError as exc:
            raise InvalidRequest("sampling.bad_words", str(exc)) from None

    @staticmethod
    def _tokenize_bad_words(tokenizer: Any, words: list[str]) -> list[list[int]]:
        return tokenize_bad_words(
            lambda text: list(tokenizer.encode(text, add_special_tokens=False)), words)

    async def _run(self, size: int, work: Any, *args: Any) -> list[int]:
        loop = asyncio.get_running_loop()
        submitted = time.monotonic()
        if size <= LARGE_PROMPT_BYTES:
            return await loop.run_in_executor(
                self._executor, self._with_tokenizer, "short", submitted, work, *args)
        async with self._large_lanes:
            return await loop.run_in_executor(
                self._executor, self._with_tokenizer, "large", submitted, work, *args)

    def _with_tokenizer(self, lane: str, submitted: float, work: Any, *args: Any) -> list[int]:
        if self._wait is not None:
            self._wait.labels(lane).observe(time.monotonic() - submitted)
        tokenizer = self._idle.get_nowait()  # never empty: one copy per worker thread
        try:
            return work(tokenizer, *args)
        finally:
            self._idle.put(tokenizer)

    @staticmethod
    def _encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def decode(self, token_ids: Sequence[int]) -> tuple[str, list[str]]:
        """(the ids decoded together, each id's token string); InvalidRequest names a bad id."""
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest("token_ids", f"token id {bad} is outside [0, {self.vocab_size})")
        ids = list(token_ids)
        return await self._run(len(ids) * 4, self._decode, ids)  # type: ignore[return-value]

    @staticmethod
    def _decode(tokenizer: Any, ids: list[int]) -> tuple[str, list[str]]:
        strs = tokenizer.convert_ids_to_tokens(ids)
        return tokenizer.decode(ids), [s if s is not None else "" for s in strs]

    def _encode_chat(
        self, tokenizer: Any, messages: list[dict[str, Any]], add: bool,
        max_model_len: int | None, tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None, add_special_tokens: bool = False,
    ) -> list[int]:
        if max_model_len is not None and self.bound is not None:
            # The bound applies to the rendered text (a template may leave content out).
            # Rendering is cheap next to tokenizing; a template error is reported below.
            try:
                rendered = tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=add, tokenize=False,
                    **(kwargs or {}),
                )
            except Exception:  # apply_chat_template below names the problem
                rendered = None
            if isinstance(rendered, str):
                self.bound.check(rendered, max_model_len, field="messages")
        try:
            return apply_chat_template(tokenizer, messages, add, tools, kwargs,
                                       add_special_tokens)
        except ValueError as exc:
            raise InvalidRequest("messages", str(exc)) from None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _add_special_tokens(request: Any, default: bool) -> bool:
    """The request's `add_special_tokens` where it says (Generate and Tokenize both carry
    it), else vLLM's default: on for a text prompt, off for a chat (its template places them)."""
    return request.add_special_tokens if request.HasField("add_special_tokens") else default


def chat_messages(chat: Any) -> list[dict[str, Any]]:
    """A router `Chat`'s messages as chat-template dicts, in HF's tool-use shape: assistant
    `tool_calls` as `{"id", "type": "function", "function": {"name", "arguments"}}` with the
    arguments as an object when they parse as one (templates render them with `tojson`, as
    vLLM passes them), `tool_call_id`, `name` and an assistant's `reasoning_content` only where
    set."""
    out: list[dict[str, Any]] = []
    for m in chat.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        if m.reasoning:  # the name templates read (vLLM passes both)
            message["reasoning_content"] = message["reasoning"] = m.reasoning
        out.append(message)
    return out


def _arguments(text: str) -> Any:
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return text
    return parsed if isinstance(parsed, dict) else text


def chat_tools(chat: Any) -> list[dict[str, Any]] | None:
    """`Chat.tools_json` → the template's `tools` (None when empty); InvalidRequest when it is
    not a JSON list of objects."""
    if not chat.tools_json:
        return None
    try:
        tools = json.loads(chat.tools_json)
    except json.JSONDecodeError as exc:
        raise InvalidRequest("chat.tools_json", f"not valid JSON: {exc}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest("chat.tools_json", "expected a JSON list of tool objects")
    return tools or None


def chat_template_kwargs(chat: Any) -> dict[str, Any] | None:
    """`Chat.chat_template_kwargs_json` → the template's extra variables (None when empty);
    InvalidRequest when it is not a JSON object the render may take
    (`check_template_kwargs`)."""
    text = chat.chat_template_kwargs_json
    if not text:
        return None
    if len(text) > MAX_TEMPLATE_KWARGS_BYTES:  # characters: parse nothing surely over
        raise InvalidRequest("chat_template_kwargs", f"must be at most "
                                                     f"{MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
    try:
        return check_template_kwargs(json.loads(text)) or None
    except json.JSONDecodeError as exc:
        raise InvalidRequest("chat_template_kwargs", f"not valid JSON: {exc}") from None
    except ValueError as exc:
        raise InvalidRequest("chat_template_kwargs", str(exc)) from None


def load_chat_template(template: str | None) -> str | None:
    """`--chat-template`: a file's contents, the argument itself when it is a template (vLLM
    accepts both), or a template shipped with pdmesh by name (`hermes`, `llama3_json`; a file
    of that name wins); None when not given. Anything else is a ValueError naming it."""
    if template is None or not template.strip():
        return None
    if "{" in template:  # Jinja syntax: the template itself
        return template
    path = Path(template).expanduser()
    if path.is_file():
        return path.read_text()
    shipped = named_chat_template(template.strip())
    if shipped is None:
        raise ValueError(
            f"--chat-template: {template!r} is neither a file, a template nor a shipped "
            f"template name ({', '.join(CHAT_TEMPLATES)})")
    return shipped


def _bound_of(tokenizer: Any) -> PromptBound | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        logger.warning("prompt length fast-reject off: %s is not a fast tokenizer",
                       type(tokenizer).__name__)
        return None
    try:
        bound = PromptBound.of(backend)
    except NoBound as exc:
        logger.warning("prompt length fast-reject off: %s", exc)
        return None
    logger.info("prompt length fast-reject on: at most %d bytes per token",
                bound.bytes_per_token)
    return bound
