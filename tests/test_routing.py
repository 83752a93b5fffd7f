"""``zipage.routing``: which replica serves a request (load balance with prefix affinity)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zipage.routing import POLICIES, PrefixIndex, ReplicaLoad, Router, chunk_keys


def test_chunk_keys_name_whole_prefixes():
    a = list(range(100))
    b = a[:64] + [999] * 36
    ka, kb = chunk_keys(a, 16), chunk_keys(b, 16)
    assert len(ka) == 6 and len(kb) == 6  # whole chunks only: 100 // 16
    assert ka[:4] == kb[:4]  # the first 64 items agree
    assert all(x != y for x, y in zip(ka[4:], kb[4:]))  # and every key after the first difference differs
    assert chunk_keys(a[:15], 16) == []
    assert chunk_keys(a, 16) == ka  # deterministic
    assert chunk_keys("abcdefgh", 4) == chunk_keys("abcdxyzw", 4)[:1] + chunk_keys("abcdefgh", 4)[1:]
    # the same piece after a different prefix is a different key
    assert chunk_keys([1, 2, 3, 4], 2)[1] != chunk_keys([9, 9, 3, 4], 2)[1]
    with pytest.raises(ValueError):
        chunk_keys(a, 0)


@given(st.lists(st.integers(0, 50), max_size=60), st.lists(st.integers(0, 50), max_size=60),
       st.integers(1, 8))
def test_chunk_keys_equal_exactly_on_equal_prefixes(a, b, chunk):
    ka, kb = chunk_keys(a, chunk), chunk_keys(b, chunk)
    for i, (x, y) in enumerate(zip(ka, kb)):
        assert (x == y) == (a[:(i + 1) * chunk] == b[:(i + 1) * chunk])


def test_score_counts_waiting_twice_and_a_full_cache():
    assert ReplicaLoad(running=3, waiting=2, kv_usage=0.5).score(8.0) == 5 + 2 + 4
    assert ReplicaLoad(running=1, in_flight=6).score(8.0) == 6  # sent but not yet reported
    assert ReplicaLoad().score(8.0) == 0


def test_least_loaded_replica_wins():
    router = Router(3, "load")
    router.report(0, running=5, waiting=0, kv_usage=0.2)
    router.report(1, running=2, waiting=0, kv_usage=0.1)
    router.report(2, running=2, waiting=1, kv_usage=0.0)
    assert router.choose() == 1
    assert router.loads[1].in_flight == 1
    router.report(1, running=9, waiting=0, kv_usage=0.9)
    assert router.choose() == 2


def test_ties_go_to_the_lowest_index_and_in_flight_spreads_a_burst():
    router = Router(4, "load")
    assert [router.choose() for _ in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [load.in_flight for load in router.loads] == [2, 2, 2, 2]


def test_prefix_affinity_follows_the_prompt():
    router = Router(3, "prefix")
    keys = chunk_keys(list(range(64)), 16)
    first = router.choose(keys)
    assert first == 0
    router.report(0, running=2, waiting=0, kv_usage=0.1)  # a little busier than the others
    assert router.choose(keys) == 0  # within slack: affinity wins
    assert router.prefix_hits == 1
    # a longer prompt sharing the first two chunks also follows them
    assert router.choose(chunk_keys(list(range(32)) + [7] * 32, 16)) == 0
    # an unrelated prompt goes by load
    assert router.choose(chunk_keys([5] * 64, 16)) == 1


def test_the_longest_match_wins():
    router = Router(3, "prefix")
    short, long_ = chunk_keys(list(range(16)), 16), chunk_keys(list(range(64)), 16)
    router.index.insert(short, 1)
    router.index.insert(long_, 2)  # replica 2 holds all four chunks (and now the first too)
    router.index.insert(short, 1)  # replica 1 took the first chunk back
    assert router.index.match(long_) == {1: 1, 2: 4}
    assert router.choose(long_) == 2


def test_slack_lets_balance_override_affinity():
    router = Router(2, "prefix", slack=4.0, slack_ratio=0.25)
    keys = chunk_keys(list(range(64)), 16)
    assert router.choose(keys) == 0
    router.report(0, running=20, waiting=0, kv_usage=0.0)  # 20 > 0 + max(4, 0)
    assert router.choose(keys) == 1
    assert router.index.match(keys) == {1: 4}  # the prefix moved with it
    # the relative slack: 25% of a busy least-loaded replica's load
    router = Router(2, "prefix", slack=4.0, slack_ratio=0.25)
    router.index.insert(keys, 0)
    router.report(0, running=48, waiting=0, kv_usage=0.0)
    router.report(1, running=40, waiting=0, kv_usage=0.0)
    assert router.choose(keys) == 0  # 48 <= 40 + 10
    router.report(0, running=51, waiting=0, kv_usage=0.0)
    assert router.choose(keys) == 1  # 51 > 40 + 10


def test_load_and_round_robin_ignore_prefixes():
    keys = chunk_keys(list(range(64)), 16)
    for policy in ("load", "round_robin"):
        router = Router(3, policy)
        assert [router.choose(keys) for _ in range(3)] == [0, 1, 2]
        assert len(router.index) == 0 and router.prefix_hits == 0


def test_round_robin_cycles_past_loads_and_skips_unhealthy():
    router = Router(3, "round_robin")
    router.report(0, running=100, waiting=50, kv_usage=1.0)
    assert [router.choose() for _ in range(4)] == [0, 1, 2, 0]
    router.mark_down(1)
    assert [router.choose() for _ in range(3)] == [2, 0, 2]
    router.mark_up(1)
    assert router.choose() == 0 and router.choose() == 1


def test_mark_down_forgets_the_replica_and_its_prefixes():
    router = Router(2, "prefix")
    keys = chunk_keys(list(range(64)), 16)
    assert router.choose(keys) == 0
    router.mark_down(0)
    assert router.loads[0] == ReplicaLoad(healthy=False) and len(router.index) == 0
    assert router.healthy() == [1]
    assert router.choose(keys) == 1
    router.mark_up(0)
    assert router.healthy() == [0, 1] and router.loads[0].in_flight == 0
    router.mark_down(0)
    router.mark_down(1)
    with pytest.raises(LookupError):
        router.choose(keys)


def test_finished_never_drops_below_zero():
    router = Router(2, "load")
    router.finished(1)
    assert router.loads[1].in_flight == 0
    router.choose()
    router.finished(0)
    router.finished(0)
    assert router.loads[0].in_flight == 0


def test_prefix_index_evicts_least_recently_used_and_forgets():
    index = PrefixIndex(capacity=3)
    a, b = chunk_keys(list(range(32)), 16), chunk_keys([9] * 32, 16)
    index.insert(a, 0)
    index.insert(b, 1)  # 4 keys: a's first is dropped
    assert len(index) == 3 and index.match(a) == {} and index.match(b) == {1: 2}
    index.forget(1)
    assert len(index) == 1 and index.match(b) == {}
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_bad_arguments():
    with pytest.raises(ValueError):
        Router(0)
    with pytest.raises(ValueError):
        Router(2, "random")


_ops = st.lists(st.one_of(
    st.tuples(st.just("choose"), st.integers(0, 5)),
    st.tuples(st.just("finished"), st.integers(0, 3)),
    st.tuples(st.just("report"), st.integers(0, 3), st.integers(0, 40), st.integers(0, 40), st.floats(0, 1)),
    st.tuples(st.just("down"), st.integers(0, 3)),
    st.tuples(st.just("up"), st.integers(0, 3)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(POLICIES), _ops)
def test_requests_go_only_to_healthy_replicas_and_in_flight_stays_counted(policy, ops):
    router = Router(4, policy)
    prompts = [chunk_keys([p] * 16 * (1 + p % 3), 16) for p in range(6)]
    sent = [0] * 4  # what the router should count: sent, minus finished, reset by mark_down
    for op in ops:
        if op[0] == "choose":
            healthy = router.healthy()
            if not healthy:
                with pytest.raises(LookupError):
                    router.choose(prompts[op[1]])
                continue
            r = router.choose(prompts[op[1]])
            assert r in healthy
            sent[r] += 1
        elif op[0] == "finished":
            router.finished(op[1])
            sent[op[1]] = max(0, sent[op[1]] - 1)
        elif op[0] == "report":
            router.report(*op[1:])
        elif op[0] == "down":
            router.mark_down(op[1])
            sent[op[1]] = 0
            assert all(owner != op[1] for owner in router.index._owner.values())
        else:
            router.mark_up(op[1])
        assert [load.in_flight for load in router.loads] == sent
        assert all(load.in_flight >= 0 for load in router.loads)
