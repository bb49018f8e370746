"""The bodies of the routes that generate nothing: vLLM's /tokenize and /detokenize, and
/v1/models."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from pdmesh.gateway.chat_schemas import ChatMessageIn, ChatTool
from pdmesh.gateway.schemas import RequestModel, wire_int
from pdmesh.v1 import router_pb2


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: a completion-style `prompt` or a chat-style `messages` list."""

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    # vLLM's defaults: on for a prompt, off for messages (a chat template places its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # messages only
    tools: list[ChatTool] | None = None  # messages only: rendered by the chat template
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self

    def to_proto(self) -> router_pb2.TokenizeRequest:
        if self.prompt is not None:
            return router_pb2.TokenizeRequest(model=self.model, text=self.prompt,
                                              add_special_tokens=self.add_special_tokens)
        tools = json.dumps([t.model_dump(exclude_none=True) for t in self.tools or []])
        chat = router_pb2.Chat(
            messages=[m.to_proto() for m in self.messages or []],
            add_generation_prompt=self.add_generation_prompt,
            tools_json=tools if self.tools else "",
        )
        return router_pb2.TokenizeRequest(model=self.model, chat=chat,
                                          add_special_tokens=self.add_special_tokens)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str = ""
    tokens: list[Annotated[int, wire_int(router_pb2.DetokenizeRequest, "token_ids")]]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelPermission(BaseModel):
    """vLLM's (and OpenAI's former) model permission entry: what clients may do with it."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """A /v1/models entry with vLLM's fields: clients written for vLLM read `root` (the model
    behind the served name), `parent` (the base model of an adapter: none here),
    `max_model_len` and `permission`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdmesh"
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
