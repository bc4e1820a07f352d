"""Pure parts of chronomq.delay: levels, prepare_put, the retry ladder / DLQ, histogram, offset file."""

from __future__ import annotations

import json
import random
import time

import pytest

from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig, ConfigError
from chronomq.delay import PROPERTY_DELAY_SOURCE, DelayLevels, DelayService, Histogram, restore_real
from chronomq.delay.delivery import (
    UndeliverableError,
    make_source,
    parse_source,
    restore_from_record,
    restore_props_from_record,
)
from chronomq.delay.histogram import bucket_index, bucket_upper
from chronomq.delay.offsets import OffsetFile, OffsetSnapshot
from chronomq.message import (
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_MAX_RECONSUME_TIMES,
    PROPERTY_ORIGIN_MESSAGE_ID,
    PROPERTY_REAL_QUEUE_ID,
    PROPERTY_REAL_TOPIC,
    PROPERTY_RETRY_TOPIC,
    PROPERTY_TAGS,
    PROPERTY_UNIQ_KEY,
    SCHEDULE_TOPIC,
    SYSFLAG_TRANSACTION_COMMIT_TYPE,
    SYSFLAG_TRANSACTION_PREPARED_TYPE,
    MessageExt,
    body_crc,
    create_offset_msg_id,
    encode_record,
)


def _svc(tmp_path, **over: str) -> DelayService:
    cfg, _ = BrokerConfig.load(overrides={"storePathRootDir": str(tmp_path), **over})
    return DelayService(store=None, config=cfg, clock=None)  # the pure methods touch neither


def _msg(topic: str = "TopicA", qid: int = 2, **props: str) -> MessageExt:
    return MessageExt(topic=topic, body=b"hello", properties=dict(props), queue_id=qid, flag=7,
                      sys_flag=0, born_timestamp=123, born_host=("10.0.0.1", 5555))


# --- levels ---
def test_default_levels_table():
    lv = DelayLevels.parse(BrokerConfig().messageDelayLevel)
    assert lv.max_level == 18
    assert [lv.delay_ms(n) for n in (1, 2, 3, 4, 5, 17, 18)] == [1000, 5000, 10000, 30000, 60000,
                                                                  3_600_000, 7_200_000]
    assert lv.clamp(0) == 0 and lv.clamp(-3) == 0 and lv.clamp(19) == 18 and lv.clamp(500) == 18
    assert lv.delay_ms(99) == 7_200_000


def test_levels_units_and_errors():
    assert DelayLevels.parse("250ms 2s 3m 1h 1d").delays_ms == (250, 2000, 180_000, 3_600_000, 86_400_000)
    for bad in ("", "5x", "1s -2s", "0s"):
        with pytest.raises(ConfigError):
            DelayLevels.parse(bad)


# --- prepare_put ---
def test_prepare_put_parks_delayed_message(tmp_path):
    svc = _svc(tmp_path)
    assert svc.schedule_topic_queue_nums == 18
    m = _msg(DELAY="3", TAGS="t")
    out = svc.prepare_put(m)
    assert out is m
    assert (m.topic, m.queue_id) == (SCHEDULE_TOPIC, 2)
    assert m.properties[PROPERTY_REAL_TOPIC] == "TopicA"
    assert m.properties[PROPERTY_REAL_QUEUE_ID] == "2"
    assert m.properties[PROPERTY_DELAY_TIME_LEVEL] == "3"
    assert m.properties[PROPERTY_TAGS] == "t"


def test_prepare_put_clamps_and_ignores(tmp_path):
    svc = _svc(tmp_path, messageDelayLevel="1s 2s 3s")
    m = svc.prepare_put(_msg(DELAY="40"))
    assert (m.topic, m.queue_id, m.properties[PROPERTY_DELAY_TIME_LEVEL]) == (SCHEDULE_TOPIC, 2, "3")
    for props in ({}, {"DELAY": "0"}, {"DELAY": "-1"}, {"DELAY": "abc"}):
        m = svc.prepare_put(_msg(**props))
        assert (m.topic, m.queue_id) == ("TopicA", 2)
        assert PROPERTY_REAL_TOPIC not in m.properties
    prepared = _msg(DELAY="2")
    prepared.sys_flag = SYSFLAG_TRANSACTION_PREPARED_TYPE
    assert svc.prepare_put(prepared).topic == "TopicA"
    committed = _msg(DELAY="2")
    committed.sys_flag = SYSFLAG_TRANSACTION_COMMIT_TYPE
    assert svc.prepare_put(committed).topic == SCHEDULE_TOPIC


def test_prepare_put_strips_forged_delivery_marker(tmp_path):
    svc = _svc(tmp_path)
    m = svc.prepare_put(_msg(**{PROPERTY_DELAY_SOURCE: "1:0:0"}))
    assert PROPERTY_DELAY_SOURCE not in m.properties


# --- restore (the delivery path's transformation) ---
def test_restore_real_round_trip(tmp_path):
    svc = _svc(tmp_path)
    parked = svc.prepare_put(_msg(DELAY="2", KEYS="k1", UNIQ_KEY="U1"))
    parked.reconsume_times = 4
    real = restore_real(parked, make_source(2, 17, 4096))
    assert (real.topic, real.queue_id) == ("TopicA", 2)
    assert real.properties[PROPERTY_DELAY_TIME_LEVEL] == "2"  # kept, as RocketMQ's messageTimeup stores it
    assert real.properties[PROPERTY_REAL_TOPIC] == "TopicA"
    assert real.properties[PROPERTY_UNIQ_KEY] == "U1"
    assert parse_source(real.properties[PROPERTY_DELAY_SOURCE]) == (2, 17, 4096)
    assert (real.body, real.flag, real.born_timestamp, real.born_host, real.reconsume_times) == (
        b"hello", 7, 123, ("10.0.0.1", 5555), 4)
    with pytest.raises(UndeliverableError):
        restore_real(_msg(), None)
    bad = _msg(REAL_TOPIC="TopicA", REAL_QID="x")
    with pytest.raises(UndeliverableError):
        restore_real(bad, None)
    # the hot path (raw record -> real message) gives the same message
    parked.store_timestamp, parked.commit_log_offset = 99, 4096
    raw = bytes(encode_record(parked))
    fast = restore_from_record(raw, make_source(2, 17, 4096))
    assert fast.body_crc == body_crc(b"hello")
    fast.body_crc = 0
    assert fast == real
    with pytest.raises(UndeliverableError):
        restore_from_record(raw[:-3], None)
    with pytest.raises(UndeliverableError):
        restore_from_record(bytes(encode_record(_msg(REAL_TOPIC="TopicA", REAL_QID="-1"))), None)
    with pytest.raises(UndeliverableError):
        restore_from_record(bytes(encode_record(_msg(REAL_TOPIC="bad topic!", REAL_QID="1"))), None)
    assert parse_source("1:2") is None and parse_source("a:b:c") is None and parse_source(None) is None
    # put_records path: the same decision (topic, queue, properties) without building the message
    assert restore_props_from_record(raw, make_source(2, 17, 4096)) == ("TopicA", 2, real.properties)
    assert PROPERTY_DELAY_SOURCE not in restore_props_from_record(
        bytes(encode_record(_msg(REAL_TOPIC="TopicA", REAL_QID="1", **{PROPERTY_DELAY_SOURCE: "x"}))),
        None)[2]
    for bad_raw in (raw[:-3], raw[:60], bytes(encode_record(_msg(REAL_TOPIC="TopicA", REAL_QID="-1"))),
                    bytes(encode_record(_msg(REAL_TOPIC="bad topic!", REAL_QID="1"))),
                    bytes(encode_record(_msg(REAL_QID="1")))):
        with pytest.raises(UndeliverableError):
            restore_props_from_record(bad_raw, None)


# --- send-back: retry ladder and DLQ ---
def _consumed(topic="TopicA", reconsume=0, offset=1000, **props) -> MessageExt:
    m = _msg(topic, 1, **{PROPERTY_UNIQ_KEY: "U1", **props})
    m.reconsume_times = reconsume
    m.commit_log_offset = offset
    m.store_host = ("127.0.0.1", 10911)
    return m


def test_send_back_first_retry(tmp_path):
    svc = _svc(tmp_path)
    first = _consumed(REAL_TOPIC="TopicA", REAL_QID="1", **{PROPERTY_DELAY_SOURCE: "1:2:3"})
    back = svc.build_send_back(first, "CG", 0, None)
    assert (back.topic, back.queue_id, back.reconsume_times) == ("%RETRY%CG", 0, 1)
    assert back.properties[PROPERTY_DELAY_TIME_LEVEL] == "3"
    assert back.properties[PROPERTY_RETRY_TOPIC] == "TopicA"
    assert back.properties[PROPERTY_ORIGIN_MESSAGE_ID] == create_offset_msg_id(("127.0.0.1", 10911), 1000)
    assert back.properties[PROPERTY_UNIQ_KEY] == "U1"
    assert PROPERTY_DELAY_SOURCE not in back.properties
    assert (back.body, back.flag, back.born_timestamp) == (b"hello", 7, 123)
    parked = svc.prepare_put(back)
    assert (parked.topic, parked.queue_id) == (SCHEDULE_TOPIC, 2)
    assert parked.properties[PROPERTY_REAL_TOPIC] == "%RETRY%CG"


def test_send_back_ladder_then_dlq(tmp_path):
    svc = _svc(tmp_path)
    origin = create_offset_msg_id(("127.0.0.1", 10911), 1000)
    msg = _consumed()
    levels = []
    for times in range(16):
        back = svc.build_send_back(msg, "CG", 0, None)
        assert back.topic == "%RETRY%CG", times
        levels.append(int(back.properties[PROPERTY_DELAY_TIME_LEVEL]))
        assert back.properties[PROPERTY_ORIGIN_MESSAGE_ID] == origin
        assert back.properties[PROPERTY_RETRY_TOPIC] == "TopicA"
        # the consumer receives the retry copy from %RETRY%CG at a new offset
        delivered = {k: v for k, v in back.properties.items() if k != PROPERTY_DELAY_TIME_LEVEL}
        msg = _consumed("%RETRY%CG", back.reconsume_times, 5000 + times, **delivered)
    assert levels == [3 + i for i in range(16)]  # 10 s, 30 s, 1 m, ... (19+ clamp to 18 on put)
    dead = svc.build_send_back(msg, "CG", 0, None)
    assert (dead.topic, dead.queue_id, dead.reconsume_times) == ("%DLQ%CG", 0, 17)
    assert dead.properties[PROPERTY_DELAY_TIME_LEVEL] == "0"  # RocketMQ's setDelayTimeLevel(0)
    assert svc.prepare_put(dead).topic == "%DLQ%CG"
    assert dead.properties[PROPERTY_ORIGIN_MESSAGE_ID] == origin


def test_send_back_limits(tmp_path):
    svc = _svc(tmp_path, maxReconsumeTimes="2")
    assert svc.build_send_back(_consumed(reconsume=1), "G", 0, None).topic == "%RETRY%G"
    assert svc.build_send_back(_consumed(reconsume=2), "G", 0, None).topic == "%DLQ%G"
    # a header value wins over the broker default, a per-message property over the default only
    assert svc.build_send_back(_consumed(reconsume=2), "G", 0, 5).topic == "%RETRY%G"
    assert svc.build_send_back(_consumed(reconsume=5), "G", 0, 5).topic == "%DLQ%G"
    prop = {PROPERTY_MAX_RECONSUME_TIMES: "4"}
    assert svc.build_send_back(_consumed(reconsume=3, **prop), "G", 0, None).topic == "%RETRY%G"
    assert svc.build_send_back(_consumed(reconsume=4, **prop), "G", 0, -1).topic == "%DLQ%G"
    assert svc.build_send_back(_consumed(reconsume=3, **prop), "G", 0, 3).topic == "%DLQ%G"
    # explicit level; negative level -> DLQ at once; max 0 -> DLQ at once
    assert svc.build_send_back(_consumed(), "G", 7, None).properties[PROPERTY_DELAY_TIME_LEVEL] == "7"
    assert svc.build_send_back(_consumed(), "G", -1, None).topic == "%DLQ%G"
    assert svc.build_send_back(_consumed(), "G", 0, 0).topic == "%DLQ%G"


# --- histogram ---
def test_histogram_buckets_are_monotone_and_tight():
    prev = -1
    for v in [*range(0, 5000), 10**6, 10**9, 2**62]:
        idx = bucket_index(v)
        assert idx >= prev
        prev = idx
        up = bucket_upper(idx)
        assert v <= up
        assert up - v <= max(0, v) // 16 + 1  # < 6.25 % relative error
        assert bucket_index(up) == idx
    assert bucket_index(2**62) < 1000


def test_histogram_percentiles_against_exact():
    rng = random.Random(4)
    values = [int(rng.expovariate(1 / 40)) for _ in range(20000)] + [0] * 500 + [123456]
    h = Histogram()
    for v in values:
        h.record(v)
    s = sorted(values)
    for p in (50, 90, 99):
        exact = s[-(-len(s) * p // 100) - 1]
        got = h.percentile(p)
        assert exact <= got <= exact + exact // 16 + 1, (p, exact, got)
    assert h.summary()["max"] == 123456 and h.summary()["count"] == len(values)
    assert h.buckets < 200
    empty = Histogram().summary()
    assert empty == {"count": 0, "p50": 0, "p99": 0, "max": 0}


# --- offset file ---
def test_offset_file_atomic_round_trip(tmp_path):
    f = OffsetFile(tmp_path)
    assert f.load() is None
    f.save(OffsetSnapshot({1: 5, 3: 9}, 4096, 77))
    assert f.path == tmp_path / "config" / "delayOffset.json"
    data = json.loads(f.path.read_text())
    assert data["offsetTable"] == {"1": 5, "3": 9}
    snap = f.load()
    assert (snap.offsets, snap.scan_from_phy, snap.saved_at_ms) == ({1: 5, 3: 9}, 4096, 77)
    f.save(OffsetSnapshot({1: 6}, 5000, 78))
    assert not f.path.with_suffix(".json.tmp").exists()
    # a torn/corrupt current file falls back to the previous snapshot (older, so never ahead of the truth)
    f.path.write_text('{"offsetTable": {"1": ')
    snap = f.load()
    assert snap is not None and snap.offsets == {1: 5, 3: 9}
    f.path.write_text('{"offsetTable": {"1": -4}}')
    f.path.with_suffix(".json.bak").write_text("garbage")
    with pytest.raises(ConfigError, match=r"delayOffset\.json\.bak"):  # both damaged: refuse, as RocketMQ
        f.load()


# --- the system clock the schedule service sleeps on ---
async def test_system_clock_never_wakes_before_the_deadline():
    clock = SystemClock()
    for step in (0, 1, 2, 3, 7, 15):
        deadline = clock.now_ms() + step
        await clock.sleep_until_ms(deadline)
        assert clock.now_ms() >= deadline
        assert time.time() * 1000 >= deadline


def test_histogram_merged() -> None:
    from chronomq.delay.histogram import Histogram

    a, b, empty = Histogram(), Histogram(), Histogram()
    for v in (5, 7, 40):
        a.record(v)
    for v in (3, 1000):
        b.record(v)
    m = Histogram.merged([a, empty, b])
    assert (m.count, m.total, m.min, m.max) == (5, 1055, 3, 1000)
    assert m.percentile(50) == 7 and m.percentile(100) == 1000
    assert Histogram.merged([]).count == 0


# --- admit: the one way in for sent messages (TIMER_* over DELAY) ---
def _admitting(tmp_path, now: int = 1_700_000_000_000) -> DelayService:
    from chronomq.clock import VirtualClock

    svc = _svc(tmp_path)
    svc.clock = VirtualClock(now)
    return svc


def test_admit_timer_wins_over_delay(tmp_path):
    svc = _admitting(tmp_path)
    now = svc.clock.now_ms()
    m = _msg(DELAY="3", TIMER_DELAY_MS="1500")
    a = svc.admit(m)
    assert a.timed == [(m, now + 1500)] and a.put == [] and a.refused is None
    assert "DELAY" not in m.properties and m.topic == "TopicA"
    past = _msg(DELAY="3", TIMER_DELIVER_MS=str(now - 1))  # due already: put now, DELAY dropped too
    a = svc.admit(past)
    assert a.put == [past] and not a.timed and past.topic == "TopicA" and "DELAY" not in past.properties


def test_admit_levels_plain_and_refusals(tmp_path):
    svc = _admitting(tmp_path)
    leveled = _msg(DELAY="2", **{PROPERTY_DELAY_SOURCE: "1:0:0"})
    a = svc.admit(leveled)
    assert a.put == [leveled] and leveled.topic == SCHEDULE_TOPIC and leveled.queue_id == 1
    assert PROPERTY_DELAY_SOURCE not in leveled.properties
    plain = _msg()
    assert svc.admit(plain).put == [plain] and plain.topic == "TopicA"
    bad = svc.admit(_msg(TIMER_DELIVER_MS="soon"))
    assert bad.refused and "TIMER_DELIVER_MS" in bad.refused and not bad.put and not bad.timed


def test_admit_batch(tmp_path):
    svc = _admitting(tmp_path)
    now = svc.clock.now_ms()
    assert svc.admit_batch([_msg(), _msg(DELAY="1")]).refused == (
        "TimeDelayLevel is not supported for batched messages")
    mixed = svc.admit_batch([_msg(TIMER_DELAY_SEC="5"), _msg(), _msg()])
    assert mixed.refused == "the batch mixes 1 timed and 2 immediate messages; send them in separate batches"
    a, b = _msg(TIMER_DELAY_SEC="5"), _msg(TIMER_DELAY_MS="7")
    assert svc.admit_batch([a, b]).timed == [(a, now + 5000), (b, now + 7)]
    forged = _msg(**{PROPERTY_DELAY_SOURCE: "1:0:0"})
    put = svc.admit_batch([forged, _msg()])
    assert put.put[0] is forged and PROPERTY_DELAY_SOURCE not in forged.properties
    assert "TIMER" in (svc.admit_batch([_msg(TIMER_DELAY_SEC="x")]).refused or "")
