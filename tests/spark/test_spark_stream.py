"""Streaming reads (readStream.format("chronomq")) and writes against a real ``chronomq start``:
micro-batches with new messages arriving, restart from the checkpoint without loss or duplicates,
maxOffsetsPerTrigger, new topics picked up by a pattern, and a streaming write."""

from __future__ import annotations

import pytest

from chronomq.client import Message, Producer, SimpleConsumer
from tests.conftest import wait_for
from tests.spark.conftest import process_all

pytestmark = pytest.mark.spark


def produce(ns: str, topic: str, lo: int, hi: int, pad: int = 0) -> None:
    """Send messages lo..hi-1 (``pad`` bytes of filler after each body's name) and wait until the broker's
    queues show them (dispatch is asynchronous)."""
    filler = b"x" * pad
    with Producer("spark_stream_pg", ns) as p:
        for i in range(lo, hi, 25):
            p.send_batch([Message(topic, f"{topic}-{j}".encode() + filler)
                          for j in range(i, min(hi, i + 25))])
    with SimpleConsumer("spark_stream_cg", ns) as c:
        wait_for(lambda: sum(c.max_offset(q) for q in c.queues(topic, refresh=True)) >= hi,
                 message=f"{hi} messages visible in {topic}")


def stream(spark, ns: str, **opts: str):
    r = spark.readStream.format("chronomq").option("namesrv", ns)
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def start_parquet(df, out: str, ckpt: str):
    return (df.selectExpr("CAST(value AS STRING) AS v", "topic", "partition", "offset")
            .writeStream.format("parquet").option("path", out).option("checkpointLocation", ckpt)
            .trigger(processingTime="300 milliseconds").start())


def available_now(make_df, out: str, ckpt: str):
    """A Trigger.AvailableNow query of ``make_df()`` into Parquet, run until it stops by itself."""
    for _ in range(3):  # see process_all: Spark's fixed worker connect-back timeout on a loaded box
        q = (make_df().writeStream.format("parquet").option("path", out).option("checkpointLocation", ckpt)
             .trigger(availableNow=True).start())
        try:
            assert q.awaitTermination(120), "an AvailableNow query must stop by itself"
            break
        except Exception as e:
            if "Python worker failed to connect back" not in str(e):
                raise
    return q


def values(spark, out: str) -> list[str]:
    return [r.v for r in spark.read.parquet(out).select("v").collect()]


def test_three_triggers_then_restart_no_loss_no_duplicates(spark, broker, tmp_path) -> None:
    ns = broker.namesrv_addr
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    produce(ns, "StreamA", 0, 40)
    def start():  # type: ignore[no-untyped-def]
        df = stream(spark, ns, subscribePattern="Stream[AB]", startingOffsets="earliest")
        return start_parquet(df, out, ckpt)

    q = process_all(start)
    try:
        progress = list(q.recentProgress)
        produce(ns, "StreamA", 40, 90)
        q = process_all(start, q)
        progress += q.recentProgress
        produce(ns, "StreamA", 90, 120)
        q = process_all(start, q)
        progress += q.recentProgress
        batches_with_rows = {(p["runId"], p["batchId"]) for p in progress if p["numInputRows"] > 0}
        assert len(batches_with_rows) >= 3
    finally:
        q.stop()
    assert sorted(values(spark, out)) == sorted(f"StreamA-{j}" for j in range(120))

    # while stopped: more messages, and a new topic that matches the pattern
    produce(ns, "StreamA", 120, 150)
    produce(ns, "StreamB", 0, 20)
    q = process_all(start)
    try:
        produce(ns, "StreamB", 20, 30)
        q = process_all(start, q)
    finally:
        q.stop()
    got = values(spark, out)
    expected = [f"StreamA-{j}" for j in range(150)] + [f"StreamB-{j}" for j in range(30)]
    assert len(got) == len(set(got)), "duplicates in the sink"
    assert sorted(got) == sorted(expected)


def test_max_offsets_per_trigger(spark, broker, tmp_path) -> None:
    ns = broker.namesrv_addr
    produce(ns, "RateT", 0, 45)
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    q = process_all(lambda: start_parquet(stream(spark, ns, subscribe="RateT", startingOffsets="earliest",
                                                 maxOffsetsPerTrigger="15"), out, ckpt))
    try:
        sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"] > 0]
    finally:
        q.stop()
    assert sum(sizes) == 45
    assert max(sizes) <= 15 and len(sizes) >= 3
    assert sorted(values(spark, out)) == sorted(f"RateT-{j}" for j in range(45))


def test_streaming_write(spark, broker, tmp_path) -> None:
    """A stream written into chronomq: every row arrives, ids are distinct (query id, batch, partition,
    row) and a second topic gets its rows by the topic column."""
    ns = broker.namesrv_addr
    produce(ns, "FwdSrc", 0, 60)
    src = stream(spark, ns, subscribe="FwdSrc", startingOffsets="earliest")
    fwd = src.selectExpr("value", "CASE WHEN offset % 2 = 0 THEN 'FwdEven' ELSE 'FwdOdd' END AS topic",
                         "map('src_offset', CAST(offset AS STRING)) AS properties")
    q = process_all(lambda: fwd.writeStream.format("chronomq").option("namesrv", ns)
                    .option("checkpointLocation", str(tmp_path / "ckpt"))
                    .trigger(processingTime="300 milliseconds").start())
    q.stop()

    def read(topic: str):
        return (spark.read.format("chronomq").option("namesrv", ns).option("subscribe", topic).load()
                .select("value", "msg_id", "properties").collect())

    rows = wait_for(lambda: (lambda a, b: a + b if len(a) + len(b) == 60 else None)(read("FwdEven"),
                                                                                      read("FwdOdd")),
                    timeout=30, message="60 forwarded rows")
    assert sorted(r.value.decode() for r in rows) == sorted(f"FwdSrc-{j}" for j in range(60))
    assert len({r.msg_id for r in rows}) == 60
    assert all("src_offset" in r.properties for r in rows)


def test_trigger_available_now(spark, broker, tmp_path) -> None:
    """Trigger.AvailableNow reads what exists at start (rate-limited into several batches) and stops."""
    ns = broker.namesrv_addr
    produce(ns, "NowT", 0, 25)
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    q = available_now(lambda: stream(spark, ns, subscribe="NowT", startingOffsets="earliest",
                                     maxOffsetsPerTrigger="10").selectExpr("CAST(value AS STRING) AS v"),
                      out, ckpt)
    sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"] > 0]
    assert sum(sizes) == 25 and max(sizes) <= 10
    assert sorted(values(spark, out)) == sorted(f"NowT-{j}" for j in range(25))


def test_a_narrower_schema_streams_only_its_columns(spark, broker, tmp_path) -> None:
    ns = broker.namesrv_addr
    produce(ns, "NarrowS", 0, 20)
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")
    df = (spark.readStream.format("chronomq").option("namesrv", ns).option("subscribe", "NarrowS")
          .option("startingOffsets", "earliest").schema("value binary, partition int").load())
    assert df.columns == ["value", "partition"]
    available_now(lambda: df.selectExpr("CAST(value AS STRING) AS v", "partition"), out, ckpt)
    assert sorted(values(spark, out)) == sorted(f"NarrowS-{j}" for j in range(20))
