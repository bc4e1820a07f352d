"""Property tests: any legal message round-trips through the store byte for byte, and queue lookups
(by offset and by time) agree with a model, whatever the segment sizes."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.message import MessageExt, decode_record, decode_records, encode_record, tags_code
from chronomq.store import MessageStore

SETTINGS = settings(max_examples=15, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

topic_st = st.text(alphabet="abcXYZ019_-%|", min_size=1, max_size=20)
prop_text = st.text(alphabet=st.characters(blacklist_characters="\x00\x01\x02",
                                           blacklist_categories=("Cs",)), max_size=12)
message_st = st.builds(
    MessageExt,
    topic=topic_st,
    body=st.binary(max_size=1500),
    properties=st.dictionaries(prop_text.filter(bool), prop_text, max_size=5),
    flag=st.integers(-(2**31), 2**31 - 1),
    queue_id=st.integers(0, 7),
    sys_flag=st.sampled_from([0, 1, 2, 4, 8, 12]),
    born_timestamp=st.integers(0, 2**62),
    born_host=st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 65535)),
    reconsume_times=st.integers(0, 1000),
    prepared_transaction_offset=st.integers(0, 2**40),
)


@SETTINGS
@given(msgs=st.lists(message_st, min_size=1, max_size=25), seg_kib=st.sampled_from([4, 8, 64]))
def test_records_round_trip_through_the_store(tmp_path_factory, msgs, seg_kib):
    root = tmp_path_factory.mktemp("rt")
    clock = VirtualClock()
    cfg = BrokerConfig(storePathRootDir=str(root), mappedFileSizeCommitLog=seg_kib * 1024,
                       mappedFileSizeConsumeQueue=20 * 4, maxHashSlotNum=8, maxIndexNum=32)
    s = MessageStore(cfg, clock, ("10.1.2.3", 10911))
    s.start()
    try:
        results = []
        for m in msgs:
            clock.advance_sync(7)
            snapshot = (m.topic, bytes(m.body), dict(m.properties), m.flag, m.queue_id, m.sys_flag,
                        m.born_timestamp, m.born_host, m.reconsume_times, m.prepared_transaction_offset)
            r = s.put_message(m)
            assert r.ok, r.error
            results.append((r, snapshot))
        assert s.wait_dispatched(s.max_phy_offset, 10)
        per_queue: dict[tuple[str, int], list] = {}
        for r, snap in results:
            a = r.append
            rec = decode_record(s.read_record(a.wrote_offset), check_crc=True)
            assert (rec.topic, rec.body, rec.properties, rec.flag, rec.queue_id, rec.sys_flag,
                    rec.born_timestamp, rec.born_host, rec.reconsume_times,
                    rec.prepared_transaction_offset) == snap
            assert (rec.queue_offset, rec.commit_log_offset, rec.store_timestamp, rec.store_size) == (
                a.queue_offset, a.wrote_offset, a.store_timestamp, a.wrote_bytes)
            assert rec.store_host == ("10.1.2.3", 10911)
            # a record never spans two segments
            assert a.wrote_offset // cfg.mappedFileSizeCommitLog == (
                a.wrote_offset + a.wrote_bytes - 1) // cfg.mappedFileSizeCommitLog
            per_queue.setdefault((rec.topic, rec.queue_id), []).append((a, snap))
        for (topic, qid), items in per_queue.items():
            assert s.get_max_offset_in_queue(topic, qid) == len(items)
            units = s.get_cq_units(topic, qid, 0, 1000)
            assert [(u.queue_offset, u.commit_log_offset, u.size) for u in units] == [
                (i, a.wrote_offset, a.wrote_bytes) for i, (a, _) in enumerate(items)]
            for u, (_, snap) in zip(units, items, strict=True):
                if topic != "SCHEDULE_TOPIC_XXXX":
                    assert u.tags_code == tags_code(snap[2].get("TAGS"))
            g = s.get_message(topic, qid, 0, 1000, max_bytes=1 << 30)
            assert [r.commit_log_offset for r in decode_records(b"".join(g.messages))] == [
                a.wrote_offset for a, _ in items]
            # by-time lookup agrees with a linear scan
            for a, _ in items:
                want = next(i for i, (b, _) in enumerate(items) if b.store_timestamp >= a.store_timestamp)
                assert s.get_offset_in_queue_by_time(topic, qid, a.store_timestamp) == want
        in_log = [m.commit_log_offset for m in s.iter_messages(0)]
        assert in_log == [r.append.wrote_offset for r, _ in results]
    finally:
        s.shutdown()


key_word = st.sampled_from(["a", "b", "order-1", "order-2", "x" * 30, "zz"])


@SETTINGS
@given(entries=st.lists(st.tuples(st.sampled_from(["T1", "T2"]), st.lists(key_word, max_size=3),
                                  st.integers(0, 5000)), min_size=1, max_size=60),
       probe=key_word, window=st.tuples(st.integers(0, 200_000), st.integers(0, 200_000)),
       limit=st.integers(1, 80))
def test_index_queries_match_a_model(tmp_path_factory, entries, probe, window, limit):
    root = tmp_path_factory.mktemp("idx")
    clock = VirtualClock()
    cfg = BrokerConfig(storePathRootDir=str(root), mappedFileSizeCommitLog=64 * 1024,
                       maxHashSlotNum=4, maxIndexNum=16)  # tiny: collisions and many index files
    s = MessageStore(cfg, clock)
    s.start()
    try:
        model = []
        for i, (topic, keys, gap) in enumerate(entries):
            clock.advance_sync(gap)
            props = {"UNIQ_KEY": f"U{i}"}
            if keys:
                props["KEYS"] = " ".join(keys)
            r = s.put_message(MessageExt(topic=topic, body=str(i).encode(), properties=props))
            model.append((topic, set(keys), f"U{i}", r.append.store_timestamp, r.append.wrote_offset))
        assert s.wait_dispatched(s.max_phy_offset, 10)
        lo, hi = sorted(window)
        lo += model[0][3]
        hi += model[0][3]
        for topic in ("T1", "T2"):
            want = [m[4] for m in model if m[0] == topic and probe in m[1] and lo <= m[3] <= hi]
            got = [m.commit_log_offset for m in s.query_message(topic, probe, limit, lo, hi)]
            assert got == want[-limit:]  # the newest ``limit``, in log order
        j = len(model) // 2
        hit = s.query_message(model[j][0], model[j][2], 5, 0, 2**62)
        assert [m.commit_log_offset for m in hit] == [model[j][4]]
    finally:
        s.shutdown()


# --- put_records: a stored record re-put without decode + re-encode ---------------------------------------
new_topic_st = st.one_of(topic_st, st.just("SCHEDULE_TOPIC_XXXX"))
new_props_st = st.dictionaries(
    st.one_of(prop_text.filter(bool), st.sampled_from(["TAGS", "KEYS", "UNIQ_KEY", "DELAY", "WAIT"])),
    st.one_of(prop_text, st.sampled_from(["a b", " k1  k2 ", "2", "false"])), max_size=5)


def _reput_store(root, clock, sync: bool):
    cfg = BrokerConfig(storePathRootDir=str(root), mappedFileSizeCommitLog=16 * 1024,
                       mappedFileSizeConsumeQueue=20 * 4, maxHashSlotNum=8, maxIndexNum=64,
                       messageDelayLevel="1s 5s 10s", flushDiskType="SYNC_FLUSH" if sync else "ASYNC_FLUSH")
    s = MessageStore(cfg, clock, ("10.1.2.3", 10911))
    s.start()
    return s


@SETTINGS
@given(parked=st.lists(st.tuples(message_st, new_props_st), min_size=1, max_size=12),
       topic=new_topic_st, qid=st.integers(0, 5), lead=st.integers(0, 3), sync=st.booleans(),
       prefix=st.binary(max_size=40))
def test_put_records_stores_exactly_what_put_messages_stores(tmp_path_factory, parked, topic, qid, lead, sync,
                                                             prefix):
    """The spliced record is byte for byte the record put_messages stores for the decoded message with the
    new topic, queue and properties (prepared offset 0, as both delivery decoders set it): two fresh
    stores on one clock given the same puts agree on every byte, every queue entry (tagsCode, delay
    deliver time), every index hit and the flush future."""
    clock = VirtualClock()
    a = _reput_store(tmp_path_factory.mktemp("put_messages"), clock, sync)
    b = _reput_store(tmp_path_factory.mktemp("put_records"), clock, sync)
    try:
        for k in range(lead):  # other queues first: offsets that are not 0
            for s in (a, b):
                assert s.put_message(MessageExt(topic="Lead", body=b"x" * k, queue_id=k)).ok
        raws = [bytes(encode_record(m)) for m, _ in parked]
        buf = prefix + b"".join(raws)  # the records inside a larger read, as the timer holds them
        entries = []
        pos = len(prefix)
        msgs = []
        for (_m, props), raw in zip(parked, raws, strict=True):
            entries.append((buf, pos, len(raw), props))
            pos += len(raw)
            d = decode_record(raw)
            d.topic, d.queue_id, d.properties, d.prepared_transaction_offset = topic, qid, dict(props), 0
            msgs.append(d)
        before = [dict(e[3]) for e in entries]
        clock.advance_sync(11)
        ra = a.put_messages(msgs)
        rb = b.put_records(topic, qid, entries)
        assert [e[3] for e in entries] == before  # the caller's dicts are not touched
        assert ra.status == rb.status
        if not ra.ok:
            assert ra.status.value in ("MESSAGE_ILLEGAL", "PROPERTIES_SIZE_EXCEEDED")
            assert a.max_phy_offset == b.max_phy_offset
            return
        assert ra.append == rb.append
        assert (ra.flushed is None) == (rb.flushed is None) == (not sync)
        if sync:
            assert ra.flushed.result(10) and rb.flushed.result(10)
        assert a.max_phy_offset == b.max_phy_offset
        assert a.wait_dispatched(a.max_phy_offset, 10) and b.wait_dispatched(b.max_phy_offset, 10)
        off = ra.append.wrote_offset
        for _ in msgs:
            rec_a, rec_b = a.read_record(off), b.read_record(off)
            assert rec_a == rec_b
            decode_record(rec_b, check_crc=True)
            off += len(rec_b)
        ua = a.get_cq_units(topic, qid, 0, 100)
        assert ua == b.get_cq_units(topic, qid, 0, 100) and len(ua) == len(msgs)
        for m in msgs:
            for key in {*m.keys, *([m.uniq_key] if m.uniq_key else [])}:
                assert a.query_message(topic, key, 50, 0, 2**62) == b.query_message(topic, key, 50, 0, 2**62)
    finally:
        a.shutdown()
        b.shutdown()
