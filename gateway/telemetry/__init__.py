"""TTFT telemetry: figures per tenant, route and client API, in Redis or in process,
Prometheus and SLOs."""

from .event import APIS, STATUSES, RequestEvent
from .report import SloConfig
from .telemetry import Telemetry

__all__ = ["APIS", "STATUSES", "RequestEvent", "SloConfig", "Telemetry"]
