"""Which replica of a route serves a request: prefix affinity weighed against load.

A prefix-caching engine answers a prompt whose beginning it has seen for little more than the
new part, so sending requests that share a prefix to the replica that holds it cuts time to
first token; but a replica that gets everything its prefixes attract queues, and queueing
costs more than a cache miss. The balancer trades one against the other in one cost function,
and lets load win outright when it is too uneven.

Modes (`BalanceOptions.mode`):

- ``prefix_affinity`` (default): the replica where the request's first token is expected
  soonest, in milliseconds, counting what the choice costs the conversation's later turns
  (`gateway.upstreams.replicas.latency` says how each term is observed):

      first turn:  cost(r) = turns * excess(r) + evicted(r) + wait(r) + prefill * uncached(r)
      follow-up:   cost(r) = [r not home] * (turns * excess(r) + evicted(r))
                             + wait(r) + prefill * uncached(r)

      uncached(r) = the prompt's tokens that r likely does not hold (`PrefixIndex`)
      prefill     = ms per uncached token, fitted over the route's replicas
      excess(r)   = how much r's fixed part (its TTFT beyond prefill with a free slot, a
                    recent median) exceeds the fastest replica's, where that stands out of
                    the noise (the part all replicas share changes no choice)
      wait(r)     = service(r) * max(0, ahead(r) + 1 - cap(r)) / cap(r): the wait for a slot
                    (cap = slots * weight; ahead = the gateway's in_flight plus the waiting
                    requests the server reports beyond the gateway's own, `others_waiting`);
                    each request holds a slot for service(r) ms, r's send-to-end time
                    (requests that found a slot free); 0 while a slot is free
      evicted(r)  = prefill * (uncached(r) - uncached(home)) where r's cache is full (its
                    index has no room): what a move recomputes on r that its home holds
                    already pushes as much of other conversations' prefixes out of r, and
                    they pay for it again on their next turns; a move costs its recompute twice
      turns       = the route's observed requests per conversation (1 / the share of first
                    turns: requests without an assistant message)
      home        = the replica the conversation's last turn went to (`ConversationHomes`,
                    this process's recent conversations); failing that (and for a first
                    turn, whose shared prefix some replica may hold), the replica holding
                    most of the follow-up's prompt, of several holding as much the one sent it
                    last (a replica holding only the tenant's system prompt holds as much of a
                    second turn whose first turn added no whole block as the one it went to)

  The rule in words: warm sessions stay, slow replicas shed new work. A follow-up turn stays
  at its home unless waiting for a slot there costs more than recomputing its uncached part
  elsewhere (twice, where that evicts others' prefixes); where it would land, it pays that
  replica's excess on every turn it will have (it stays there from then on), so a follow-up
  that leaves a full replica never lands on the slow one. A new conversation pays r's excess
  on every turn it will have (a slow replica stays slow) but its wait once (a queue drains),
  against recomputing its shared prefix elsewhere (twice into a full cache, as a follow-up
  does): a replica that became slow stops getting new conversations at once, while its warm
  ones stay until it actually queues, and a tenant's conversations wait briefly at the one
  replica that took its prefix over rather than copy it into a third full cache. Each
  tenant's next conversation elsewhere would recompute its shared prefix there;
  `hand_over_target` names where a warm conversation's request may send that prefix first
  (`gateway.upstreams.replicas.hand_over`).
  Ties go to the replica holding more of the prompt (a prefill rate fitted to nothing from
  noisy answers must not scatter a conversation over equal costs), then, for a follow-up, to
  its home (the index forgets a conversation that its replica's cache may still hold: where
  the index says every replica would recompute it alike, the one it went to may not), then
  to the one sent that prefix last (a tenant's conversations gather where its prompt is
  freshest instead of keeping copies warm on several replicas), then to the roomier cache
  (`PrefixIndex.pressure`: free room, then the slowest turnover; a new tenant's prompt lands
  where it stays longest and pushes out only cold prompts, as sglang-router's smallest tree
  does for unbounded trees), then to the less busy (load per slot, plus half the KV cache
  usage where reported), then to a rendezvous hash of the prompt's first block with the
  replica's name (a prefix nobody holds lands on a replica chosen by the prefix itself, the
  same in every gateway process).

  Load (`relative_load`): the gateway's own in-flight requests (running on the server or
  waiting in its queue) plus the others' waiting requests the server reports, per unit of
  weight; the gateway's own waiting requests are in both and count once.

  Imbalance rule: if the replica the cost picks is, in load per unit of weight, at least
  `imbalance_abs` requests above the least loaded healthy replica no slower than it (excess
  no greater) *and* at least `imbalance_ratio` * (least + 1), load wins and that least loaded
  replica is taken (reason "load"): the guard for the wait and prefill estimates gone wrong,
  not the everyday balancer, and never a way back onto a replica measured slower (which is
  idle because it sheds new work); for first turns only (a follow-up moves when its cost
  says so, never for load alone).

- ``least_loaded``: the lowest load(r)/weight(r), ties taken in turn.
- ``round_robin``: smooth weighted round robin (nginx's) over the healthy replicas.

Health first, in every mode: an ejected replica is never chosen while a healthy one that is
not in `exclude` exists; with none healthy, the one whose last failure is oldest (a replica
that never failed first) is tried (reason "only_unhealthy").

`bench/replica_routing.py` checks the defaults against simulated prefix-caching replicas, and
`bench/fleet_http.py` against prefix-caching engines over HTTP (one slowed 300 ms mid-run).

The index remembers what was sent, not what the engine kept: size `PrefixIndex.max_bytes` near
the engine's KV capacity (192 bytes per 256-character block, ~64 tokens) where that is known;
the default 4 MiB remembers ~1.4M tokens, more than most single replicas hold.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from gateway.upstreams.replicas.health import HealthPolicy, ReplicaHealth
from gateway.upstreams.replicas.latency import CHARS_PER_TOKEN, FleetLatency, ReplicaLatency
from gateway.upstreams.replicas.prefix_index import BLOCK_CHARS, ConversationHomes, PrefixIndex

MODES = ("prefix_affinity", "least_loaded", "round_robin")
KV_USAGE_WEIGHT = 0.5  # a full KV cache counts as half a set of slots of load


@dataclass
class ReplicaState:
    """What the balancer knows of one replica."""

    name: str
    weight: float = 1.0
    in_flight: int = 0
    queue: int | None = None  # upstream-reported waiting requests; None: unknown
    # this gateway's in_flight when `queue` was read (None: read now), to tell its own waiting
    # requests in that report from others'
    in_flight_at_report: int | None = None
    kv_usage: float | None = None  # 0..1; None: unknown
    index: PrefixIndex = field(default_factory=PrefixIndex)
    health: ReplicaHealth = field(default_factory=lambda: ReplicaHealth(HealthPolicy()))
    latency: ReplicaLatency = field(default_factory=ReplicaLatency)

    def others_waiting(self, cap: float) -> float:
        """The waiting requests the server reported that are not this gateway's: its report
        counts the gateway's own requests past the `cap` slots too (in flight here, waiting
        there), which `in_flight` already holds. A report up to a read interval old is set
        against the gateway's in-flight of then, not of now: requests of its own that have
        since started (or ended) are not taken for others' still waiting."""
        if not self.queue:
            return 0.0
        own = self.in_flight if self.in_flight_at_report is None else self.in_flight_at_report
        return max(0.0, self.queue - max(0.0, own - cap))


@dataclass
class BalanceOptions:
    mode: str = "prefix_affinity"
    slots: int = 8
    # two sets of slots queued beyond the least loaded: at one set (8), the rule overrode the
    # cost's wait against a recompute three or four times in 150 s of the fleet bench, each a
    # first turn recomputing its prompt into a full cache and its tenant split over two
    imbalance_abs: int = 16
    imbalance_ratio: float = 2.0
    # what the cost assumes before the route's answers have been seen
    prior_prefill_ms_per_token: float = 0.1
    prior_service_ms: float = 1000.0


@dataclass
class Choice:
    replica: ReplicaState
    matched_blocks: int
    total_blocks: int
    # "affinity" (cost function, prefix matched), "least_loaded" (cost function without any
    # match, or mode least_loaded), "load" (imbalance rule), "round_robin", "only_unhealthy"
    reason: str
    uncached_tokens: float = 0.0  # the picked replica's, as estimated when choosing
    free_slot: bool = True  # the picked replica had a slot free when chosen
    conversation: int | None = None  # `conversation_key` of the request, when known
    slow: bool = False  # the picked replica was measured slower than the fastest (excess > 0)


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
        self.latency = FleetLatency(options.prior_prefill_ms_per_token)
        self.homes = ConversationHomes()

    def choose(
        self,
        blocks: list[bytes],
        now: float,
        exclude: frozenset[str] = frozenset(),
        prompt_chars: int | None = None,
        first_turn: bool = True,
        conversation: int | None = None,
    ) -> Choice:
        """The replica for a prompt with these blocks (`prompt_chars` long; whole blocks when
        not given), the first turn of a conversation (or a request not known to follow one)
        or a follow-up, of `conversation` (a `conversation_key`) when known. Raises
        LookupError when `exclude` leaves no replica at all (a hedge on a one-replica
        route)."""
        allowed = [r for r in self.replicas if r.name not in exclude]
        if not allowed:
            raise LookupError("every replica is excluded")
        chars = len(blocks) * BLOCK_CHARS if prompt_chars is None else prompt_chars
        if not exclude:
            self.latency.observe_turn(first_turn)
        healthy = [r for r in allowed if r.health.healthy(now)]
        if not healthy:
            oldest = min(allowed, key=_failure_order)
            return self._choice(oldest, blocks, chars, "only_unhealthy")
        mode = self.options.mode
        if mode == "round_robin":
            return self._choice(self._round_robin(healthy), blocks, chars, "round_robin")
        if mode == "least_loaded":
            return self._choice(self._least_loaded(healthy), blocks, chars, "least_loaded")
        known = None if first_turn or conversation is None else self.homes.get(conversation)
        choice = self._affinity(healthy, blocks, chars, first_turn, known)
        choice.conversation = conversation
        return choice

    def _choice(
        self, r: ReplicaState, blocks: list[bytes], chars: int, reason: str, matched: int = -1
    ) -> Choice:
        if matched < 0:
            matched = r.index.matched(blocks) if blocks else 0
        return Choice(
            r,
            matched,
            len(blocks),
            reason,
            _uncached_tokens(chars, matched),
            r.in_flight < self.options.slots * r.weight and not r.queue,
        )

    def _affinity(
        self,
        healthy: list[ReplicaState],
        blocks: list[bytes],
        chars: int,
        first_turn: bool,
        known_home: str | None = None,
    ) -> Choice:
        total = len(blocks)
        turns = self.latency.turns_per_session
        prefill = self.latency.prefill_ms_per_token
        first = blocks[0] if total else b""
        excess_of = dict(
            zip(
                (r.name for r in self.replicas),
                self.latency.excesses([r.latency for r in self.replicas]),
                strict=True,
            )
        )
        best: tuple[float, int, bool, int, tuple[int, int], float] | None = None
        picked, picked_matched = healthy[0], 0
        matches = [r.index.matched(blocks) if total else 0 for r in healthy]
        # when each replica was last sent the prefix it holds: of replicas holding as much, the
        # one sent it last is where the conversation went on
        recency = [
            r.index.last_sent(blocks[m - 1]) if m else 0
            for r, m in zip(healthy, matches, strict=True)
        ]
        home = next((r for r in healthy if r.name == known_home), None) or self._home(
            healthy, matches, recency
        )
        home_uncached = None
        if home is not None:
            home_uncached = _uncached_tokens(chars, matches[healthy.index(home)])
        for r, matched, sent in zip(healthy, matches, recency, strict=True):
            # a follow-up pays no excess at its home (already paid: it stays), but moving it
            # onto a slower replica costs that replica's excess on every turn it will have
            # there (it stays there from then on), as a new conversation does
            stays = not first_turn and r is home
            excess = 0.0 if stays else excess_of[r.name]
            uncached = _uncached_tokens(chars, matched)
            cost = turns * excess + self.wait_ms(r) + prefill * uncached
            pressure = r.index.pressure()
            if home_uncached is not None and not stays and pressure[0] == 0:
                cost += prefill * max(0.0, uncached - home_uncached)
            key = (cost, -matched, not stays, -sent, pressure, self._busy(r))
            if (
                best is None
                or key < best
                # the last tie-break, hashed only for a tie
                or (key == best and _rendezvous(first, r.name) < _rendezvous(first, picked.name))
            ):
                best, picked, picked_matched = key, r, matched
        reason = "affinity" if picked_matched else "least_loaded"
        if first_turn:
            # the guard against the wait and prefill estimates gone wrong, not against a
            # measured slowdown: only replicas no slower than the pick may take the request
            no_slower = excess_of[picked.name]
            least = min(
                (r for r in healthy if excess_of[r.name] <= no_slower),
                key=lambda r: (self.relative_load(r), r.name),
            )
            if least is not picked and self._too_uneven(picked, least):
                picked, reason, picked_matched = least, "load", -1
        choice = self._choice(picked, blocks, chars, reason, picked_matched)
        choice.slow = excess_of[picked.name] > 0
        return choice

    def hand_over_target(
        self, origin: ReplicaState, blocks: list[bytes], chars: int, now: float
    ) -> ReplicaState | None:
        """The replica to hand a shared prefix (`blocks`, `chars` long) over to from `origin`:
        where a new conversation opening with it would go now, when that is another replica
        holding less than half of it. None: no hand-over. Changes nothing (no turn is
        counted)."""
        healthy = [r for r in self.replicas if r.health.healthy(now)]
        if self.options.mode != "prefix_affinity" or len(healthy) < 2 or not blocks:
            return None
        target = self._affinity(healthy, blocks, chars, first_turn=True).replica
        if target is origin or 2 * target.index.matched(blocks) >= len(blocks):
            return None
        return target

    @staticmethod
    def _home(
        healthy: list[ReplicaState], matches: list[int], recency: list[int]
    ) -> ReplicaState | None:
        """The replica holding most of the prompt, the one sent it last among equals (None:
        nobody holds any): a conversation's next turn holds all of its previous turn's prompt,
        which a replica holding only the shared system prompt does not."""
        top = max(matches, default=0)
        if not top:
            return None
        held = [
            (sent, i) for i, (m, sent) in enumerate(zip(matches, recency, strict=True)) if m == top
        ]
        return healthy[max(held)[1]]

    def wait_ms(self, r: ReplicaState) -> float:
        """How long a new request would wait for a slot on `r`, in ms: nothing while a slot is
        free; past that, the requests ahead of it beyond the slots, each freeing a slot every
        service(r) / slots ms. The requests ahead are the gateway's own in flight, plus the
        waiting requests the server reports beyond the gateway's own (its in-flight past the
        slots when the report was read): other clients'. A report up to a second old counts
        the gateway's requests of then, not of now: requests of its own that have since
        started (or ended) are not taken for others' still waiting."""
        cap = self.options.slots * r.weight
        ahead = r.in_flight + r.others_waiting(cap)
        return self._service_ms(r) * max(0.0, ahead + 1 - cap) / cap

    def relative_load(self, r: ReplicaState) -> float:
        """Requests on `r` per unit of weight, as far as this gateway knows: its own in flight
        (running there or waiting in its queue) plus others' waiting; the gateway's own waiting
        requests are in both the server's report and `in_flight`, and count once."""
        return (r.in_flight + r.others_waiting(self.options.slots * r.weight)) / r.weight

    def _service_ms(self, r: ReplicaState) -> float:
        if r.latency.service_ms is not None:
            return r.latency.service_ms
        known = [x.latency.service_ms for x in self.replicas if x.latency.service_ms is not None]
        return sum(known) / len(known) if known else self.options.prior_service_ms

    def _busy(self, r: ReplicaState) -> float:
        """Among choices of equal cost, the less busy: load per slot, a full KV cache counting
        as half a set of slots more."""
        busy = self.relative_load(r) / self.options.slots
        return busy + KV_USAGE_WEIGHT * r.kv_usage if r.kv_usage else busy

    def _least_loaded(self, healthy: list[ReplicaState]) -> ReplicaState:
        """The lowest load per weight; ties rotate, so that an idle fleet is not one replica."""
        self._turn += 1
        n = len(healthy)
        order = {r.name: (i - self._turn) % n for i, r in enumerate(healthy)}
        return min(healthy, key=lambda r: (self.relative_load(r), order[r.name]))

    def _too_uneven(self, picked: ReplicaState, least: ReplicaState) -> bool:
        hot, cold = self.relative_load(picked), self.relative_load(least)
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
        """The request went to `choice.replica`: it now holds (or soon will) these blocks, and
        is the home of the request's conversation."""
        choice.replica.index.add(blocks)
        choice.replica.in_flight += 1
        if choice.conversation is not None:
            self.homes.placed(choice.conversation, choice.replica.name)

    def first_token(self, choice: Choice, seconds: float) -> None:
        """The request sent as `choice` had its first token after `seconds`: a sample of the
        prefill rate and of the replica's fixed part (when it did not wait for a slot)."""
        if not choice.free_slot:
            return
        ms = 1000.0 * seconds
        self.latency.observe_ttft(ms, choice.uncached_tokens)
        residual = ms - self.latency.prefill_ms_per_token * choice.uncached_tokens
        choice.replica.latency.observe_fixed(residual)

    def done(
        self, replica: ReplicaState, seconds: float | None = None, free_slot: bool = True
    ) -> None:
        """A request to `replica` ended, whichever way (`seconds` after it was sent, when it
        ended well: how long it held a slot, if it found one free; one sent to a full replica
        also waited in its queue, and counting that wait as slot time would inflate every
        later wait estimate there, moving warm conversations off it)."""
        replica.in_flight = max(0, replica.in_flight - 1)
        if seconds is not None and free_slot:
            replica.latency.observe_service(1000.0 * seconds)

    def costs(self) -> dict[str, object]:
        """The cost function's terms as they stand, for operators: the route's prefill rate and
        turns per conversation, and each replica's fixed part, excess, slot time and wait."""
        excesses = self.latency.excesses([r.latency for r in self.replicas])
        return {
            "prefill_ms_per_token": round(self.latency.prefill_ms_per_token, 4),
            "turns_per_session": round(self.latency.turns_per_session, 2),
            "replicas": {
                r.name: {
                    "fixed_ms": _rounded(r.latency.fixed_ms),
                    "excess_ms": round(excess, 1),
                    "service_ms": _rounded(r.latency.service_ms),
                    "wait_ms": round(self.wait_ms(r), 1),
                }
                for r, excess in zip(self.replicas, excesses, strict=True)
            },
        }

    def by_name(self, name: str) -> ReplicaState:
        return self._by_name[name]

    def recompute_ms(self, blocks: int) -> float:
        """What computing `blocks` prefix blocks takes a replica, at the route's prefill rate."""
        return self.latency.prefill_ms_per_token * _uncached_tokens(blocks * BLOCK_CHARS, 0)


def _rounded(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 1)


def _uncached_tokens(chars: int, matched_blocks: int) -> float:
    return max(0, chars - matched_blocks * BLOCK_CHARS) / CHARS_PER_TOKEN


def _rendezvous(block: bytes, name: str) -> bytes:
    return hashlib.blake2b(block + name.encode(), digest_size=8).digest()


def _failure_order(r: ReplicaState) -> tuple[float, str]:
    return (-math.inf if r.health.last_failure is None else r.health.last_failure, r.name)
