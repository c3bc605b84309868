"""The `azure` upstream kind: Azure OpenAI, the OpenAI upstream at Azure's paths and auth.

Azure serves OpenAI's API with these differences, which are all this module knows (the rest,
streams, completions, errors, retries and timeouts, is `OpenAIUpstream`'s, since Azure's
answers, SSE events and error bodies are OpenAI's, and a 429 carries `retry-after`):

- paths, as Azure's own SDK (`openai.AzureOpenAI`) builds them. A dated `api_version` scopes
  chat, completions, embeddings, speech and image generation to a deployment,
  `/openai/deployments/{deployment}/chat/completions?api-version=2024-10-21`, the deployment
  being the route's `model_map[model]`, else the model name; the account's other paths (files,
  batches, fine-tuning, ...) are `/openai/{path}?api-version=...`. `api_version: "v1"` is
  Azure's OpenAI-compatible surface, `/openai/v1/{path}`, the deployment in the body's `model`.
- auth: an `api-key` header, never `Authorization`.
- the deployment name becomes a path segment, so it is checked (letters, digits, '-', '_' and
  '.', a letter or digit first): a model name from a client never changes the path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson

from gateway.config.routes import Route
from gateway.errors import GatewayError
from gateway.paths import (
    AZURE_DEPLOYMENT_PATHS,
    AZURE_MULTIPART_DEPLOYMENT_PATHS,
    PassPath,
    is_azure_deployment,
)
from gateway.upstreams.base import CallContext, ModelCard, client_error
from gateway.upstreams.openai import ENDPOINT_PATHS, OpenAIUpstream

V1 = "v1"


class AzureUpstream(OpenAIUpstream):
    """An Azure OpenAI resource (`base_url` `https://RESOURCE.openai.azure.com`)."""

    def __init__(self, route: Route, *, api_key: str | None, **options: Any) -> None:
        super().__init__(route, api_key=api_key, **options)
        version = route.api_version or V1
        self.v1 = version == V1
        self._query: tuple[tuple[str, str], ...] = () if self.v1 else (("api-version", version),)
        self._suffix = "" if self.v1 else "?api-version=" + quote(version, safe="")

    @staticmethod
    def auth_headers(api_key: str | None) -> dict[str, str]:
        return {"api-key": api_key} if api_key else {}

    def endpoint_path(self, endpoint: str, ctx: CallContext) -> str:
        tail = ENDPOINT_PATHS[endpoint]
        if self.v1:
            return "/openai/v1" + tail
        return f"/openai/deployments/{checked_deployment(ctx.upstream_model)}{tail}{self._suffix}"

    async def model_cards(self) -> list[ModelCard]:
        """Nothing: Azure lists its base models, not the resource's deployments, which are what
        a client names. The gateway lists the route's own models."""
        return []

    async def warm_up(self) -> None:
        path = "/openai/v1/models" if self.v1 else "/openai/models" + self._suffix
        await self.http.warm_up(self._warm_connections, path)

    async def forward(
        self, method: str, path: PassPath, headers: Mapping[str, str], data: Any
    ) -> aiohttp.ClientResponse:
        return await self.http.forward(method, self.azure_path(path, data), headers, data)

    def azure_path(self, path: PassPath, data: Any) -> PassPath:
        """`/v1/<path>` at Azure: the route's `api-version` replaces any the client sent."""
        query = tuple((k, v) for k, v in path.query if k.lower() != "api-version") + self._query
        segments = path.segments
        if self.v1:
            return PassPath(("openai", "v1", *segments), query)
        if segments in AZURE_MULTIPART_DEPLOYMENT_PATHS:
            raise GatewayError(
                404,
                f"{path.display()} is not forwarded to Azure route {self.route.name!r} with a "
                "dated api_version: its deployment is named inside the upload "
                '(use api_version "v1").',
                code="unknown_url",
            )
        if segments in AZURE_DEPLOYMENT_PATHS:
            deployment = self._deployment_of(data)
            return PassPath(("openai", "deployments", deployment, *segments), query)
        return PassPath(("openai", *segments), query)

    def _deployment_of(self, data: Any) -> str:
        """The deployment a deployment-scoped JSON body names (its `model`, mapped)."""
        try:
            body = orjson.loads(data) if isinstance(data, bytes) else None
        except orjson.JSONDecodeError:
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            raise GatewayError(
                400,
                "This Azure OpenAI path needs the deployment as the body's 'model'.",
                type="invalid_request_error",
                param="model",
                code="missing_model",
            )
        name = self.route.upstream_model(model)
        if not is_azure_deployment(name):
            raise GatewayError(
                400,
                _BAD_DEPLOYMENT,
                type="invalid_request_error",
                param="model",
                code="invalid_model",
            )
        return name


_BAD_DEPLOYMENT = (
    "The model does not name a valid Azure OpenAI deployment (letters, digits, '-', '_' and "
    "'.', up to 64 characters)."
)


def checked_deployment(name: str) -> str:
    """`name` as a path segment, or a 400: it may come from the client."""
    if not is_azure_deployment(name):
        raise client_error(_BAD_DEPLOYMENT, "model")
    return name
