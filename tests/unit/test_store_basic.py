"""MessageStore facade: put/get, consume queues, index, dispatcher, flush futures, bad input."""

from __future__ import annotations

import threading

import pytest

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.message import (
    SCHEDULE_TOPIC,
    MessageExt,
    decode_record,
    decode_records,
    encode_record,
    tags_code,
)
from chronomq.store import GetStatus, MessageStore, PutStatus


def make_config(tmp_path, **kw) -> BrokerConfig:
    base = dict(storePathRootDir=str(tmp_path / "store"), mappedFileSizeCommitLog=16 * 1024,
                mappedFileSizeConsumeQueue=20 * 32, maxHashSlotNum=64, maxIndexNum=128,
                messageDelayLevel="1s 5s 10s")
    base.update(kw)
    return BrokerConfig(**base)


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
def store(tmp_path, clock):
    s = MessageStore(make_config(tmp_path), clock, ("10.0.0.7", 10911))
    s.start()
    yield s
    s.shutdown()


def msg(topic="TopicA", body=b"hello", qid=0, **props) -> MessageExt:
    return MessageExt(topic=topic, body=body, queue_id=qid, properties=dict(props),
                      born_timestamp=123, born_host=("192.168.1.2", 5555))


def test_put_then_get_returns_the_stored_record(store, clock):
    r = store.put_message(msg(body=b"abc", TAGS="t1", KEYS="k1 k2", UNIQ_KEY="U1"))
    assert r.ok and r.flushed is None
    a = r.append
    assert a.wrote_offset == 0 and a.queue_offset == 0 and a.store_timestamp == clock.now_ms()
    assert store.wait_dispatched(a.wrote_offset, 5)
    g = store.get_message("TopicA", 0, 0, 32)
    assert g.status is GetStatus.FOUND and g.next_begin_offset == 1 and g.max_offset == 1
    m = decode_record(g.messages[0], check_crc=True)
    assert (m.topic, m.body, m.queue_id, m.queue_offset, m.commit_log_offset) == ("TopicA", b"abc", 0, 0, 0)
    assert m.store_host == ("10.0.0.7", 10911) and m.born_host == ("192.168.1.2", 5555)
    assert m.properties == {"TAGS": "t1", "KEYS": "k1 k2", "UNIQ_KEY": "U1"}
    assert m.msg_id == a.msg_id
    assert store.read_record(0) == g.messages[0]
    assert store.look_message_by_offset(0).body == b"abc"
    [u] = store.get_cq_units("TopicA", 0, 0, 10)
    assert (u.queue_offset, u.commit_log_offset, u.size, u.tags_code) == (0, 0, m.store_size, tags_code("t1"))


def test_get_statuses(store):
    assert store.get_message("Nope", 0, 0, 1).status is GetStatus.NO_MATCHED_LOGIC_QUEUE
    for i in range(3):
        store.put_message(msg(body=bytes([i])))
    store.wait_dispatched(store.max_phy_offset, 5)
    assert store.get_message("TopicA", 0, 3, 1).status is GetStatus.OFFSET_OVERFLOW_ONE
    assert store.get_message("TopicA", 0, 9, 1).status is GetStatus.OFFSET_OVERFLOW_BADLY
    g = store.get_message("TopicA", 0, 1, 1)
    assert g.status is GetStatus.FOUND and g.next_begin_offset == 2
    assert decode_record(g.messages[0]).body == b"\x01"
    g = store.get_message("TopicA", 0, 0, 10, tag_filter=lambda tc: False)
    assert g.status is GetStatus.NO_MATCHED_MESSAGE and g.next_begin_offset == 3
    # max_bytes bounds a pull, but at least one message is returned
    g = store.get_message("TopicA", 0, 0, 10, max_bytes=1)
    assert g.message_count == 1


def test_tag_filter_uses_tags_code(store):
    for i in range(6):
        store.put_message(msg(body=bytes([i]), TAGS="a" if i % 2 else "b"))
    store.wait_dispatched(store.max_phy_offset, 5)
    want = tags_code("a")
    g = store.get_message("TopicA", 0, 0, 32, tag_filter=lambda tc: tc == want)
    assert [decode_record(b).body for b in g.messages] == [b"\x01", b"\x03", b"\x05"]


def test_segments_roll_without_splitting_records(store):
    body = b"z" * 3000
    offs = [store.put_message(msg(body=body, qid=i % 2)).append.wrote_offset for i in range(20)]
    seg = 16 * 1024
    for o in offs:
        assert o // seg == (o + 3000 + 91 + 6 - 1) // seg  # wholly inside one segment
    assert len(store._cl.segments) > 3
    msgs = list(store.iter_messages(0))
    assert [m.commit_log_offset for m in msgs] == offs
    store.wait_dispatched(store.max_phy_offset, 5)
    assert store.get_max_offset_in_queue("TopicA", 0) == 10
    got = store.get_message("TopicA", 1, 0, 32, max_bytes=1 << 20)
    assert [decode_record(b).commit_log_offset for b in got.messages] == offs[1::2]


def test_consume_queue_files_roll(store):
    # 32 units per CQ file: 100 entries use 4 files
    for i in range(100):
        store.put_message(msg(body=str(i).encode()))
    store.wait_dispatched(store.max_phy_offset, 5)
    units = store.get_cq_units("TopicA", 0, 0, 200)
    assert [u.queue_offset for u in units] == list(range(100))
    g = store.get_message("TopicA", 0, 30, 5)
    assert [decode_record(b).body for b in g.messages] == [b"30", b"31", b"32", b"33", b"34"]


def test_offset_by_time_and_earliest(store, clock):
    t0 = clock.now_ms()
    for i in range(10):
        store.put_message(msg(body=bytes([i])))
        clock.advance_sync(1000)
    store.wait_dispatched(store.max_phy_offset, 5)
    assert store.get_earliest_message_time("TopicA", 0) == t0
    assert store.get_offset_in_queue_by_time("TopicA", 0, t0 - 5) == 0
    assert store.get_offset_in_queue_by_time("TopicA", 0, t0 + 3000) == 3
    assert store.get_offset_in_queue_by_time("TopicA", 0, t0 + 3001) == 4
    assert store.get_offset_in_queue_by_time("TopicA", 0, t0 + 99_000) == 10
    assert store.get_earliest_message_time("Nope", 0) == -1


def test_query_by_key_and_uniq_key(store, clock):
    t0 = clock.now_ms()
    for i in range(300):  # 128 entries per index file: several files
        store.put_message(msg(body=str(i).encode(), KEYS=f"order-{i % 7} all", UNIQ_KEY=f"U{i}"))
        clock.advance_sync(10)
    store.put_message(msg(topic="Other", KEYS="all"))
    store.wait_dispatched(store.max_phy_offset, 5)
    got = store.query_message("TopicA", "order-3", 1000, 0, 2**62)
    assert [int(m.body) for m in got] == [i for i in range(300) if i % 7 == 3]
    assert [m.body for m in store.query_message("TopicA", "U42", 10, 0, 2**62)] == [b"42"]
    newest = store.query_message("TopicA", "all", 5, 0, 2**62)
    assert [int(m.body) for m in newest] == [295, 296, 297, 298, 299]
    window = store.query_message("TopicA", "all", 1000, t0 + 1000, t0 + 1990)
    assert [int(m.body) for m in window] == list(range(100, 200))
    assert store.query_message("TopicA", "missing", 10, 0, 2**62) == []
    assert len(store.query_message("Other", "all", 10, 0, 2**62)) == 1


def test_schedule_topic_tags_code_is_deliver_time(store, clock):
    r = store.put_message(msg(topic=SCHEDULE_TOPIC, qid=1, DELAY="2", REAL_TOPIC="TopicA", REAL_QID="0"))
    r9 = store.put_message(msg(topic=SCHEDULE_TOPIC, qid=2, DELAY="9"))
    store.wait_dispatched(store.max_phy_offset, 5)
    [u] = store.get_cq_units(SCHEDULE_TOPIC, 1, 0, 10)
    assert u.tags_code == r.append.store_timestamp + 5000
    [u9] = store.get_cq_units(SCHEDULE_TOPIC, 2, 0, 10)
    assert u9.tags_code == r9.append.store_timestamp + 10_000  # clamped to the last level


def test_batch_put_contiguous(store):
    msgs = [msg(body=bytes([i]), qid=3) for i in range(5)]
    r = store.put_messages(msgs)
    assert r.ok and r.append.msg_count == 5 and r.append.queue_offset == 0
    assert len(r.append.msg_id.split(",")) == 5
    store.wait_dispatched(store.max_phy_offset, 5)
    assert [u.queue_offset for u in store.get_cq_units("TopicA", 3, 0, 10)] == [0, 1, 2, 3, 4]
    bad = store.put_messages([msg(qid=1), msg(qid=2)])
    assert bad.status is PutStatus.MESSAGE_ILLEGAL


@pytest.mark.parametrize("m, status, words", [
    (msg(topic="bad topic"), PutStatus.MESSAGE_ILLEGAL, "characters"),
    (msg(topic="x" * 128), PutStatus.MESSAGE_ILLEGAL, "longer"),
    (msg(topic=""), PutStatus.MESSAGE_ILLEGAL, "empty"),
    (msg(body=b"x" * 5000), PutStatus.MESSAGE_ILLEGAL, "maxMessageSize"),
    (msg(big="v" * 40000), PutStatus.PROPERTIES_SIZE_EXCEEDED, "properties"),
    (msg(**{"k\x01": "v"}), PutStatus.MESSAGE_ILLEGAL, "separator"),
    (msg(qid=-1), PutStatus.MESSAGE_ILLEGAL, "queue id"),
])
def test_bad_input_writes_nothing(tmp_path, clock, m, status, words):
    s = MessageStore(make_config(tmp_path, maxMessageSize=4096), clock)
    s.start()
    try:
        r = s.put_message(m)
        assert r.status is status and words in r.error
        assert s.max_phy_offset == 0 and s.topics() == []
        assert s.put_message(msg()).ok  # the store still works
    finally:
        s.shutdown()


def test_record_larger_than_segment_is_rejected(tmp_path, clock):
    s = MessageStore(make_config(tmp_path, maxMessageSize=64 * 1024), clock)
    s.start()
    try:
        r = s.put_message(msg(body=b"x" * 20000))
        assert r.status is PutStatus.MESSAGE_ILLEGAL and "segment" in r.error
    finally:
        s.shutdown()


def test_put_after_shutdown_is_service_not_available(tmp_path, clock):
    s = MessageStore(make_config(tmp_path), clock)
    s.start()
    s.shutdown()
    assert s.put_message(msg()).status is PutStatus.SERVICE_NOT_AVAILABLE


def test_arrival_listener_sees_new_max_offset(store):
    seen = []
    ev = threading.Event()

    def listener(topic, qid, max_offset, ts):
        seen.append((topic, qid, max_offset))
        if max_offset == 3:
            ev.set()

    store.add_arrival_listener(listener)
    for _ in range(3):
        store.put_message(msg(qid=2))
    assert ev.wait(5)
    assert seen[-1] == ("TopicA", 2, 3)
    assert all(t == "TopicA" and q == 2 for t, q, _ in seen)


def test_sync_flush_group_commit(tmp_path, clock):
    cfg = make_config(tmp_path, flushDiskType="SYNC_FLUSH", mappedFileSizeCommitLog=1 << 20)
    s = MessageStore(cfg, clock)
    s.start()
    try:
        results = []
        lock = threading.Lock()

        def writer(k):
            for i in range(50):
                r = s.put_message_and_wait(msg(body=f"{k}-{i}".encode(), qid=k % 4))
                with lock:
                    results.append(r)

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(results) == 400 and all(r.ok for r in results)
        assert all(r.flushed.done() and r.flushed.result() for r in results)
        assert s._cl_flushed >= max(r.append.wrote_offset + r.append.wrote_bytes for r in results)
        nowait = s.put_message(msg(WAIT="false"))
        assert nowait.ok and nowait.flushed is None
    finally:
        s.shutdown()


def test_clean_restart_keeps_everything(tmp_path, clock):
    cfg = make_config(tmp_path)
    s = MessageStore(cfg, clock)
    s.start()
    for i in range(40):
        s.put_message(msg(body=b"b" * 700, qid=i % 3, KEYS=f"k{i}"))
    s.shutdown()
    s2 = MessageStore(cfg, clock)
    s2.start()
    try:
        assert not s2.recovered_abnormally
        assert [s2.get_max_offset_in_queue("TopicA", q) for q in range(3)] == [14, 13, 13]
        assert s2.query_message("TopicA", "k7", 5, 0, 2**62)[0].queue_offset == 2
        g = s2.get_message("TopicA", 1, 0, 32, max_bytes=1 << 20)
        assert [m.queue_offset for m in decode_records(b"".join(g.messages))] == list(range(13))
        r = s2.put_message(msg(qid=1))
        assert r.append.queue_offset == 13 and r.append.wrote_offset == s.max_phy_offset
    finally:
        s2.shutdown()


def test_store_times_never_go_backwards(store, clock):
    a = store.put_message(msg()).append.store_timestamp
    clock._now -= 5000  # a wall clock stepping back
    b = store.put_message(msg()).append.store_timestamp
    assert b >= a


def test_topics_and_queue_ids(store):
    store.put_message(msg(topic="T1", qid=2))
    store.put_message(msg(topic="T2", qid=0))
    store.put_message(msg(topic="T1", qid=0))
    store.wait_dispatched(store.max_phy_offset, 5)
    assert store.topics() == ["T1", "T2"] and store.queue_ids("T1") == [0, 2]


def test_sync_flush_put_prepared_without_its_own_flush_and_sync_commit_log(tmp_path, clock):
    """put_prepared(flush=False) asks the group commit for nothing (the timer's deliveries: nothing waits
    for them); sync_commit_log makes every written record durable, in either flush mode."""
    s = MessageStore(make_config(tmp_path, flushDiskType="SYNC_FLUSH", mappedFileSizeCommitLog=1 << 20),
                     clock)
    s.start()
    asked: list[int] = []
    real_request = s._request_flush
    s._request_flush = lambda end: (asked.append(end), real_request(end))[1]
    try:
        raw = _stored(msg(body=b"parked", UNIQ_KEY="P1"))
        entries = s.prepare_records("TopicB", 1, [(raw, 0, len(raw), {"UNIQ_KEY": "P1"})])
        quiet = s.put_prepared("TopicB", 1, entries, with_ids=False, flush=False)
        assert quiet.ok and quiet.flushed is None and asked == []
        end = quiet.append.wrote_offset + quiet.append.wrote_bytes
        waited = s.put_prepared("TopicB", 1, entries)
        assert waited.ok and asked == [end + waited.append.wrote_bytes]
        assert waited.flushed.result(timeout=10) is True
        assert s.sync_commit_log() == s.max_phy_offset and s._cl_flushed == s.max_phy_offset
    finally:
        s.shutdown()
    assert s.sync_commit_log() == s._cl_flushed  # stopped: nothing to do, nothing raised

    a = MessageStore(make_config(tmp_path / "async", mappedFileSizeCommitLog=1 << 20), clock)
    a.start()
    try:
        r = a.put_message(msg())
        assert r.flushed is None and a._cl_flushed < a.max_phy_offset  # the periodic flush is 500 ms away
        assert a.sync_commit_log() == a.max_phy_offset and a._cl_flushed == a.max_phy_offset
    finally:
        a.shutdown()


def test_sync_flush_timeout_resolves_false(tmp_path, clock):
    s = MessageStore(make_config(tmp_path, flushDiskType="SYNC_FLUSH", syncFlushTimeout=200), clock)
    s.start()
    release = threading.Event()
    real_flush = s._cl.flush

    def stuck_flush():
        release.wait(10)  # a disk that does not answer
        return real_flush()

    s._cl.flush = stuck_flush
    try:
        r = s.put_message_and_wait(msg())
        assert r.status is PutStatus.FLUSH_DISK_TIMEOUT and "syncFlushTimeout" in r.error
        assert r.flushed.done() and r.flushed.result() is False
        assert r.append is not None  # the message was stored; only the flush is late
    finally:
        release.set()
        s.shutdown()


def test_failed_dispatch_is_retried(store):
    calls = []
    real = store._index.put_batch

    def flaky(items):
        calls.append(len(items))
        if len(calls) == 1:
            raise OSError("no space left on device")
        return real(items)

    store._index.put_batch = flaky
    r = store.put_message(msg(KEYS="retry-me"))
    assert store.wait_dispatched(r.append.wrote_offset, 10)
    assert len(calls) >= 2
    assert store.get_max_offset_in_queue("TopicA", 0) == 1
    assert [m.body for m in store.query_message("TopicA", "retry-me", 5, 0, 2**62)] == [b"hello"]


def test_disk_full_is_a_clean_error_not_a_crash(store, monkeypatch):
    import errno

    import chronomq.store.mapped as mapped

    real_fallocate, real_pwrite = mapped.os.posix_fallocate, mapped.os.pwrite

    def full(fd, *_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    before = store.max_phy_offset
    # allocation writes zeros (new files) or fallocates (files that may hold data): both fail
    monkeypatch.setattr(mapped.os, "posix_fallocate", full)
    monkeypatch.setattr(mapped.os, "pwrite", full)
    big = b"f" * 3000
    results = [store.put_message(msg(body=big)) for _ in range(8)]  # crosses into a new segment
    failed = [r for r in results if not r.ok]
    assert failed and all(r.status is PutStatus.SERVICE_NOT_AVAILABLE and "space" in r.error for r in failed)
    monkeypatch.setattr(mapped.os, "posix_fallocate", real_fallocate)
    monkeypatch.setattr(mapped.os, "pwrite", real_pwrite)
    r = store.put_message(msg(body=b"after"))
    assert r.ok
    assert store.wait_dispatched(r.append.wrote_offset, 5)
    ok = [x for x in results if x.ok] + [r]
    assert store.get_max_offset_in_queue("TopicA", 0) == len(ok)
    assert [m.commit_log_offset for m in store.iter_messages(before)] == [x.append.wrote_offset for x in ok]


def test_changed_segment_size_is_refused_not_truncated(tmp_path, clock):
    from chronomq.store import StoreConfigError

    s = MessageStore(make_config(tmp_path), clock)
    s.start()
    s.put_message(msg(body=b"keep me"))
    s.shutdown()
    s2 = MessageStore(make_config(tmp_path, mappedFileSizeCommitLog=8 * 1024), clock)
    with pytest.raises(StoreConfigError, match="mappedFileSizeCommitLog"):
        s2.start()
    s3 = MessageStore(make_config(tmp_path), clock)
    s3.start()
    try:
        assert [m.body for m in s3.iter_messages(0)] == [b"keep me"]
    finally:
        s3.shutdown()


@pytest.mark.parametrize("bad", [
    MessageExt(topic="T", body="not bytes"),
    MessageExt(topic=5, body=b"x"),  # type: ignore[arg-type]
    MessageExt(topic="T", body=b"x", properties={"k": 5}),  # type: ignore[dict-item]
    MessageExt(topic="T", body=b"x", queue_id="0"),  # type: ignore[arg-type]
    MessageExt(topic="T", body=b"x", flag=2**40),
    MessageExt(topic="T", body=b"x", born_host=None),  # type: ignore[arg-type]
])
def test_malformed_message_objects_are_illegal_not_exceptions(store, bad):
    r = store.put_message(bad)
    assert r.status is PutStatus.MESSAGE_ILLEGAL and r.error
    assert store.put_messages([bad]).status is PutStatus.MESSAGE_ILLEGAL
    assert store.max_phy_offset == 0


def _stored(m: MessageExt) -> bytes:
    return bytes(encode_record(m))


def test_put_records_reputs_a_parked_record_to_its_real_queue(store, clock):
    parked = msg(topic=SCHEDULE_TOPIC, qid=1, body=b"payload", DELAY="2", REAL_TOPIC="TopicB",
                 REAL_QID="3", TAGS="t9", KEYS="k1 k2", UNIQ_KEY="U7")
    raw = _stored(parked)
    props = {"REAL_TOPIC": "TopicB", "REAL_QID": "3", "TAGS": "t9", "KEYS": "k1 k2", "UNIQ_KEY": "U7"}
    seen = []
    store.add_arrival_listener(lambda t, q, off, ts: seen.append((t, q, off)))
    r = store.put_records("TopicB", 3, [(b"junk" + raw, 4, len(raw), props), (raw, 0, len(raw), props)])
    assert r.ok and r.append.msg_count == 2 and r.append.queue_offset == 0
    assert r.append.msg_id.split(",") == [
        f"0A00000700002A9F{r.append.wrote_offset:016X}",
        f"0A00000700002A9F{r.append.wrote_offset + r.append.wrote_bytes // 2:016X}"]
    assert store.wait_dispatched(store.max_phy_offset, 5)
    units = store.get_cq_units("TopicB", 3, 0, 10)
    assert [(u.queue_offset, u.tags_code) for u in units] == [(0, tags_code("t9")), (1, tags_code("t9"))]
    m = decode_record(store.read_record(units[1].commit_log_offset), check_crc=True)
    assert (m.topic, m.queue_id, m.body, m.properties, m.born_host, m.store_host, m.store_timestamp) == (
        "TopicB", 3, b"payload", props, ("192.168.1.2", 5555), ("10.0.0.7", 10911), clock.now_ms())
    assert [x.queue_offset for x in store.query_message("TopicB", "k2", 10, 0, 2**62)] == [0, 1]
    assert [x.queue_offset for x in store.query_message("TopicB", "U7", 10, 0, 2**62)] == [0, 1]
    deadline = threading.Event()
    for _ in range(500):
        if ("TopicB", 3, 2) in seen:
            break
        deadline.wait(0.01)
    assert ("TopicB", 3, 2) in seen
    # to the schedule topic: tagsCode is the deliver time, as for put_message
    r2 = store.put_records(SCHEDULE_TOPIC, 2, [(raw, 0, len(raw), {"DELAY": "3"})])
    assert r2.ok and store.wait_dispatched(store.max_phy_offset, 5)
    [u] = store.get_cq_units(SCHEDULE_TOPIC, 2, 0, 10)
    assert u.tags_code == r2.append.store_timestamp + 10_000


def test_put_records_sync_flush_future(tmp_path, clock):
    s = MessageStore(make_config(tmp_path, flushDiskType="SYNC_FLUSH"), clock)
    s.start()
    try:
        raw = _stored(msg())
        r = s.put_records("TopicA", 0, [(raw, 0, len(raw), {})])
        assert r.ok and r.flushed is not None and r.flushed.result(10) is True
    finally:
        s.shutdown()


@pytest.mark.parametrize("args, status, words", [
    (("TopicA", 0, []), PutStatus.MESSAGE_ILLEGAL, "empty"),
    (("bad topic", 0, None), PutStatus.MESSAGE_ILLEGAL, "characters"),
    (("TopicA", -1, None), PutStatus.MESSAGE_ILLEGAL, "queue id"),
    (("TopicA", 0, [(b"\x00" * 200, 0, 200, {})]), PutStatus.MESSAGE_ILLEGAL, "not a stored record"),
    (("TopicA", 0, "short"), PutStatus.MESSAGE_ILLEGAL, "not a stored record"),
    (("TopicA", 0, "size"), PutStatus.MESSAGE_ILLEGAL, "not a stored record"),
    (("TopicA", 0, "body"), PutStatus.MESSAGE_ILLEGAL, "maxMessageSize"),
    (("TopicA", 0, {"k\x01": "v"}), PutStatus.MESSAGE_ILLEGAL, "separator"),
    (("TopicA", 0, {"big": "v" * 40000}), PutStatus.PROPERTIES_SIZE_EXCEEDED, "properties"),
])
def test_put_records_bad_input_writes_nothing(tmp_path, clock, args, status, words):
    s = MessageStore(make_config(tmp_path, maxMessageSize=4096), clock)
    s.start()
    try:
        topic, qid, recs = args
        raw = _stored(msg())
        if recs is None:
            recs = [(raw, 0, len(raw), {})]
        elif recs == "short":
            recs = [(raw, 0, len(raw) + 1, {})]
        elif recs == "size":
            recs = [(raw + b"\x00", 0, len(raw) + 1, {})]
        elif recs == "body":
            big = _stored(msg(body=b"x" * 5000))
            recs = [(raw, 0, len(raw), {}), (big, 0, len(big), {})]
        elif isinstance(recs, dict):
            recs = [(raw, 0, len(raw), {}), (raw, 0, len(raw), recs)]
        r = s.put_records(topic, qid, recs)
        assert r.status is status and words in r.error
        assert s.max_phy_offset == 0 and s.topics() == []
        assert s.put_records("TopicA", 0, [(raw, 0, len(raw), {})]).ok  # the store still works
    finally:
        s.shutdown()


def test_put_records_concurrent_with_the_dispatcher_loses_no_queue_entry(store):
    """Writers in several threads while the dispatcher takes batches: every record gets its queue
    entry, in queue order (a writer must append its dispatch requests to the list the dispatcher has
    not taken yet)."""
    raw = _stored(msg(body=b"r" * 20))
    entries = [(raw, 0, len(raw), {"UNIQ_KEY": "u"})] * 4
    errors = []

    def writer(qid: int) -> None:
        for _ in range(150):
            r = store.put_records("Conc", qid, entries)
            if not r.ok:
                errors.append(r.error)

    threads = [threading.Thread(target=writer, args=(q,)) for q in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.wait_dispatched(store.max_phy_offset, 10)
    for q in range(3):
        units = store.get_cq_units("Conc", q, 0, 1000)
        assert [u.queue_offset for u in units] == list(range(600))
        assert all(u.size == len(raw) - len("TopicA") + len("Conc") + len("UNIQ_KEY\x01u\x02") for u in units)
