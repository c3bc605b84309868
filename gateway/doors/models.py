"""`GET /v1/models` and `GET /v1/models/{id}`: the models this gateway serves, as OpenAI lists
them.

A name is listed only if a request for it would be served, by the route that would serve it
(`owned_by`): each route's exact names and aliases, and for a route with patterns the models
its upstream lists that match them. So `models.list()` never shows a name that `create` then
rejects, and `models.retrieve(id)` answers for every listed name, from the gateway itself.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as HttpRoute

from gateway.errors import GatewayError
from gateway.upstreams.base import ModelCard

if TYPE_CHECKING:
    from gateway.runtime import Gateway

PATTERN_CHARS = frozenset("*?[")


def _json(obj: object) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


async def list_models(gateway: Gateway) -> list[ModelCard]:
    """Every servable model once, in route order. An upstream whose list does not come in
    time only leaves its own pattern-matched models out."""
    table = gateway.table
    created = int(gateway.started_at)
    cards: dict[str, ModelCard] = {}

    for route in table.routes:
        patterns = [name for name in route.models if PATTERN_CHARS.intersection(name)]
        for name in (*route.models, *route.model_map):
            serving = table.match(name)
            if name not in patterns and serving is not None and name not in cards:
                cards[name] = {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": serving.name,
                }
        if patterns:
            with contextlib.suppress(GatewayError):  # a route that failed to start lists nothing
                await gateway.upstream_ready(route.name)
            for card in await gateway.upstreams[route.name].model_cards():
                # Listed by this route's upstream: only if this route serves it.
                serving = table.match(card["id"])
                if serving is route and card["id"] not in cards:
                    cards[card["id"]] = card
    return list(cards.values())


def models_endpoints(gateway: Gateway) -> list[HttpRoute]:
    async def models(request: Request) -> Response:
        try:
            gateway.keys.tenant_for(request)
        except GatewayError as exc:
            return exc.to_response()
        return _json({"object": "list", "data": await list_models(gateway)})

    async def model(request: Request) -> Response:
        try:
            gateway.keys.tenant_for(request)
        except GatewayError as exc:
            return exc.to_response()
        wanted = request.path_params["model_id"]
        for card in await list_models(gateway):
            if card["id"] == wanted:
                return _json(card)
        shown = wanted if len(wanted) <= 200 else wanted[:200] + "..."
        return GatewayError(
            404,
            f"The model '{shown}' does not exist or is not served by this gateway.",
            type="invalid_request_error",
            param="model",
            code="model_not_found",
        ).to_response()

    return [
        HttpRoute("/v1/models", models, methods=["GET"]),
        HttpRoute("/v1/models/{model_id:path}", model, methods=["GET"]),
    ]


__all__ = ["list_models", "models_endpoints"]
