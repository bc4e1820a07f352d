"""chronomq.levels: a parked message's level delay and its queue entry's tagsCode; the store's put paths
(put_message, put_messages, put_records) and its read-back of a stored record (recovery, a replica) give
the same tagsCode."""

from __future__ import annotations

import pytest

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.levels import level_delay_ms, parked_delay_ms, queue_tags_code, stored_tags_code
from chronomq.message import SCHEDULE_TOPIC, MessageExt, decode_record, tags_code
from chronomq.store import MessageStore
from chronomq.store.reput import request_of

LEVELS = [1000, 5000, 10_000]


@pytest.mark.parametrize("text, delay", [
    (None, 1000), ("", 1000), ("1", 1000), ("2", 5000), ("3", 10_000), ("99", 10_000), ("0", 1000),
    ("-4", 1000), ("abc", 1000), (" 2 ", 5000), ("2.5", 1000)])
def test_a_level_is_clamped_to_the_table_and_defaults_to_the_first(text: str | None, delay: int) -> None:
    assert level_delay_ms(LEVELS, text) == delay


def test_only_a_record_under_the_schedule_topic_is_parked() -> None:
    assert parked_delay_ms("TopicA", {"DELAY": "2"}, LEVELS) is None
    assert parked_delay_ms(SCHEDULE_TOPIC, {"DELAY": "2"}, LEVELS) == 5000
    assert parked_delay_ms(SCHEDULE_TOPIC, {}, LEVELS) == 1000
    assert parked_delay_ms(SCHEDULE_TOPIC, None, LEVELS) == 1000


def test_the_tags_code_is_the_deliver_time_of_a_parked_record_else_the_tags_hash() -> None:
    assert queue_tags_code(77, None, 1000) == 77
    assert queue_tags_code(77, 5000, 1000) == 6000
    assert stored_tags_code("TopicA", {"TAGS": "a", "DELAY": "2"}, LEVELS, 5) == tags_code("a") != 0
    assert stored_tags_code("TopicA", {}, LEVELS, 5) == 0
    assert stored_tags_code(SCHEDULE_TOPIC, {"DELAY": "3", "TAGS": "a"}, LEVELS, 5) == 10_005


@pytest.mark.parametrize("props", [{}, {"DELAY": "2"}, {"DELAY": "9"}, {"DELAY": "x"},
                                   {"DELAY": "0", "TAGS": "t"}, {"TAGS": "t"}])
@pytest.mark.parametrize("topic", [SCHEDULE_TOPIC, "TopicA"])
def test_every_put_path_and_the_read_back_give_the_rules_tags_code(tmp_path, topic: str,
                                                                    props: dict[str, str]) -> None:
    cfg = BrokerConfig(storePathRootDir=str(tmp_path), mappedFileSizeCommitLog=64 * 1024,
                       messageDelayLevel="1s 5s 10s")
    store = MessageStore(cfg, VirtualClock())
    store.start()
    try:
        one = store.put_message(MessageExt(topic=topic, body=b"x", queue_id=0, properties=dict(props)))
        batch = store.put_messages([MessageExt(topic=topic, body=b"y", queue_id=1, properties=dict(props))])
        raw = store.read_record(one.append.wrote_offset)
        assert raw is not None
        again = store.put_records(topic, 2, [(raw, 0, len(raw), dict(props))])
        assert one.ok and batch.ok and again.ok
        assert store.wait_dispatched(store.max_phy_offset, 5)
        for qid, r in enumerate((one, batch, again)):
            [unit] = store.get_cq_units(topic, qid, 0, 10)
            assert r.append is not None
            want = stored_tags_code(topic, props, LEVELS, r.append.store_timestamp)
            assert unit.tags_code == want
            rec = store.read_record(unit.commit_log_offset)
            assert rec is not None
            read_back = request_of(unit.commit_log_offset, decode_record(rec), LEVELS)
            assert (read_back.tags_code, read_back.queue_id, read_back.size) == (want, qid, unit.size)
    finally:
        store.shutdown()
