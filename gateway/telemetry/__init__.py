"""TTFT telemetry: per-tenant, per-route figures in Redis or in process, Prometheus and SLOs."""

from .event import STATUSES, RequestEvent
from .report import SloConfig
from .telemetry import Telemetry

__all__ = ["STATUSES", "RequestEvent", "SloConfig", "Telemetry"]
