"""Batch reads and writes through format("chronomq") against a real ``chronomq start``."""

from __future__ import annotations

import json
import time

import pytest

from chronomq.client import Message, Producer, SimpleConsumer
from tests.conftest import wait_for

pytestmark = pytest.mark.spark


def produce(ns: str, topic: str, n: int, prefix: str = "m") -> None:
    with Producer("spark_test_pg", ns) as p:
        for i in range(0, n, 50):
            p.send_batch([Message(topic, f"{prefix}{j}".encode(), keys=f"k{j}", tags="t" if j % 2 else "u")
                          for j in range(i, min(n, i + 50))])


def reader(spark, ns: str, **opts: str):
    r = spark.read.format("chronomq").option("namesrv", ns)
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def queue_sizes(ns: str, topic: str) -> dict[int, int]:
    with SimpleConsumer("spark_test_cg", ns) as c:
        return {q.queue_id: c.max_offset(q) for q in c.queues(topic)}


def test_batch_read_everything_then_exact_ranges(spark, broker) -> None:
    ns = broker.namesrv_addr
    produce(ns, "BatchT", 400)
    wait_for(lambda: sum(queue_sizes(ns, "BatchT").values()) == 400)  # every queue entry written
    sizes = queue_sizes(ns, "BatchT")
    df = reader(spark, ns, subscribe="BatchT")
    rows = df.select("value", "partition", "offset", "keys", "key", "tags", "topic", "broker").collect()
    assert sorted(r.value for r in rows) == sorted(f"m{j}".encode() for j in range(400))
    assert {(r.partition, r.offset) for r in rows} == {(q, o) for q, n in sizes.items() for o in range(n)}
    one = next(r for r in rows if r.value == b"m7")
    assert one.keys == ["k7"] and one.key == b"k7" and one.tags == "t" and one.topic == "BatchT"

    # exact ranges: [10, 25) of the first queue, [0, 3) of the second, the rest of the others untouched
    qa, qb = sorted(q for q, n in sizes.items() if n >= 25)[:2]
    start = {"BatchT": {"broker-a": {str(qa): 10, str(qb): -2}}}
    end = {"BatchT": {"broker-a": {str(qa): 25, str(qb): 3}}}
    assign = {"BatchT": {"broker-a": [qa, qb]}}
    part = reader(spark, ns, assign=json.dumps(assign), startingOffsets=json.dumps(start),
                  endingOffsets=json.dumps(end))
    got = sorted((r.partition, r.offset) for r in part.select("partition", "offset").collect())
    assert got == sorted([(qa, o) for o in range(10, 25)] + [(qb, o) for o in range(3)])

    # minPartitions splits the ranges but returns the same rows
    split = reader(spark, ns, subscribe="BatchT", minPartitions="9")
    assert split.rdd.getNumPartitions() >= 9
    assert split.count() == 400
    # server-side tag filter
    tagged = reader(spark, ns, subscribe="BatchT", tagExpression="t").select("value").collect()
    assert sorted(r.value for r in tagged) == sorted(f"m{j}".encode() for j in range(1, 400, 2))


def test_batch_read_by_timestamp(spark, broker) -> None:
    ns = broker.namesrv_addr
    produce(ns, "TsT", 20, "old")
    wait_for(lambda: sum(queue_sizes(ns, "TsT").values()) == 20)
    with SimpleConsumer("spark_test_cg", ns) as c:
        q0 = c.queues("TsT")[0]
        last_old = max(m.store_timestamp for q in c.queues("TsT") for m in c.pull(q, 0, 64).messages)
    # new messages get a strictly later store time: wait for the clock to pass the old ones
    wait_for(lambda: time.time() * 1000 > last_old + 5)
    cut = int(time.time() * 1000)
    produce(ns, "TsT", 10, "new")
    wait_for(lambda: sum(queue_sizes(ns, "TsT").values()) == 30)
    rows = reader(spark, ns, subscribe="TsT", startingTimestamp=str(cut)).select("value").collect()
    assert sorted(r.value for r in rows) == sorted(f"new{j}".encode() for j in range(10))
    assert q0.topic == "TsT"


def test_bad_options_fail_clearly(spark, broker) -> None:
    ns = broker.namesrv_addr
    with pytest.raises(Exception, match="exactly one of"):
        reader(spark, ns).collect()
    with pytest.raises(Exception, match=r"does not know it|no route|cannot read topic"):
        reader(spark, ns, subscribe="NoSuchTopicAnywhere").collect()


def test_a_narrower_schema_reads_only_its_columns(spark, broker) -> None:
    """.schema(...) naming some of the source's columns: those are built, in that order, with the values
    the full schema has; one that does not fit is refused with what is wrong."""
    ns = broker.namesrv_addr
    produce(ns, "NarrowT", 60)
    wait_for(lambda: sum(queue_sizes(ns, "NarrowT").values()) == 60)
    narrow = (spark.read.format("chronomq").option("namesrv", ns).option("subscribe", "NarrowT")
              .schema("offset bigint, value binary, keys array<string>").load())
    assert narrow.columns == ["offset", "value", "keys"]
    full = reader(spark, ns, subscribe="NarrowT").select("offset", "value", "keys")
    assert sorted(narrow.collect()) == sorted(full.collect())
    assert sorted(r.keys[0] for r in narrow.collect()) == sorted(f"k{j}" for j in range(60))
    with pytest.raises(Exception, match="value is string, not binary"):
        (spark.read.format("chronomq").option("namesrv", ns).option("subscribe", "NarrowT")
         .schema("value string").load().collect())


def test_write_rows_with_tags_keys_properties_delay_and_read_back(spark, broker) -> None:
    from pyspark.sql import functions as F

    ns = broker.namesrv_addr
    src = spark.createDataFrame(
        [(f"v{i}", f"key{i}", ["a", f"x{i}"], "even" if i % 2 == 0 else "odd", {"n": str(i)},
          2 if i % 10 == 0 else 0) for i in range(100)],
        "value string, key string, keys array<string>, tags string, properties map<string,string>, "
        "delay_level int")
    (src.withColumn("topic", F.lit("WriteT")).write.format("chronomq").option("namesrv", ns)
     .option("writeId", "w1").mode("append").save())

    def read_all():
        return reader(spark, ns, subscribe="WriteT").select("value", "keys", "tags", "properties", "msg_id",
                                                            "timestamp", "born_timestamp").collect()

    # delayed rows (level 2 = 2 s on this broker) arrive later; the others at once
    rows = wait_for(lambda: (lambda rs: rs if len(rs) == 100 else None)(read_all()), timeout=30,
                    message="all 100 written rows, including the 10 delayed ones")
    by_value = {r.value.decode(): r for r in rows}
    assert set(by_value) == {f"v{i}" for i in range(100)}
    r3 = by_value["v3"]
    assert r3.keys == ["key3", "a", "x3"] and r3.tags == "odd" and r3.properties["n"] == "3"
    # deterministic ids: hash of (writeId, batch 0, partition, row index), all distinct
    from chronomq.spark import row_uniq_key

    ids = {r.msg_id for r in rows}
    assert len(ids) == 100
    parts = spark.sparkContext.defaultParallelism
    expected = {row_uniq_key("w1", 0, p, i) for p in range(parts) for i in range(100)}
    assert ids <= expected
    # the delayed ones were stored at least 2 s after they were born
    for i in range(0, 100, 10):
        r = by_value[f"v{i}"]
        assert r.properties.get("REAL_TOPIC") == "WriteT"
        assert (r.timestamp - r.born_timestamp).total_seconds() >= 2.0


def test_write_refuses_bad_frames(spark, broker) -> None:
    ns = broker.namesrv_addr
    df = spark.createDataFrame([("x", "y")], "value string, tag string")
    with pytest.raises(Exception, match="not understood"):
        df.write.format("chronomq").option("namesrv", ns).option("topic", "T").mode("append").save()
    df2 = spark.createDataFrame([("x",)], "value string")
    with pytest.raises(Exception, match="no topic"):
        df2.write.format("chronomq").option("namesrv", ns).mode("append").save()
    # a row the client refuses fails the task with the client's reason
    df3 = spark.createDataFrame([("x", ["bad\x01key"])], "value string, keys array<string>")
    with pytest.raises(Exception, match=r"cannot be sent as a message|0x01/0x02"):
        df3.write.format("chronomq").option("namesrv", ns).option("topic", "T").mode("append").save()


def test_write_delay_ms_carries_timer_deliver_time(spark, broker) -> None:
    """delay_ms / deliver_at rows are sent with TIMER_DELIVER_MS (the timer issue's property), the
    reader's deliver_time shows it, and the broker's timer holds each row until then: the delivered
    copy's store time is never before its deliver time."""
    from datetime import UTC, datetime, timedelta

    ns = broker.namesrv_addr
    at = (datetime.now(UTC) + timedelta(seconds=2)).replace(microsecond=0)
    df = spark.createDataFrame([("a", 1500), ("b", 2500)], "value string, delay_ms bigint")
    df.write.format("chronomq").option("namesrv", ns).option("topic", "TimerT").mode("append").save()
    df2 = spark.createDataFrame([("c", at)], "value string, deliver_at timestamp")
    df2.write.format("chronomq").option("namesrv", ns).option("topic", "TimerT").mode("append").save()

    def rows():
        rs = reader(spark, ns, subscribe="TimerT").select("value", "properties", "deliver_time",
                                                          "born_timestamp", "timestamp").collect()
        return rs if len(rs) == 3 else None

    by = {r.value: r for r in wait_for(rows, timeout=60, message="the 3 rows with a deliver time")}
    for v, delay in ((b"a", 1500), (b"b", 2500)):
        r = by[v]
        want = int(r.properties["TIMER_DELIVER_MS"])
        assert int(r.deliver_time.timestamp() * 1000) == want
        born = int(r.born_timestamp.timestamp() * 1000)
        # computed from the writer's clock just before the producer stamps the born time
        assert -5_000 < want - born - delay < 60_000
    assert int(by[b"c"].properties["TIMER_DELIVER_MS"]) == int(at.timestamp() * 1000)
    for r in by.values():  # never early: stored on the real topic at or after the deliver time
        assert int(r.timestamp.timestamp() * 1000) >= int(r.properties["TIMER_DELIVER_MS"])


def test_acl_credentials_for_reads_and_writes(spark, tmp_path) -> None:
    from tests.compat.harness import ChronomqProcess

    acl = tmp_path / "plain_acl.yml"
    acl.write_text("accounts:\n  - accessKey: spark-key\n    secretKey: spark-secret\n    admin: true\n"
                   "    defaultTopicPerm: PUB|SUB\n    defaultGroupPerm: SUB\n")
    with ChronomqProcess(tmp_path / "data", {"aclEnable": "true", "aclFile": str(acl)}) as p:
        ns = p.namesrv_addr
        creds = {"accessKey": "spark-key", "secretKey": "spark-secret"}
        df = spark.createDataFrame([(f"v{i}".encode(),) for i in range(6)], "value binary")
        writer = df.write.format("chronomq").option("namesrv", ns).option("topic", "AclSpark")
        for k, v in creds.items():
            writer = writer.option(k, v)
        writer.mode("append").save()
        want = [f"v{i}".encode() for i in range(6)]
        # the two partitions' sends create the topic concurrently: read until every row is listed
        wait_for(lambda: sorted(r.value for r in reader(spark, ns, subscribe="AclSpark", **creds)
                                .select("value").collect()) == want, timeout=30, message="all 6 rows")
        with pytest.raises(Exception, match="No accessKey is configured"):
            reader(spark, ns, subscribe="AclSpark").collect()
