"""`GET /v1/models` and `GET /v1/models/{id}`: the models this gateway serves, as OpenAI lists
them.

A name is listed only if a request for it would be served, by the route that would serve it
(`owned_by`): each route's exact names and aliases, and for a route with patterns the models
its upstream lists that match them. So `models.list()` never shows a name that `create` then
rejects, and `models.retrieve(id)` answers for every listed name, from the gateway itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as HttpRoute

from gateway.boundary.admit import Admission
from gateway.errors import GatewayError
from gateway.upstreams.base import ModelCard
from gateway.upstreams.registry import Upstreams

PATTERN_CHARS = frozenset("*?[")


def _json(obj: object) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


async def list_models(upstreams: Upstreams, created: int) -> list[ModelCard]:
    """Every servable model once, in route order (`created`: when the gateway started). An
    upstream whose list does not come in time only leaves its own pattern-matched models out."""
    table = upstreams.table
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
                await upstreams.ready(route.name)
            for card in await upstreams[route.name].model_cards():
                # Listed by this route's upstream: only if this route serves it.
                serving = table.match(card["id"])
                if serving is route and card["id"] not in cards:
                    cards[card["id"]] = card
    return list(cards.values())


def models_endpoints(
    admission: Admission, upstreams: Upstreams, started_at: Callable[[], float]
) -> list[HttpRoute]:
    """The two endpoints, for authenticated callers (`started_at`: the gateway's start time)."""

    async def models(request: Request) -> Response:
        try:
            admission.authenticate(admission.begin(request, "models"))
        except GatewayError as exc:
            return exc.to_response()
        return _json({"object": "list", "data": await list_models(upstreams, int(started_at()))})

    async def model(request: Request) -> Response:
        try:
            admission.authenticate(admission.begin(request, "models"))
        except GatewayError as exc:
            return exc.to_response()
        wanted = request.path_params["model_id"]
        for card in await list_models(upstreams, int(started_at())):
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
