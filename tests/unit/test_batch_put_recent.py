"""The memory of recent keys (dedup.RecentKeys) holds, orders and forgets exactly what an OrderedDict of
(topic, UNIQ_KEY) -> Original with move-to-end and oldest-first eviction does; a batch put's answer text
is settled without being split, to the same answer and memory as its ids one by one."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from tests.unit.test_batch_put_dedup import _dedup

from chronomq.broker.dedup import Kept, Original, RecentKeys

TOPICS = ("T", "U")
UNIQS = ("a", "b", "c", "d", "e", "f")

_add = st.tuples(st.just("add"), st.sampled_from(TOPICS), st.lists(st.sampled_from(UNIQS), unique=True,
                                                                     min_size=1, max_size=5))
_one = st.tuples(st.just("one"), st.sampled_from(TOPICS), st.sampled_from(UNIQS))
_forget = st.tuples(st.just("forget"), st.sampled_from(TOPICS), st.sampled_from(UNIQS))
_limit = st.tuples(st.just("limit"), st.integers(1, 8), st.just(""))


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 8), st.lists(st.one_of(_add, _one, _forget, _limit), max_size=40))
def test_the_memory_is_an_ordered_dict_with_move_to_end_and_oldest_first_eviction(limit: int,
                                                                                   ops: list[Any]) -> None:
    recent = RecentKeys(limit, compact_at=2)  # stale places compacted away often
    model: OrderedDict[tuple[str, str], Original] = OrderedDict()
    for step, (op, a, b) in enumerate(ops):
        if op == "add":  # a batch: ids and consecutive offsets
            ids = [f"ID{step}.{i}" for i in range(len(b))]
            answer = ",".join(ids) if step % 2 else ids  # the put's answer text, or its ids
            recent.add(Kept(a, b, step, answer, 2, range(100 * step, 100 * step + len(b))))
            for i, u in enumerate(b):
                model.pop((a, u), None)
                model[(a, u)] = Original(ids[i], 2, 100 * step + i)
        elif op == "one":  # one send, remembered with its Original
            o = Original(f"ONE{step}", 1, step)
            recent.add(Kept(a, (b,), step, original=o))
            model.pop((a, b), None)
            model[(a, b)] = o
        elif op == "forget":
            if (a, b) in recent:
                recent.forget(a, b)
                del model[(a, b)]
            assert list(recent) == list(model)
            continue
        else:
            recent.limit = limit = a
            continue  # as before: the bound applies at the next remembering
        while len(model) > limit:
            model.popitem(last=False)
        assert list(recent) == list(model)
        assert len(recent) == len(model) and bool(recent) == bool(model)
        for t in TOPICS:
            held = recent.of_topic(t) or {}
            for u in UNIQS:
                assert ((t, u) in recent) == ((t, u) in model)
                if (t, u) in model:
                    assert held[u].original_of(u) == model[(t, u)]
    assert list(recent) == list(model)
    assert recent._stale <= max(len(recent), 2)


def test_a_forgotten_key_remembered_again_is_dropped_at_its_new_place() -> None:
    recent = RecentKeys(3)
    recent.add(Kept("T", ["a", "b"], 1, ["A1", "B1"], 0, range(0, 2)))
    recent.forget("T", "a")
    recent.add(Kept("T", ["a"], 2, ["A2"], 0, range(5, 6)))
    recent.add(Kept("T", ["c"], 3, ["C3"], 0, range(6, 7)))
    assert list(recent) == [("T", "b"), ("T", "a"), ("T", "c")]
    recent.add(Kept("T", ["d"], 4, ["D4"], 0, range(7, 8)))  # b goes, not the stale place of a
    assert list(recent) == [("T", "a"), ("T", "c"), ("T", "d")]
    held = recent.of_topic("T")
    assert held is not None and held["a"].original_of("a") == Original("A2", 0, 5)
    recent.add(Kept("U", ["x", "y", "z"], 5, "X,Y,Z", 1, range(0, 3)))  # the answer's text: split on a hit
    assert list(recent) == [("U", "x"), ("U", "y"), ("U", "z")] and recent.of_topic("T") is None
    u = recent.of_topic("U")
    assert u is not None and u["y"].original_of("y") == Original("Y", 1, 1)


def test_keys_forgotten_and_remembered_again_and_again_leave_no_trail() -> None:
    recent = RecentKeys(100, compact_at=8)
    recent.add(Kept("T", ["a", "b", "c", "d"], 0, "A,B,C,D", 0, range(4)))
    for i in range(1, 1_000):  # a key resent after the window, again and again: forgotten, then stored
        recent.forget("T", "a")
        recent.add(Kept("T", ["a"], i, [f"A{i}"], 0, range(i + 3, i + 4)))
        assert len(recent._order) <= 10 and recent._stale <= 8
    assert list(recent) == [("T", "b"), ("T", "c"), ("T", "d"), ("T", "a")]
    held = recent.of_topic("T")
    assert held is not None and held["c"].original_of("c") == Original("C", 0, 2)
    assert held["a"].original_of("a") == Original("A999", 0, 1002)




keys = st.sampled_from(["a", "b", "c", "d", "e", "f"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.one_of(st.none(), keys), min_size=1, max_size=8), min_size=1, max_size=4),
       st.dictionaries(keys, st.integers(0, 10_000), max_size=2), st.integers(1, 8))
def test_a_put_answer_settled_as_text_is_settled_as_its_ids(tmp_path_factory: Any,
                                                            batches: list[list[str | None]],
                                                            indexed: dict[str, int], recent_max: int) -> None:
    tmp = tmp_path_factory.mktemp("d")
    text, ids = _dedup(tmp, indexed, recent_max), _dedup(tmp, indexed, recent_max)
    offset = 0
    for asks in batches:
        p1, p2 = text.plan_uniqs("T", asks), ids.plan_uniqs("T", asks)
        assert p1 is not None and p2 is not None and p1.repeats == p2.repeats
        n = p1.repeats.count(None)
        stored = [f"ID{offset + i}" for i in range(n)]
        answer = ",".join(stored)
        got = p1.settle_text(answer, n, 2, offset)
        assert got == p2.settle_ids(stored, 2, offset)
        if n == len(asks) and None not in asks and len(set(asks)) == len(asks):
            assert got is answer  # the usual batch: its answer as the put gave it, never split
        offset += n
        assert text.replays == ids.replays
        assert list(text._recent) == list(ids._recent)
        for k in text._recent:
            assert text.find(k) == ids.find(k)
