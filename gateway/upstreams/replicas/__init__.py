"""Routes with several replicas: where each request goes (prefix affinity, load, health).

Pure logic, no I/O: the request path feeds it what it sees (requests sent and finished,
failures, probe answers, upstream-reported queues) and asks it where to send the next one.
"""

from gateway.upstreams.replicas.balancer import BalanceOptions, Balancer, Choice, ReplicaState
from gateway.upstreams.replicas.health import HealthPolicy, ReplicaHealth
from gateway.upstreams.replicas.prefix_index import (
    BLOCK_CHARS,
    PrefixIndex,
    prefix_blocks,
    prompt_text,
)

__all__ = [
    "BLOCK_CHARS",
    "BalanceOptions",
    "Balancer",
    "Choice",
    "HealthPolicy",
    "PrefixIndex",
    "ReplicaHealth",
    "ReplicaState",
    "prefix_blocks",
    "prompt_text",
]
