"""Which replica of a route serves a request: prefix affinity weighed against load.

A prefix-caching engine answers a prompt whose beginning it has seen for little more than the
new part, so sending requests that share a prefix to the replica that holds it cuts time to
first token; but a replica that gets everything its prefixes attract queues, and queueing
costs more than a cache miss. The balancer trades one against the other in one cost function,
and lets load win outright when it is too uneven.

Modes (`BalanceOptions.mode`):

- ``prefix_affinity`` (default): for each healthy replica r,

      load(r) = in_flight(r) + queue(r)            (queue: upstream-reported waiting, 0 unknown)
      cost(r) = load_weight * (load(r) / (slots * weight(r)) + 0.5 * kv_usage(r))
              - cache_weight * matched(r) / total

  (the kv_usage term only where the upstream reports it). The lowest cost wins; ties go to the
  lower load(r)/weight(r), then to a rendezvous hash of the prompt's first block with the
  replica's name: a prefix nobody holds yet lands on a replica chosen by the prefix itself, so
  new families spread over the fleet, and every gateway process picks the same one.
  `matched/total` is the share of the prompt's blocks the replica likely holds (`PrefixIndex`),
  `load/slots` is how many times over the replica's concurrent capacity it is busy. With both
  weights at 1, a whole-prompt hit is worth one full set of slots of extra load: a session stays
  where its history is until that replica is `slots` requests busier than another, which is about
  when waiting for a slot costs more than recomputing the prompt (a slot frees every service_time
  / slots, a prompt recomputes in a fraction of one service time). queue counts the waiting
  requests a second time on top of in_flight on purpose: a request that waits is the expensive
  kind of load.

  Imbalance rule: if the replica the cost picks is, in load per unit of weight, at least
  `imbalance_abs` requests above the least loaded healthy replica *and* at least
  `imbalance_ratio` * (least + 1), load wins and the least loaded replica is taken (reason
  "load"). Only the picked replica is compared, not the fleet's max: a hot replica diverts the
  requests that would go to it and leaves the affinity of the others alone. Defaults 8 and 2.0:
  a slot-full of difference, and twice the load, so that small fleets near idle (1 vs 0
  requests) never break affinity while a replica that slowed down (its in_flight climbs
  because its requests last longer) sheds new sessions before its queue grows long.

- ``least_loaded``: the lowest load(r)/weight(r), ties taken in turn.
- ``round_robin``: smooth weighted round robin (nginx's) over the healthy replicas.

Health first, in every mode: an ejected replica is never chosen while a healthy one that is
not in `exclude` exists; with none healthy, the one whose last failure is oldest (a replica
that never failed first) is tried (reason "only_unhealthy").

`bench/replica_routing.py` checks the defaults against simulated prefix-caching replicas (8
replicas, 100 tenants, multi-turn sessions, one replica 3x slower half-way); they meet its
targets with no setting of the bench's own. There, load_weight 0.5 did as well, 2 and 4 lost
cached share (77% and 58% against 88%) and TTFT for nothing, and the imbalance rule never fired
at the defaults (the load term keeps replicas even) but took over when load_weight was 0: it
is the guard for a cost function set too greedily, not the everyday balancer.

The index remembers what was sent, not what the engine kept: size `PrefixIndex.max_bytes` near
the engine's KV capacity (160 bytes per 256-character block, ~64 tokens) where that is known;
the default 4 MiB remembers ~1.7M tokens, more than most single replicas hold.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from gateway.upstreams.replicas.health import HealthPolicy, ReplicaHealth
from gateway.upstreams.replicas.prefix_index import PrefixIndex

MODES = ("prefix_affinity", "least_loaded", "round_robin")
KV_USAGE_WEIGHT = 0.5  # a full KV cache counts as half a set of slots of load


@dataclass
class ReplicaState:
    """What the balancer knows of one replica."""

    name: str
    weight: float = 1.0
    in_flight: int = 0
    queue: int | None = None  # upstream-reported waiting requests; None: unknown
    kv_usage: float | None = None  # 0..1; None: unknown
    index: PrefixIndex = field(default_factory=PrefixIndex)
    health: ReplicaHealth = field(default_factory=lambda: ReplicaHealth(HealthPolicy()))

    @property
    def load(self) -> int:
        return self.in_flight + (self.queue or 0)

    @property
    def relative_load(self) -> float:
        return self.load / self.weight


@dataclass
class BalanceOptions:
    mode: str = "prefix_affinity"
    cache_weight: float = 1.0
    load_weight: float = 1.0
    slots: int = 8
    imbalance_abs: int = 8
    imbalance_ratio: float = 2.0


@dataclass
class Choice:
    replica: ReplicaState
    matched_blocks: int
    total_blocks: int
    # "affinity" (cost function, prefix matched), "least_loaded" (cost function without any
    # match, or mode least_loaded), "load" (imbalance rule), "round_robin", "only_unhealthy"
    reason: str


class Balancer:
    """Chooses among one route's replicas. Pure and single-threaded: the caller passes `now`
    and reports `sent` and `done`."""

    def __init__(self, replicas: list[ReplicaState], options: BalanceOptions) -> None:
        if not replicas:
            raise ValueError("a balancer needs at least one replica")
        if options.mode not in MODES:
            raise ValueError(f"balance mode must be one of {', '.join(MODES)}")
        if options.slots < 1:
            raise ValueError("slots must be at least 1")
        names = [r.name for r in replicas]
        if len(set(names)) != len(names):
            raise ValueError("replica names must be unique")
        if any(not r.weight > 0 for r in replicas):
            raise ValueError("replica weights must be positive")
        self.replicas = list(replicas)
        self.options = options
        self._by_name = {r.name: r for r in replicas}
        self._rr_current = {r.name: 0.0 for r in replicas}
        self._turn = 0

    def choose(
        self, blocks: list[bytes], now: float, exclude: frozenset[str] = frozenset()
    ) -> Choice:
        """The replica for a prompt with these blocks. Raises LookupError when `exclude` leaves
        no replica at all (a hedge on a one-replica route)."""
        total = len(blocks)
        allowed = [r for r in self.replicas if r.name not in exclude]
        if not allowed:
            raise LookupError("every replica is excluded")
        healthy = [r for r in allowed if r.health.healthy(now)]
        if not healthy:
            oldest = min(allowed, key=_failure_order)
            return Choice(oldest, oldest.index.matched(blocks), total, "only_unhealthy")
        mode = self.options.mode
        if mode == "round_robin":
            picked = self._round_robin(healthy)
            return Choice(picked, picked.index.matched(blocks), total, "round_robin")
        if mode == "least_loaded":
            picked = self._least_loaded(healthy)
            return Choice(picked, picked.index.matched(blocks), total, "least_loaded")
        return self._affinity(healthy, blocks)

    def _affinity(self, healthy: list[ReplicaState], blocks: list[bytes]) -> Choice:
        opts = self.options
        total = len(blocks)
        best: tuple[float, float, bytes] | None = None
        picked, picked_matched = healthy[0], 0
        for r in healthy:
            matched = r.index.matched(blocks) if total else 0
            load = r.load / (opts.slots * r.weight)
            if r.kv_usage is not None:
                load += KV_USAGE_WEIGHT * r.kv_usage
            cost = opts.load_weight * load - (opts.cache_weight * matched / total if total else 0)
            key = (cost, r.relative_load, _rendezvous(blocks[0] if total else b"", r.name))
            if best is None or key < best:
                best, picked, picked_matched = key, r, matched
        least = min(healthy, key=_load_order)
        if least is not picked and self._too_uneven(picked, least):
            return Choice(least, least.index.matched(blocks), total, "load")
        reason = "affinity" if picked_matched else "least_loaded"
        return Choice(picked, picked_matched, total, reason)

    def _least_loaded(self, healthy: list[ReplicaState]) -> ReplicaState:
        """The lowest load per weight; ties rotate, so that an idle fleet is not one replica."""
        self._turn += 1
        n = len(healthy)
        order = {r.name: (i - self._turn) % n for i, r in enumerate(healthy)}
        return min(healthy, key=lambda r: (r.relative_load, order[r.name]))

    def _too_uneven(self, picked: ReplicaState, least: ReplicaState) -> bool:
        hot, cold = picked.relative_load, least.relative_load
        opts = self.options
        return hot - cold >= opts.imbalance_abs and hot >= opts.imbalance_ratio * (cold + 1)

    def _round_robin(self, healthy: list[ReplicaState]) -> ReplicaState:
        current = self._rr_current
        total = 0.0
        picked = healthy[0]
        for r in healthy:
            current[r.name] += r.weight
            total += r.weight
            if current[r.name] > current[picked.name]:
                picked = r
        current[picked.name] -= total
        return picked

    def sent(self, choice: Choice, blocks: list[bytes]) -> None:
        """The request went to `choice.replica`: it now holds (or soon will) these blocks."""
        choice.replica.index.add(blocks)
        choice.replica.in_flight += 1

    def done(self, replica: ReplicaState) -> None:
        """A request to `replica` ended, whichever way."""
        replica.in_flight = max(0, replica.in_flight - 1)

    def by_name(self, name: str) -> ReplicaState:
        return self._by_name[name]


def _rendezvous(block: bytes, name: str) -> bytes:
    return hashlib.blake2b(block + name.encode(), digest_size=8).digest()


def _load_order(r: ReplicaState) -> tuple[float, str]:
    return (r.relative_load, r.name)


def _failure_order(r: ReplicaState) -> tuple[float, str]:
    return (-math.inf if r.health.last_failure is None else r.health.last_failure, r.name)
