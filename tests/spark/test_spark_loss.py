"""failOnDataLoss both ways, after the broker really cleaned old data: a broker with 64 KiB commit-log
segments, fileReservedTime=0 and a clean every 300 ms deletes every segment but the one being written."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest

from chronomq.client import Admin, Message, Producer, SimpleConsumer
from tests.conftest import wait_for
from tests.spark.conftest import SPARK_WORKER_FLAKE, process_all

pytestmark = pytest.mark.spark

SEGMENT = 64 * 1024
CLEANING = {"mappedFileSizeCommitLog": str(SEGMENT), "mappedFileSizeConsumeQueue": str(20 * 64),
            "fileReservedTime": "0", "deleteWhen": ";".join(f"{h:02d}" for h in range(24)),
            "cleanResourceInterval": "300"}


@pytest.fixture(scope="module")
def cleaning_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from tests.compat.harness import ChronomqProcess

    p = ChronomqProcess(tmp_path_factory.mktemp("cleaning") / "data", overrides=CLEANING)
    p.start(timeout=60)
    yield p
    p.stop(timeout=30)


def produce(ns: str, topic: str, n: int, size: int) -> None:
    with Producer("spark_loss_pg", ns) as p:
        for i in range(0, n, 20):
            p.send_batch([Message(topic, f"{topic}-{j}-".encode().ljust(size, b"."))
                          for j in range(i, i + 20)])


def bounds(ns: str, topic: str) -> dict[int, tuple[int, int]]:
    with SimpleConsumer("spark_loss_cg", ns) as c:
        return {q.queue_id: (c.min_offset(q), c.max_offset(q)) for q in c.queues(topic, refresh=True)}


def cleaned(ns: str, topic: str, above: int, total: int) -> dict[int, tuple[int, int]] | None:
    b = bounds(ns, topic)
    ok = sum(hi for _, hi in b.values()) >= total and all(lo > above for lo, _ in b.values())
    return b if ok else None


def one_segment_left(ns: str, broker: str) -> bool:
    """Whether the cleaner has deleted every commit-log segment but the one being written (the 64 KiB
    segments start at multiples of their size): then it has nothing left to delete."""
    with Admin(ns) as a:
        info = a.broker_runtime_info(broker)
    lo, hi = int(info["commitLogMinOffset"]), int(info["commitLogMaxOffset"])
    return lo > 0 and lo // SEGMENT == (hi - 1) // SEGMENT


def test_batch_fail_on_data_loss_both_ways(spark, cleaning_broker) -> None:
    ns = cleaning_broker.namesrv_addr
    produce(ns, "LossB", 600, 1000)
    b = wait_for(lambda: cleaned(ns, "LossB", 0, 600), timeout=60, message="old LossB data cleaned")
    # the reads below see the same data: the cleaner is done (its pass moves the queues' minimum right
    # after it deletes the segments, so the bounds read after that pass stay)
    wait_for(lambda: one_segment_left(ns, cleaning_broker.broker_addr), timeout=60,
             message="the cleaner deleted every segment but the one being written")
    from_zero = json.dumps({"LossB": {"broker-a": {str(q): 0 for q in b}}})

    def read(fail: str):
        return (spark.read.format("chronomq").option("namesrv", ns).option("subscribe", "LossB")
                .option("startingOffsets", from_zero).option("failOnDataLoss", fail).load())

    with pytest.raises(Exception, match="no longer available"):
        read("true").collect()
    b = wait_for(lambda: cleaned(ns, "LossB", 0, 600), timeout=10)  # after the last pass: stable now
    rows = read("false").select("partition", "offset").collect()
    assert sorted((r.partition, r.offset) for r in rows) == sorted(
        (q, o) for q, (lo, hi) in b.items() for o in range(lo, hi))


def test_stream_fail_on_data_loss_both_ways(spark, cleaning_broker, tmp_path) -> None:
    ns = cleaning_broker.namesrv_addr
    produce(ns, "LossS", 40, 10)
    wait_for(lambda: sum(hi for _, hi in bounds(ns, "LossS").values()) >= 40)
    out, ckpt = str(tmp_path / "out"), str(tmp_path / "ckpt")

    def start(fail: str, checkpoint: str):
        df = (spark.readStream.format("chronomq").option("namesrv", ns).option("subscribe", "LossS")
              .option("startingOffsets", "earliest").option("failOnDataLoss", fail).load())
        return (df.selectExpr("partition", "offset").writeStream.format("parquet").option("path", out)
                .option("checkpointLocation", checkpoint).trigger(processingTime="300 milliseconds").start())

    process_all(lambda: start("true", ckpt)).stop()
    first = {(r.partition, r.offset) for r in spark.read.parquet(out).collect()}
    assert len(first) == 40
    # while the query is stopped the messages after its checkpoint are written and cleaned away
    produce(ns, "LossS", 600, 1000)
    wait_for(lambda: cleaned(ns, "LossS", 20, 640), timeout=60, message="LossS cleaned past the checkpoint")
    wait_for(lambda: one_segment_left(ns, cleaning_broker.broker_addr), timeout=60,
             message="the cleaner deleted every segment but the one being written")

    shutil.copytree(ckpt, str(tmp_path / "ckpt2"))
    for _ in range(3):
        q = start("true", ckpt)
        with pytest.raises(Exception, match=r"data loss|" + SPARK_WORKER_FLAKE) as err:
            q.processAllAvailable()
        q.stop()
        if SPARK_WORKER_FLAKE not in str(err.value):
            break
    assert "data loss" in str(err.value)

    process_all(lambda: start("false", str(tmp_path / "ckpt2"))).stop()
    b = bounds(ns, "LossS")
    rows = [(r.partition, r.offset) for r in spark.read.parquet(out).collect()]
    assert len(rows) == len(set(rows)), "duplicates in the sink"
    retained = {(qid, o) for qid, (lo, hi) in b.items() for o in range(lo, hi)}
    assert set(rows) == first | retained
