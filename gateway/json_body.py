"""Request bodies as their models, read by the gateway rather than by FastAPI, whose answer to a
wrong Content-Type, invalid UTF-8 or a 10k-deep body is a generic "error parsing the body" (or
a field error): `parse_json_object` (gateway/body.py) says which (a 400), then validation names
the field (a 400 via the RequestValidationError handler, gateway/errors.py). Both are typed as
vLLM types a body its request validation refuses ("Bad Request"). The parsed body is kept on
the request, so that a later refusal names a field as this body wrote it (`remember_body`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pdmesh.gateway.body import BadBody, parse_json_object
from pdmesh.gateway.errors import invalid_body, remember_body
from pdmesh.gateway.ignored_fields import note_ignored_fields
from pdmesh.gateway.schemas import RequestModel, ignored_fields

BodyModel = TypeVar("BodyModel", bound=BaseModel)


def json_body(model: type[BodyModel]) -> Callable[[Request], Awaitable[BodyModel]]:
    """A route dependency: the request body as `model`, its ignored fields noted and the body
    kept for the error handler."""

    async def parse(request: Request) -> BodyModel:
        try:
            data = parse_json_object(await request.body(), request.headers.get("content-type"))
        except BadBody as exc:
            raise invalid_body(str(exc), exc.param) from None
        try:
            body = model.model_validate(data)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False)) from None
        remember_body(request, body)
        if isinstance(body, RequestModel):
            note_ignored_fields(request, ignored_fields(body))
        return body

    return parse
