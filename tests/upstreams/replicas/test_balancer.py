"""The balancer: affinity against load, the imbalance rule, weights, health, round robin."""

from __future__ import annotations

from collections import Counter

import pytest

from gateway.upstreams.replicas.balancer import BalanceOptions, Balancer, Choice, ReplicaState
from gateway.upstreams.replicas.health import HealthPolicy, ReplicaHealth
from gateway.upstreams.replicas.latency import FIXED_SAMPLES
from gateway.upstreams.replicas.prefix_index import ENTRY_BYTES, PrefixIndex, prefix_blocks

PROMPT = prefix_blocks("s" * 4096)  # 16 blocks
OTHER = prefix_blocks("o" * 4096)


def replica(name: str, *, holds: list[bytes] | None = None, **fields: object) -> ReplicaState:
    state = ReplicaState(
        name=name, index=PrefixIndex(), health=ReplicaHealth(HealthPolicy()), **fields
    )
    if holds:
        state.index.add(holds)
    return state


def balancer(*replicas: ReplicaState, **options: object) -> Balancer:
    return Balancer(list(replicas), BalanceOptions(**options))


def test_the_replica_holding_the_prefix_wins() -> None:
    holder = replica("z", holds=PROMPT)
    b = balancer(replica("a"), replica("m", holds=OTHER), holder)
    choice = b.choose(PROMPT, 0.0)
    assert choice.replica is holder and choice.reason == "affinity"
    assert (choice.matched_blocks, choice.total_blocks) == (16, 16)


def test_the_longer_match_wins() -> None:
    half = prefix_blocks("s" * 2048 + "t" * 2048)
    b = balancer(replica("a", holds=half), replica("b", holds=PROMPT))
    assert b.choose(PROMPT, 0.0).replica.name == "b"


# The priors make the arithmetic plain: PROMPT is 1,024 tokens, 1 ms each to recompute; a request
# past the 8 slots holds one for 1,000 ms: with 8 + k requests in flight a new one waits
# (k + 1) * 125 ms.
# (The imbalance rule is set out of the way.)
MS = {"prior_prefill_ms_per_token": 1.0, "prior_service_ms": 1000.0, "imbalance_abs": 100}


def test_load_outweighs_a_full_match_once_waiting_costs_more_than_recomputing() -> None:
    holder = replica("a", holds=PROMPT, in_flight=15)
    b = balancer(holder, replica("b"), **MS)
    assert b.choose(PROMPT, 0.0).replica is holder  # 8 * 125 = 1000 ms < 1024 ms
    holder.in_flight = 16
    choice = b.choose(PROMPT, 0.0)
    assert choice.replica.name == "b" and choice.reason == "least_loaded"  # 1125 > 1024
    assert choice.uncached_tokens == 1024 and choice.free_slot


def test_queue_and_kv_usage_count_as_load() -> None:
    holder = replica("a", holds=PROMPT, in_flight=4, queue=11)
    b = balancer(holder, replica("b"), **MS)
    assert b.choose(PROMPT, 0.0).replica is holder  # 4 + 11 others' ahead: 8 * 125 < 1024
    assert not b.choose(PROMPT, 0.0, frozenset({"b"})).free_slot
    holder.queue = 12
    assert b.choose(PROMPT, 0.0).replica.name == "b"  # 9 * 125 > 1024
    # the queue the server reports holds the gateway's own waiting requests too
    holder.in_flight, holder.queue = 15, 7
    assert b.wait_ms(holder) == 1000.0
    b = balancer(replica("a", kv_usage=0.9), replica("b", kv_usage=0.1))
    assert b.choose(OTHER, 0.0).replica.name == "b"
    b = balancer(replica("a", kv_usage=0.9), replica("b", in_flight=1))
    assert b.choose(OTHER, 0.0).replica.name == "b"  # 1/8 < 0.5 * 0.9, among equal costs


def test_a_stale_queue_report_counts_the_gateway_s_requests_of_then_not_others() -> None:
    # read while 11 of its own were in flight (3 waiting); since then they started: now 8 in
    # flight, the slots full and nobody waiting, whatever the report still says
    holder = replica("a", holds=PROMPT, in_flight=8, queue=3, in_flight_at_report=11)
    b = balancer(holder, replica("b"), **MS)
    assert b.wait_ms(holder) == 125.0  # one slot's turn: 1000 ms / 8, not 4 * 125
    assert b.choose(PROMPT, 0.0, first_turn=False).replica is holder
    holder.in_flight_at_report = 8  # the 3 were others' after all: 4 slot turns
    assert b.wait_ms(holder) == 500.0


def test_at_equal_cost_the_replica_holding_the_prompt_wins_over_the_less_busy() -> None:
    # a prefill rate fitted to 0 from noisy answers makes every free replica cost the same;
    # the holder, one request still ending there, keeps the conversation
    holder = replica("a", holds=PROMPT, in_flight=1)
    b = balancer(holder, replica("b"), prior_prefill_ms_per_token=0.0)
    assert b.choose(PROMPT, 0.0, first_turn=False).replica is holder
    assert b.choose(OTHER, 0.0).replica.name == "b"  # nobody holds it: the less busy


def test_slot_time_is_learned_from_requests_that_found_a_slot_free() -> None:
    r = replica("a")
    b = balancer(r, replica("b"))
    r.in_flight = 1
    b.done(r, 5.0, free_slot=False)  # 5 s, most of it in the server's queue
    assert r.latency.service_ms is None and r.in_flight == 0
    r.in_flight = 1
    b.done(r, 0.4)
    assert r.latency.service_ms == 400.0


def test_weights_scale_load() -> None:
    big = replica("a", holds=PROMPT, in_flight=20, weight=2.0)
    b = balancer(big, replica("b"), **MS)
    assert b.choose(PROMPT, 0.0).replica is big  # 5 past 16 slots: 5 * 1000 / 16 < 1024
    big.weight = 1.0
    assert b.choose(PROMPT, 0.0).replica.name == "b"


def test_observed_ttfts_fit_the_prefill_rate_and_each_replicas_fixed_part() -> None:
    a, c = replica("a"), replica("c")
    b = balancer(a, c, **MS)
    for i in range(40):  # TTFT = 20 ms + 0.25 ms per uncached token, on both
        for r in (a, c):
            tokens = 100.0 + 50 * (i % 9)
            b.first_token(Choice(r, 0, 0, "affinity", tokens), (20 + 0.25 * tokens) / 1000)
    assert b.latency.prefill_ms_per_token == pytest.approx(0.25)
    assert a.latency.fixed_ms == pytest.approx(20.0)
    fleet = [a.latency, c.latency]
    assert b.latency.excess_ms(c.latency, fleet) == 0.0
    for _ in range(5):  # c turns 300 ms slower: a short median sees it
        b.first_token(Choice(c, 0, 0, "affinity", 100.0), (320 + 25) / 1000)
    assert c.latency.fixed_ms == pytest.approx(320.0, abs=5)
    assert b.latency.excess_ms(c.latency, fleet) == pytest.approx(300.0, abs=5)
    assert b.latency.excess_ms(a.latency, fleet) == 0.0
    # all of them at once, as a choice takes them: the same figures, and 0 for one never seen
    unseen = replica("u")
    with_unseen = [*fleet, unseen.latency]
    assert b.latency.excesses(with_unseen) == [
        b.latency.excess_ms(r, with_unseen) for r in with_unseen
    ]
    assert b.latency.excesses(with_unseen)[1] == pytest.approx(300.0, abs=5)
    assert b.latency.excesses([unseen.latency, replica("v").latency]) == [0.0, 0.0]
    # a request that waited for a slot says nothing of the fixed part
    b.first_token(Choice(a, 0, 0, "affinity", 100.0, free_slot=False), 5.0)
    assert a.latency.fixed_ms == pytest.approx(20.0)


def test_the_excesses_a_choice_reads_follow_every_new_residual() -> None:
    # the figures are kept between choices: each residual observed must still move them
    a, c = replica("a"), replica("c")
    b = balancer(a, c, **MS)
    fleet = [a.latency, c.latency]
    for _ in range(FIXED_SAMPLES):
        a.latency.observe_fixed(20.0)
        c.latency.observe_fixed(20.0)
    assert b.latency.excesses(fleet) == [0.0, 0.0]
    for step in range(1, FIXED_SAMPLES // 2 + 2):
        c.latency.observe_fixed(320.0)
        expected = 300.0 if step > FIXED_SAMPLES // 2 else 0.0
        assert b.latency.excesses(fleet) == [0.0, pytest.approx(expected)]
        assert c.latency.fixed_ms == pytest.approx(320.0 if expected else 20.0)
    # the list handed out is the caller's: changing it changes nothing kept
    b.latency.excesses(fleet)[1] = -1.0
    assert b.latency.excesses(fleet)[1] == pytest.approx(300.0)
    # another fleet is weighed on its own residuals, not the last fleet's figures
    d = replica("d")
    d.latency.observe_fixed(20.0)
    assert b.latency.excesses([c.latency, d.latency]) == [pytest.approx(300.0), 0.0]


def test_a_slow_replica_keeps_its_warm_follow_ups_and_loses_new_conversations() -> None:
    slow = replica("slow", holds=PROMPT)
    fast = replica("fast")
    b = balancer(slow, fast, **MS)
    for _ in range(FIXED_SAMPLES):
        b.first_token(Choice(slow, 0, 0, "affinity", 0.0), 0.320)
        b.first_token(Choice(fast, 0, 0, "affinity", 0.0), 0.020)
    for i in range(400):  # conversations of 4 turns on this route
        b.latency.observe_turn(i % 4 == 0)
    # a follow-up: 300 ms more there against 1024 ms of recompute here
    follow_up = b.choose(PROMPT, 0.0, first_turn=False)
    assert follow_up.replica is slow and follow_up.reason == "affinity"
    slow.in_flight = (
        10  # it stays for load alone (300 + 375 < 1024): the imbalance rule is for first turns
    )
    assert b.choose(PROMPT, 0.0, first_turn=False).replica is slow
    slow.in_flight = 0
    # a new conversation pays the slow replica's 300 ms on each of its ~4 turns: 1200 > 1024
    assert b.latency.turns_per_session == pytest.approx(4.0, rel=0.2)
    assert b.choose(PROMPT, 0.0, first_turn=True).replica is fast


def test_a_follow_up_moved_off_a_full_replica_does_not_land_on_the_slow_one() -> None:
    slow, fast, full = replica("slow"), replica("fast"), replica("full", holds=PROMPT)
    b = balancer(slow, fast, full, **MS)
    for _ in range(FIXED_SAMPLES):
        b.first_token(Choice(slow, 0, 0, "affinity", 0.0), 0.320)
        for r in (fast, full):
            b.first_token(Choice(r, 0, 0, "affinity", 0.0), 0.020)
    full.in_flight = 24  # 17 slot turns of 125 ms: 2125 ms of waiting against 1024 of recompute
    # both others recompute it all (1024 ms); the slow one adds its 300 ms: the fast one wins
    assert b.choose(PROMPT, 0.0, first_turn=False).replica is fast
    fast.in_flight = 1  # less busy no longer breaks the tie the slow one's excess decides
    assert b.choose(PROMPT, 0.0, first_turn=False).replica is fast


@pytest.mark.parametrize(
    ("hot", "cold", "load_wins"),
    [
        (15, 0, False),  # difference under imbalance_abs
        (16, 0, True),  # 16 - 0 >= 16 and 16 >= 2 * (0 + 1)
        (20, 5, False),  # difference 15
        (21, 5, True),  # difference 16 and 21 >= 12
        (40, 20, False),  # difference 20 but 40 < 2 * 21
        (42, 20, True),
    ],
)
def test_imbalance_rule_thresholds(hot: int, cold: int, load_wins: bool) -> None:
    # no service time: the wait term leaves the rule alone against a full match
    holder = replica("a", holds=PROMPT, in_flight=hot)
    b = balancer(holder, replica("b", in_flight=cold), prior_service_ms=0.0)
    choice = b.choose(PROMPT, 0.0)
    assert (choice.replica.name == "b") is load_wins
    assert choice.reason == ("load" if load_wins else "affinity")


def test_imbalance_rule_is_configurable_and_compares_the_pick() -> None:
    holder = replica("a", holds=PROMPT, in_flight=4)
    b = balancer(holder, replica("b"), prior_service_ms=0.0, imbalance_abs=4, imbalance_ratio=4.0)
    assert b.choose(PROMPT, 0.0).reason == "load"
    # a hot replica elsewhere does not break the affinity of a cool one
    b = balancer(
        replica("a", holds=PROMPT, in_flight=2),
        replica("b"),
        replica("c", in_flight=30),
        prior_service_ms=0.0,
    )
    choice = b.choose(PROMPT, 0.0)
    assert choice.replica.name == "a" and choice.reason == "affinity"


def test_ties_go_to_lower_load() -> None:
    b = balancer(replica("c"), replica("b"), replica("a", in_flight=1))
    assert b.choose(OTHER, 0.0).replica.name in {"b", "c"}
    # equal cost (no wait term): the lower load wins
    b = balancer(replica("a", in_flight=1), replica("b"), prior_service_ms=0.0)
    assert b.choose(PROMPT, 0.0).replica.name == "b"


def test_least_loaded_mode() -> None:
    b = balancer(
        replica("a", holds=PROMPT, in_flight=3),
        replica("b", in_flight=3, weight=2.0),
        replica("c", in_flight=2),
        mode="least_loaded",
    )
    choice = b.choose(PROMPT, 0.0)
    assert choice.replica.name == "b" and choice.reason == "least_loaded"
    b = balancer(replica("b"), replica("a"), mode="least_loaded")
    assert b.choose(PROMPT, 0.0).replica.name == "a"


def test_round_robin_follows_weights_smoothly() -> None:
    b = balancer(
        replica("a", weight=1.0),
        replica("b", weight=2.0),
        replica("c", weight=3.0),
        mode="round_robin",
    )
    picks = [b.choose(PROMPT, 0.0) for _ in range(1000)]
    assert {p.reason for p in picks} == {"round_robin"}
    counts = Counter(p.replica.name for p in picks)
    for name, share in (("a", 1 / 6), ("b", 2 / 6), ("c", 3 / 6)):
        assert abs(counts[name] / 1000 - share) <= 0.02
    names = [p.replica.name for p in picks[:6]]
    assert sorted(names) == ["a", "b", "b", "c", "c", "c"]  # interleaved within each cycle
    assert names.count("c") == 3 and names[:2] != ["c", "c"]


def test_round_robin_skips_ejected_replicas() -> None:
    a, b_ = replica("a"), replica("b")
    b = balancer(a, b_, replica("c"), mode="round_robin")
    a.health.failed(0.0)
    picks = Counter(b.choose(PROMPT, 0.5).replica.name for _ in range(100))
    assert picks == {"b": 50, "c": 50}


def test_never_an_ejected_replica_while_a_healthy_one_exists() -> None:
    holder = replica("a", holds=PROMPT)
    busy = replica("b", in_flight=50)
    holder.health.failed(0.0)
    for mode in ("prefix_affinity", "least_loaded", "round_robin"):
        b = balancer(holder, busy, mode=mode)
        assert {b.choose(PROMPT, 0.5).replica.name for _ in range(4)} == {"b"}
    b = balancer(holder, busy)
    assert b.choose(PROMPT, 1.0).replica is holder  # half-open after its ejection


def test_with_none_healthy_the_oldest_failure_is_tried() -> None:
    a, b_, c = replica("a"), replica("b"), replica("c")
    b_.health.failed(1.0)
    b_.health.failed(2.0)  # half-open, failed again: out until 4.0
    a.health.failed(2.5)
    c.health.failed(3.0)
    b = balancer(a, b_, c)
    choice = b.choose(PROMPT, 3.2)
    assert choice.replica is b_ and choice.reason == "only_unhealthy"


def test_exclude() -> None:
    holder = replica("a", holds=PROMPT)
    sick = replica("c")
    sick.health.failed(0.0)
    b = balancer(holder, replica("b"), sick)
    assert b.choose(PROMPT, 0.1, exclude=frozenset({"a"})).replica.name == "b"
    choice = b.choose(PROMPT, 0.1, exclude=frozenset({"a", "b"}))
    assert choice.replica is sick and choice.reason == "only_unhealthy"
    with pytest.raises(LookupError):
        b.choose(PROMPT, 0.1, exclude=frozenset({"a", "b", "c"}))


def test_sent_and_done_keep_the_index_and_in_flight() -> None:
    a, b_ = replica("a"), replica("b")
    b = balancer(a, b_, **MS)
    first = b.choose(PROMPT, 0.0)
    b.sent(first, PROMPT)
    holder = first.replica
    other = b_ if holder is a else a
    assert holder.in_flight == 1 and holder.index.matched(PROMPT) == 16
    second = b.choose(PROMPT, 0.0)
    assert second.replica is holder and second.reason == "affinity"
    assert b.choose(OTHER, 0.0).replica is other  # no match anywhere: the less loaded
    b.done(holder)
    b.done(holder)
    assert holder.in_flight == 0
    assert b.by_name("b") is b_
    with pytest.raises(KeyError):
        b.by_name("nope")


def test_new_prefixes_spread_by_their_first_block_the_same_everywhere() -> None:
    """Ties among idle replicas go to a hash of the prompt's first block: different families
    land on different replicas, and two balancers (two gateway processes) agree."""
    names = [f"r{i}" for i in range(4)]
    one = balancer(*(replica(n) for n in names))
    two = balancer(*(replica(n) for n in names))
    picks = []
    for family in range(40):
        blocks = prefix_blocks(f"family {family} " * 100)
        picked = one.choose(blocks, 0.0).replica.name
        assert two.choose(blocks, 0.0).replica.name == picked
        picks.append(picked)
    assert min(Counter(picks).values()) >= 4  # every replica gets some of the 40


def test_empty_prompt_goes_by_load() -> None:
    b = balancer(replica("a", in_flight=2), replica("b", in_flight=1))
    choice = b.choose([], 0.0)
    assert choice.replica.name == "b" and choice.total_blocks == 0


@pytest.mark.parametrize(
    "options",
    [{"mode": "random"}, {"slots": 0}],
)
def test_options_are_checked(options: dict) -> None:
    with pytest.raises(ValueError):
        balancer(replica("a"), **options)


def test_replicas_are_checked() -> None:
    with pytest.raises(ValueError):
        Balancer([], BalanceOptions())
    with pytest.raises(ValueError):
        balancer(replica("a"), replica("a"))
    with pytest.raises(ValueError):
        balancer(replica("a", weight=0.0))


def test_load_counts_the_gateway_s_own_waiting_requests_once() -> None:
    # 12 of its own in flight, 8 running there and 4 waiting: the server reports those 4
    r = replica("a", in_flight=12, queue=4, in_flight_at_report=12)
    b = balancer(r, replica("b"), **MS)
    assert b.relative_load(r) == 12.0
    r.queue = 6  # 2 waiting that are not the gateway's
    assert b.relative_load(r) == 14.0
    r.weight = 2.0  # 16 slots: none of its own waits, the 6 are all others'
    assert b.relative_load(r) == 9.0


def slowed(b: Balancer, slow: ReplicaState, *fast: ReplicaState, turns: int = 4) -> None:
    """`slow` answers 300 ms later than the `fast` ones; conversations of `turns` turns."""
    for _ in range(FIXED_SAMPLES):
        b.first_token(Choice(slow, 0, 0, "affinity", 0.0), 0.320)
        for r in fast:
            b.first_token(Choice(r, 0, 0, "affinity", 0.0), 0.020)
    for i in range(100 * turns):
        b.latency.observe_turn(i % turns == 0)


def test_a_second_turn_stays_where_its_first_went_not_on_the_idle_slow_holder() -> None:
    # both hold the tenant's system prompt; the first turn added no whole block past it, so the
    # second matches both as much; the slow one is idle (it sheds new work), the fast one busy
    slow, fast = replica("slow", holds=PROMPT), replica("fast", holds=PROMPT, in_flight=5)
    b = balancer(slow, fast, **MS)
    slowed(b, slow, fast)
    first = b.choose(PROMPT, 0.0, first_turn=True, conversation=11)
    assert first.replica is fast
    b.sent(first, PROMPT)
    assert b.choose(PROMPT, 0.0, first_turn=False, conversation=11).replica is fast
    # a gateway process that did not see the first turn: the replica sent the prefix last
    other = balancer(slow, fast, **MS)
    slowed(other, slow, fast)
    assert other.choose(PROMPT, 0.0, first_turn=False).replica is fast


def test_a_follow_up_its_home_s_index_forgot_stays_home_among_equal_costs() -> None:
    # the home's index has turned over past the conversation: by the index, every replica
    # would recompute it alike; the home's engine may still hold some of it, the others do not
    home, roomy = replica("home"), replica("roomy")
    b = balancer(home, roomy, **MS)
    b.homes.placed(7, "home")
    assert roomy.index.pressure() == home.index.pressure()
    assert b.choose(PROMPT, 0.0, first_turn=False, conversation=7).replica is home
    roomy.index.add(OTHER)  # the one of the two with more room, which a first turn prefers
    assert b.choose(PROMPT, 0.0, first_turn=True).replica is home
    home.index.add(prefix_blocks("h" * 8192))
    assert b.choose(PROMPT, 0.0, first_turn=True).replica is roomy
    assert b.choose(PROMPT, 0.0, first_turn=False, conversation=7).replica is home
    home.in_flight = 8  # no slot free at home: waiting costs more than nothing, it moves
    assert b.choose(PROMPT, 0.0, first_turn=False, conversation=7).replica is roomy


def test_a_moved_follow_up_pays_the_slower_replica_s_excess_on_every_turn_it_will_have() -> None:
    # its home is full: 12 in flight, 5 slot turns of 125 ms = 625 ms of waiting; the slow
    # replica holds the prompt too, 300 ms slower on each of ~4 turns: 1200 ms
    home = replica("home", holds=PROMPT, in_flight=12)
    slow = replica("slow", holds=PROMPT)
    b = balancer(slow, home, **MS)
    slowed(b, slow, home)
    b.sent(b.choose(PROMPT, 0.0, first_turn=True, conversation=5), PROMPT)
    home.in_flight = 12
    assert b.choose(PROMPT, 0.0, first_turn=False, conversation=5).replica is home
    home.in_flight = 18  # 11 slot turns: 1375 ms > 1200 ms
    assert b.choose(PROMPT, 0.0, first_turn=False, conversation=5).replica is slow


def test_the_imbalance_rule_never_sends_a_first_turn_to_a_slower_replica() -> None:
    busy, slow = replica("busy", holds=PROMPT, in_flight=20), replica("slow")
    b = balancer(busy, slow, prior_service_ms=0.0)  # no wait term: the rule alone decides
    slowed(b, slow, busy)
    choice = b.choose(PROMPT, 0.0)
    assert choice.replica is busy and choice.reason == "affinity"
    cool = replica("cool")
    b = balancer(replica("busy", holds=PROMPT, in_flight=20), slow, cool, prior_service_ms=0.0)
    slowed(b, slow, cool, b.by_name("busy"))
    choice = b.choose(PROMPT, 0.0)
    assert choice.replica is cool and choice.reason == "load"


def test_a_prompt_nobody_holds_goes_to_the_roomier_cache_before_the_less_busy() -> None:
    # indexes of four blocks, as if sized to small engines: a's cache was filled long ago and
    # has not turned over since, b's just now; a new tenant's prompt would push out a's cold
    # prompt, but b's fresh one
    a = ReplicaState("a", index=PrefixIndex(4 * ENTRY_BYTES), in_flight=1)
    b = ReplicaState("b", index=PrefixIndex(4 * ENTRY_BYTES))
    a.index.add(prefix_blocks("a" * 1024))
    b.index.add(prefix_blocks("b" * 1024))
    assert a.index.pressure() < b.index.pressure()
    assert balancer(a, b).choose(OTHER, 0.0).replica is a
    b.index.add(prefix_blocks("c" * 1024))
    a.index.add(prefix_blocks("d" * 1024))
    assert balancer(a, b).choose(OTHER, 0.0).replica is b
    # an index with room left beats any full one, and more room beats less
    roomy = ReplicaState("r", index=PrefixIndex(8 * ENTRY_BYTES), in_flight=3)
    roomy.index.add(prefix_blocks("e" * 512))
    assert roomy.index.pressure() == (-6, 0)
    assert balancer(a, b, roomy).choose(OTHER, 0.0).replica is roomy
    # holding part of the prompt still comes first
    a.index.add(OTHER[:2])
    assert balancer(a, b, roomy).choose(OTHER, 0.0).replica is a


def test_a_follow_up_moving_into_a_full_cache_pays_its_recompute_twice() -> None:
    # home holds the conversation; b holds nothing of it. Moving recomputes 1,024 tokens there
    # (1,024 ms); into a full cache that pushes as much of others' prefixes out, which they
    # recompute later: 2,048 ms in all, against the wait at home.
    home = replica("home", holds=PROMPT, in_flight=16)  # 9 slot turns: 1,125 ms
    roomy = replica("b")
    b = balancer(home, roomy, **MS)
    assert b.choose(PROMPT, 0.0, first_turn=False).replica is roomy  # 1,125 > 1,024
    full = ReplicaState(name="b", index=PrefixIndex(max_bytes=16 * ENTRY_BYTES))
    full.index.add(OTHER)
    assert full.index.pressure()[0] == 0  # no room: whatever comes in evicts
    b = balancer(home, full, **MS)
    assert b.choose(PROMPT, 0.0, first_turn=False).replica is home  # 1,125 < 2,048
    home.in_flight = 24  # 17 slot turns: 2,125 ms
    assert b.choose(PROMPT, 0.0, first_turn=False).replica is full
    # a new conversation opening with the held prefix weighs it alike: it waits at the holder
    # rather than push the prefix into a second full cache, and goes when waiting costs more
    home.in_flight = 16
    assert b.choose(PROMPT, 0.0, first_turn=True).replica is home
    home.in_flight = 24
    assert b.choose(PROMPT, 0.0, first_turn=True).replica is full
