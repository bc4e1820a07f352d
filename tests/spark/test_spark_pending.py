"""mode=pending: the brokers' timer stores' pending index as a batch DataFrame, against a real
``chronomq start`` (timed messages sent with chronomq.client, one cancelled through Admin)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from chronomq.client import Admin, Message, Producer, TimerOutcome

pytestmark = pytest.mark.spark

TOPIC = "PendingSparkT"


def pending(spark, ns: str, **opts: str):
    r = spark.read.format("chronomq").option("namesrv", ns).option("mode", "pending")
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def test_pending_mode_lists_filters_and_forgets_cancelled(spark, broker) -> None:
    ns = broker.namesrv_addr
    sent = {}
    with Producer("spark_pending_pg", ns) as p:
        for i in range(6):
            msg = Message(TOPIC, b"x" * (10 + i), keys=[f"order-{i}", "batch-7" if i < 4 else "batch-8"],
                          tags="remind" if i % 2 == 0 else "renew", delay=3600 + i * 60)
            sent[i] = p.send(msg)
    ids = {i: r.uniq_key for i, r in sent.items()}
    assert all(r.deliver_ms for r in sent.values())

    df = pending(spark, ns, topic=TOPIC)
    assert [f.name for f in df.schema.fields][:4] == ["msg_id", "offset_msg_id", "topic", "queue_id"]
    rows = {r.msg_id: r for r in df.collect()}
    assert set(rows) == set(ids.values())
    for i, res in sent.items():
        r = rows[ids[i]]
        assert r.topic == TOPIC and r.queue_id == res.queue.queue_id and r.broker == res.queue.broker_name
        assert r.tags == ("remind" if i % 2 == 0 else "renew") and f"order-{i}" in r.keys
        assert int(r.deliver_time.timestamp() * 1000) == res.deliver_ms
        assert r.body_size == 10 + i and r.offset_msg_id
        assert r.created is not None and r.created < r.deliver_time

    def ids_of(**opts: str) -> set[str]:
        return {r.msg_id for r in pending(spark, ns, topic=TOPIC, **opts).select("msg_id").collect()}

    assert ids_of(tag="renew") == {ids[1], ids[3], ids[5]}
    assert ids_of(key="batch-8") == {ids[4], ids[5]}
    assert ids_of(key="batch-7", tag="remind") == {ids[0], ids[2]}
    # an inclusive deliver-time window, once as epoch ms and once as ISO timestamps; pages of 2
    lo, hi = sent[1].deliver_ms, sent[3].deliver_ms
    assert ids_of(deliverFrom=str(lo), deliverTo=str(hi), pageSize="2") == {ids[1], ids[2], ids[3]}
    iso = datetime.fromtimestamp(lo / 1000, UTC).isoformat()
    assert ids_of(deliverFrom=iso) == {ids[i] for i in range(1, 6)}
    assert pending(spark, ns, topic=TOPIC, pageSize="1").count() == 6
    assert ids_of(key="no-such-key") == set()
    assert ids_of(key=ids[3]) == {ids[3]}  # the message id works as a key filter too

    with Admin(ns) as admin:
        [res] = admin.cancel(ids[2])
        assert res.outcome == TimerOutcome.CANCELLED
    assert ids_of() == set(ids.values()) - {ids[2]}
    assert ids_of(tag="remind") == {ids[0], ids[4]}


def test_pending_mode_refuses_queue_options_and_streaming(spark, broker) -> None:
    ns = broker.namesrv_addr
    with pytest.raises(Exception, match="do not apply to mode 'pending'"):
        pending(spark, ns, subscribe=TOPIC).collect()
    with pytest.raises(Exception, match="do not apply to mode 'pending'"):
        pending(spark, ns, startingOffsets="earliest").collect()
    with pytest.raises(Exception, match="is a batch read"):
        q = (spark.readStream.format("chronomq").option("namesrv", ns).option("mode", "pending").load()
             .writeStream.format("memory").queryName("pending_stream_refused").start())
        try:
            q.processAllAvailable()
        finally:
            q.stop()
    with pytest.raises(Exception, match="apply to mode 'pending' only"):
        spark.read.format("chronomq").option("namesrv", ns).option("subscribe", TOPIC).option(
            "deliverTo", "1").load().collect()
