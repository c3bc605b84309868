"""`POST /v1/chat/completions` and `POST /v1/completions`: OpenAI's own APIs, served by the
chat pipeline as they are."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp

from gateway.boundary.admit import Admission, parse_chat, parse_completion
from gateway.errors import GatewayError
from gateway.pipeline.chat import ChatPipeline

PARSERS = {"chat": parse_chat, "completions": parse_completion}


class ChatDoor:
    """Admit, then hand the request to the pipeline; errors in OpenAI's shape."""

    def __init__(self, admission: Admission, pipeline: ChatPipeline) -> None:
        self.admission = admission
        self.pipeline = pipeline

    async def __call__(self, request: Request, api: str) -> ASGIApp:
        admitted = self.admission.begin(request, api)
        try:
            await self.admission.admit(admitted, PARSERS[api])
            return await self.pipeline.serve(admitted)
        except GatewayError as exc:
            return exc.to_response(admitted.request_id)
