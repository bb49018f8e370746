"""The routes that generate nothing: readiness (/health, and vLLM's /ping), Prometheus metrics,
vLLM's /load, the served models, the version, and vLLM's /tokenize and /detokenize (the router
tokenizes exactly as Generate would).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response

from pdmesh import __version__
from pdmesh.gateway.context import GatewayContext
from pdmesh.gateway.info_schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ModelPermission,
    TokenizeRequest,
    TokenizeResponse,
)
from pdmesh.gateway.metrics import CONTENT_TYPE
from pdmesh.gateway.metrics_federation import federated_exposition
from pdmesh.gateway.router_client import RouterClient
from pdmesh.v1 import router_pb2


async def health(client: RouterClient) -> JSONResponse:
    """Readiness: 200 while the router can serve a request now, else 503 and why. Also vLLM's
    /ping (GET and POST, for SageMaker-style load balancers)."""
    health = await client.healthy()
    if health.serving:
        return JSONResponse({"status": "ok", "router": health.status})
    body = {"status": "unavailable", "router": health.status, "reason": health.reason}
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


async def prometheus(context: GatewayContext) -> Response:
    """The gateway's metrics; with --metrics-federate (`pdmesh serve`) every listed process's
    too, fetched now and merged (gateway/metrics_federation.py)."""
    config = context.config
    if not config.metrics_federate:
        return Response(context.metrics.render(config.metrics_names), media_type=CONTENT_TYPE)
    body = await federated_exposition(
        context.metrics.registry, config.federate_targets,
        timeout_s=config.metrics_federate_timeout_s, ca=config.tls_ca, names=config.metrics_names)
    return Response(body, media_type=CONTENT_TYPE)


async def models(context: GatewayContext) -> ModelList:
    """The served models, as vLLM lists them (one card per served name); `root` is the model
    behind the names (`--model-root`, which `pdmesh serve` sets to its model: a router serves
    one), else the name itself."""
    served = await context.client.list_models()
    root = context.config.model_root
    return ModelList(data=[
        ModelCard(id=m.id, created=context.started, root=root or m.id,
                  max_model_len=m.max_model_len,
                  permission=[ModelPermission(created=context.started)])
        for m in served])


def load(context: GatewayContext) -> dict[str, int]:
    """vLLM's /load: the generation requests this API server is serving now (what a load
    balancer in front of several servers compares)."""
    return {"server_load": context.metrics.requests_in_flight()}


def version() -> dict[str, str]:
    return {"version": __version__}


async def tokenize(client: RouterClient, body: TokenizeRequest) -> TokenizeResponse:
    out = await client.tokenize(body.to_proto())
    tokens = list(out.token_ids)
    strs = None
    if body.return_token_strs:
        strs = list((await client.detokenize(router_pb2.DetokenizeRequest(
            model=body.model, token_ids=tokens))).token_strs)
    return TokenizeResponse(count=len(tokens), max_model_len=out.max_model_len,
                            tokens=tokens, token_strs=strs)


async def detokenize(client: RouterClient, body: DetokenizeRequest) -> DetokenizeResponse:
    out = await client.detokenize(router_pb2.DetokenizeRequest(
        model=body.model, token_ids=body.tokens))
    return DetokenizeResponse(prompt=out.text)
