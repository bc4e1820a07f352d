"""A refused put is answered with a PutResult by every public entry of the put path (put_message,
put_messages, put_records, prepare_records, put_prepared), never raised, and writes nothing."""

from __future__ import annotations

import pytest

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.message import MessageExt
from chronomq.store import MessageStore, PutResult, PutStatus, put


def msg(topic: str = "TopicA", qid: int = 0, **kw: object) -> MessageExt:
    return MessageExt(topic=topic, body=b"hello", queue_id=qid, **kw)


@pytest.fixture
def store(tmp_path):
    s = MessageStore(BrokerConfig(storePathRootDir=str(tmp_path), mappedFileSizeCommitLog=16 * 1024),
                     VirtualClock())
    s.start()
    yield s
    s.shutdown()


def _stored(store: MessageStore) -> bytes:
    r = store.put_message(msg(topic="Source"))
    raw = store.read_record(r.append.wrote_offset) if r.append is not None else None
    assert raw is not None
    return raw


def test_put_message_and_put_messages_answer_refusals(store):
    end = store.max_phy_offset
    bad_host = store.put_message(msg(born_host=("127.0.0.1", 1 << 40)))  # the port does not fit
    assert bad_host.status is PutStatus.MESSAGE_ILLEGAL and "born host" in bad_host.error
    assert store.put_messages([]).error == "an empty batch"
    mixed = store.put_messages([msg(qid=0), msg(qid=1)])
    assert mixed.status is PutStatus.MESSAGE_ILLEGAL and "one topic and one queue" in mixed.error
    second_bad = store.put_messages([msg(), msg(topic="bad topic")])
    assert second_bad.status is PutStatus.MESSAGE_ILLEGAL and "characters" in second_bad.error
    malformed = store.put_messages([msg(), MessageExt(topic="TopicA", body=b"x", queue_id="0")])
    assert malformed.status is PutStatus.MESSAGE_ILLEGAL and "malformed message" in malformed.error
    assert store.max_phy_offset == end and store.topics() == []


def test_prepare_records_and_put_prepared_answer_refusals(store):
    raw = _stored(store)
    end = store.max_phy_offset
    refused = store.prepare_records("bad topic", 0, [(raw, 0, len(raw), {})])
    assert isinstance(refused, PutResult) and refused.status is PutStatus.MESSAGE_ILLEGAL
    assert store.put_prepared("TopicA", 0, []).error == "an empty batch"
    entries = store.prepare_records("TopicA", 0, [(raw, 0, len(raw), {})] * 200)
    assert isinstance(entries, list) and len(entries) == 200
    too_big = store.put_prepared("TopicA", 0, entries)  # 200 records of ~100 bytes: more than a segment
    assert too_big.status is PutStatus.MESSAGE_ILLEGAL and "does not fit a commit-log" in too_big.error
    assert store.max_phy_offset == end
    assert store.put_prepared("TopicA", 0, entries[:2]).ok


def test_a_store_that_is_not_running_answers_every_entry(tmp_path):
    s = MessageStore(BrokerConfig(storePathRootDir=str(tmp_path)), VirtualClock())
    s.start()
    raw = _stored(s)
    entries = s.prepare_records("TopicA", 0, [(raw, 0, len(raw), {})])
    assert isinstance(entries, list)
    s.shutdown()
    records = [(raw, 0, len(raw), {})]
    for r in (s.put_message(msg()), s.put_messages([msg()]), s.put_records("TopicA", 0, records),
              s.put_prepared("TopicA", 0, entries)):
        assert r.status is PutStatus.SERVICE_NOT_AVAILABLE and r.error == "the message store is not running"


def test_the_put_paths_caches_make_a_missing_entry_and_stay_bounded(store):
    made: list[int] = []
    cache = put._Cache(lambda k: made.append(k) or k * 2, 2)
    assert (cache[1], cache[1], made) == (2, 2, [1])
    for k in (2, 3, 4):  # over the limit: it starts again empty
        assert cache[k] == 2 * k
    assert list(cache) == [4]
    for _ in range(2):  # a refused topic is not cached: it is checked again
        assert store.put_message(msg(topic="bad topic")).status is PutStatus.MESSAGE_ILLEGAL
    assert "bad topic" not in store._topic_cache and "TopicA" not in store._topic_cache
    assert store.put_message(msg()).ok and "TopicA" in store._topic_cache
