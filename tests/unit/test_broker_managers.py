"""The broker's bookkeeping pieces in isolation: topic config (auto-creation rules, persistence), consumer
offsets (atomic persistence), client managers, queue locks, the tag filter and the CLI helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.conftest import wait_for

from chronomq.broker.clients import (
    ClientInfo,
    ConsumerManager,
    ProducerManager,
    QueueLockManager,
    message_model_is_clustering,
)
from chronomq.broker.offsets import ConsumerOffsetManager
from chronomq.broker.processors.pull import TagFilter
from chronomq.broker.topics import TopicConfig, TopicConfigManager, TopicError
from chronomq.cli.admin import delay_stats_table
from chronomq.cli.main import _parse_sets
from chronomq.config import ConfigError
from chronomq.message import java_string_hash


def _topics(tmp_path: Path, auto: bool = True, nums: int = 4) -> TopicConfigManager:
    return TopicConfigManager(tmp_path / "config", nums, auto, 18, lambda: 1000)


def test_topic_auto_creation_rules(tmp_path: Path) -> None:
    t = _topics(tmp_path, nums=8)
    assert t.get("TBW102").perm == 7 and t.get("SCHEDULE_TOPIC_XXXX").readQueueNums == 18  # type: ignore[union-attr]
    tc = t.create_in_send("A", "TBW102", 4)
    assert tc is not None and (tc.readQueueNums, tc.writeQueueNums, tc.perm) == (4, 4, 6)
    tc = t.create_in_send("B", "TBW102", 64)  # capped by the default topic's write queues
    assert tc is not None and tc.writeQueueNums == 8
    assert t.create_in_send("C", "NoSuchDefault", 4) is None
    # a producer resending to a retry topic that does not exist yet: created from the default topic, as
    # RocketMQ's msgCheck does first (its queue comes from the default topic's route)
    retry = t.create_in_send("%RETRY%g", "TBW102", 4)
    assert retry is not None and retry.writeQueueNums == 4
    with pytest.raises(TopicError):
        t.update(TopicConfig("bad name"))
    changed: list[str] = []
    t.on_change.append(lambda c: changed.append(c.topicName))
    t.create_system("%DLQ%g", 1)
    t.create_system("%DLQ%g", 1)
    assert changed == ["%DLQ%g"]  # once
    counter = t.data_version["counter"]
    # persisted in the background: a new manager then reads the same table
    path = tmp_path / "config" / "topics.json"
    wait_for(
        lambda: path.exists() and json.loads(path.read_text())["dataVersion"]["counter"] == counter,
        message="topics.json written",
    )
    t2 = _topics(tmp_path, nums=8)
    assert t2.get("A") == t.get("A") and t2.data_version["counter"] == counter


def test_no_auto_creation_when_disabled(tmp_path: Path) -> None:
    t = _topics(tmp_path, auto=False)
    assert t.get("TBW102").perm == 6  # type: ignore[union-attr]  # no INHERIT
    assert t.create_in_send("A", "TBW102", 4) is None
    retry = t.create_in_send("%RETRY%g", "TBW102", 4)  # retry topics still are, with one queue
    assert retry is not None and retry.writeQueueNums == 1


def test_corrupt_topics_file_is_reported_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "topics.json").write_text("{broken")
    t = _topics(tmp_path)
    assert t.get("TBW102") is not None
    assert any("topics.json" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "config" / "topics.json.corrupt").read_text() == "{broken"  # kept for a human


def test_offsets_persist_atomically_and_only_when_changed(tmp_path: Path) -> None:
    o = ConsumerOffsetManager(tmp_path)
    assert o.query("g", "t", 0) == -1
    assert not o.persist()  # nothing changed
    o.commit("g", "t", 0, 5)
    o.commit("g", "t", 3, 7)
    assert o.persist() and not o.persist()
    assert json.loads((tmp_path / "consumerOffset.json").read_text()) == {
        "offsetTable": {"t@g": {"0": 5, "3": 7}}
    }
    assert not list(tmp_path.glob("*.tmp"))
    o.commit("g", "t", 0, 5)  # same value: no new version
    assert not o.persist()
    assert ConsumerOffsetManager(tmp_path).query("g", "t", 3) == 7
    assert o.groups_of_topic("t") == ["g"]


def test_consumer_manager_register_expire_and_drop() -> None:
    m = ConsumerManager(expire_ms=100)
    data = {
        "consumeType": "CONSUME_PASSIVELY",
        "messageModel": "CLUSTERING",
        "subscriptionDataSet": [{"topic": "T", "subString": "a"}],
    }
    assert m.register("g", ClientInfo("c1", None, 0), data)
    assert not m.register("g", ClientInfo("c1", None, 50), data)  # a refresh is not a change
    assert m.register("g", ClientInfo("c2", None, 50), data)
    assert m.client_ids("g") == ["c1", "c2"] and m.groups_subscribing("T") == ["g"]
    assert m.expire(120) == []
    assert m.expire(151) == ["g"] and m.client_ids("g") == []
    p = ProducerManager(expire_ms=100)
    p.register("pg", ClientInfo("p1", None, 0))
    p.expire(101)
    assert p.groups == {}
    assert message_model_is_clustering(1) and not message_model_is_clustering(0)
    assert message_model_is_clustering("CLUSTERING") and not message_model_is_clustering("BROADCASTING")


def test_queue_locks() -> None:
    locks = QueueLockManager(expire_ms=60_000)
    mqs = [("T", "b", 0), ("T", "b", 1)]
    assert locks.try_lock("g", mqs, "A", 0) == mqs
    assert locks.try_lock("g", mqs, "B", 1000) == []
    assert locks.try_lock("other-group", mqs, "B", 1000) == mqs
    assert locks.try_lock("g", mqs[:1], "A", 30_000) == mqs[:1]  # renewal
    assert locks.try_lock("g", mqs, "B", 61_000) == mqs[1:]  # queue 1 expired, queue 0 renewed
    locks.unlock("g", mqs, "A")
    assert locks.try_lock("g", mqs, "B", 61_001) == mqs
    assert locks.is_locked_by("g", "T", "b", 0, "B", 61_002)


def test_tag_filter() -> None:
    assert TagFilter("*").predicate() is None and TagFilter("").predicate() is None
    pred = TagFilter(" a || b ||  ").predicate()
    assert pred is not None and pred(java_string_hash("a")) and pred(java_string_hash("b"))
    assert not pred(java_string_hash("c")) and not pred(0)


def test_cli_set_parsing_and_delay_table() -> None:
    assert _parse_sets(["a=1", 'messageDelayLevel="1s 2s"', "b = x=y"]) == {
        "a": "1",
        "messageDelayLevel": "1s 2s",
        "b": "x=y",
    }
    with pytest.raises(ConfigError):
        _parse_sets(["novalue"])
    table = delay_stats_table(
        {
            "levels": [
                {
                    "level": 1,
                    "delay_ms": 1000,
                    "pending": 3,
                    "oldest_pending_deliver_ms": 1700000000000,
                    "delivered": 9,
                    "lateness_ms": {"count": 9, "p50": 1, "p99": 4, "max": 5},
                }
            ],
            "early_deliveries": 0,
        }
    )
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["level", "delay", "pending"]
    assert lines[1].split()[:3] == ["1", "1s", "3"] and "early_deliveries=0" in lines[-1]
