"""De-duplication of a batch whose keys come straight from its body (SendDedup.plan_uniqs, Plan.settle_ids)
answers, stores and remembers exactly what the per-message way (split, settle) does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from chronomq.broker.dedup import Original, SendDedup
from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig


class _Store:
    """Keys the index holds, each with the message it finds."""

    def __init__(self, indexed: dict[str, int]) -> None:
        self.indexed = indexed

    def query_messages(self, topic: str, keys: list[str], max_num: int, begin_ts: int, end_ts: int
                       ) -> dict[str, list[Any]]:
        out = {}
        for k in keys:
            if k in self.indexed:
                m = type("M", (), {"uniq_key": k, "commit_log_offset": self.indexed[k], "queue_id": 3,
                                   "queue_offset": self.indexed[k] // 10, "properties": {}})()
                out[k] = [m]
        return out


class _Timer:
    def records_of(self, uniq: str) -> list[Any]:
        return []


def _dedup(tmp: Path, indexed: dict[str, int], recent_max: int) -> SendDedup:
    config, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp), "dedupWindowSec": "60"})
    d = SendDedup(_Store(indexed), _Timer(), config, VirtualClock(1_000_000),  # type: ignore[arg-type]
                  ("127.0.0.1", 10911))
    d.recent_max = recent_max  # small, so the memory's bound is reached (the configuration's least is 1000)
    return d


keys = st.sampled_from(["a", "b", "c", "d", "e", "f"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.none(), keys), min_size=1, max_size=10),
       st.dictionaries(keys, st.integers(0, 10_000), max_size=3), st.lists(keys, max_size=3),
       st.integers(1, 8))
def test_a_batch_planned_from_its_keys_is_settled_as_message_by_message(tmp_path_factory, asks, indexed,
                                                                        remembered, recent_max):
    tmp = tmp_path_factory.mktemp("d")
    one, two = _dedup(tmp, indexed, recent_max), _dedup(tmp, indexed, recent_max)
    for d in (one, two):
        for i, k in enumerate(remembered):
            d.remember(("T", k), Original(f"R{k}", 1, i))
    keys_ = [None if u is None else ("T", u) for u in asks]
    plan = one.plan_uniqs("T", asks)
    assert plan is not None and plan.keys == keys_
    repeats = two.split(keys_)
    assert plan.repeats == repeats
    n = sum(r is None for r in repeats)
    ids = [f"ID{i}" for i in range(n)]
    answer = plan.settle_ids(ids, 2, 100)
    answers = two.settle(keys_, repeats, [Original(ids[i], 2, 100 + i) for i in range(n)])
    assert answer == ",".join(a.offset_msg_id for a in answers)
    assert one.replays == two.replays
    assert list(one._recent) == list(two._recent)
    for k in one._recent:
        assert one.find(k) == two.find(k)
