"""Order timeout, the classic use of delayed messages, as two Spark jobs on the ``chronomq`` source.

1. ``submit``  (batch):     read the orders table and write one delayed "check payment" message per
                            order into chronomq (key = order id, tag = check, delay level = the timeout).
2. ``cancel``  (streaming): read the checks as chronomq delivers them (when the timeout is due), join
                            them with the payments table and write the orders that are still unpaid to
                            Parquet as cancellations.

``generate`` writes a demo orders/payments data set; ``all`` runs generate + submit + cancel until every
check came back (or --timeout). See README.md for local[*] and spark-submit --master spark://... runs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ORDER_SCHEMA = "order_id string, customer string, amount double, created_ms long"
CHECK_SCHEMA = "order_id string, customer string, amount double, created_ms long"


def spark_session(master: str | None, app: str = "chronomq-order-timeout") -> Any:
    from pyspark.sql import SparkSession

    from chronomq.spark import register

    b = SparkSession.builder.appName(app).config("spark.sql.shuffle.partitions", "4")
    if master:
        b = b.master(master)
    spark = b.getOrCreate()
    register(spark)
    return spark


def generate(
    spark: Any, workdir: Path, orders: int, paid_ratio: float = 0.7, seed: int = 7
) -> tuple[int, int]:
    """orders.parquet (order_id, customer, amount, created_ms) and payments.parquet (order_id, paid_ms)
    for ``paid_ratio`` of them. Returns (orders, paid)."""
    rnd = random.Random(seed)
    now = int(time.time() * 1000)
    rows = [
        (f"o-{i:06d}", f"c-{rnd.randrange(50):03d}", round(rnd.uniform(5, 500), 2), now)
        for i in range(orders)
    ]
    paid = [(oid, now + rnd.randrange(1000)) for oid, *_ in rows if rnd.random() < paid_ratio]
    spark.createDataFrame(rows, ORDER_SCHEMA).write.mode("overwrite").parquet(str(workdir / "orders.parquet"))
    spark.createDataFrame(paid, "order_id string, paid_ms long").write.mode("overwrite").parquet(
        str(workdir / "payments.parquet")
    )
    return len(rows), len(paid)


def submit_checks(spark: Any, namesrv: str, workdir: Path, topic: str, delay_level: int) -> int:
    """Batch job: one delayed check per order. Returns the number of messages written."""
    from pyspark.sql import functions as F

    orders = spark.read.parquet(str(workdir / "orders.parquet"))
    checks = orders.select(
        F.to_json(F.struct("order_id", "customer", "amount", "created_ms")).alias("value"),
        F.col("order_id").alias("key"),
        F.lit("check").alias("tags"),
        F.lit(delay_level).cast("int").alias("delay_level"),
        F.create_map(F.lit("kind"), F.lit("payment-check")).alias("properties"),
    )
    (
        checks.write.format("chronomq")
        .option("namesrv", namesrv)
        .option("topic", topic)
        .option("writeId", f"order-checks-{workdir.name}")
        .mode("append")
        .save()
    )
    return orders.count()


def start_cancellations(
    spark: Any, namesrv: str, workdir: Path, topic: str, available_now: bool = False
) -> Any:
    """Streaming job: checks (as delivered) anti-joined with payments -> cancellations Parquet."""
    from pyspark.sql import functions as F

    payments = spark.read.parquet(str(workdir / "payments.parquet")).select("order_id")
    checks = (
        spark.readStream.format("chronomq")
        .option("namesrv", namesrv)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("tagExpression", "check")
        .load()
        .select(
            F.from_json(F.col("value").cast("string"), CHECK_SCHEMA).alias("c"),
            F.col("timestamp").alias("checked_at"),
            "msg_id",
        )
        .select("c.*", "checked_at", "msg_id")
    )
    unpaid = checks.join(payments, "order_id", "left_anti").withColumn("reason", F.lit("payment timeout"))
    w = (
        unpaid.writeStream.format("parquet")
        .option("path", str(workdir / "cancellations"))
        .option("checkpointLocation", str(workdir / "checkpoints" / "cancellations"))
    )
    w = w.trigger(availableNow=True) if available_now else w.trigger(processingTime="1 second")
    return w.start()


def count_parquet(spark: Any, path: Path) -> int:
    if not path.exists() or not any(path.glob("*.parquet")):
        return 0
    return spark.read.parquet(str(path)).count()


def run_all(
    spark: Any, namesrv: str, workdir: Path, topic: str, orders: int, delay_level: int, timeout: float
) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    n, paid = generate(spark, workdir, orders)
    query = start_cancellations(spark, namesrv, workdir, topic)
    try:
        submit_checks(spark, namesrv, workdir, topic, delay_level)
        expected = n - paid
        deadline = time.monotonic() + timeout
        got = 0
        while time.monotonic() < deadline:
            query.processAllAvailable()
            got = count_parquet(spark, workdir / "cancellations")
            if got >= expected:
                break
            if query.exception() is not None:
                raise RuntimeError(f"the streaming query failed: {query.exception()}")
            time.sleep(0.5)  # the checks are due only after their delay level
    finally:
        query.stop()
    return {"orders": n, "paid": paid, "expected_cancellations": n - paid, "cancellations": got}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["generate", "submit", "cancel", "all"])
    ap.add_argument("--namesrv", default="127.0.0.1:9876")
    ap.add_argument("--workdir", default="./order_timeout_data")
    ap.add_argument("--topic", default="order_checks")
    ap.add_argument("--orders", type=int, default=1000)
    ap.add_argument("--delay-level", type=int, default=3, help="RocketMQ delay level (3 = 10 s by default)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--master", default=None, help="e.g. local[*]; leave out under spark-submit")
    a = ap.parse_args(argv)
    workdir = Path(a.workdir).resolve()
    spark = spark_session(a.master)
    try:
        if a.step == "generate":
            print(json.dumps(dict(zip(("orders", "paid"), generate(spark, workdir, a.orders), strict=True))))
        elif a.step == "submit":
            print(json.dumps({"checks": submit_checks(spark, a.namesrv, workdir, a.topic, a.delay_level)}))
        elif a.step == "cancel":
            q = start_cancellations(spark, a.namesrv, workdir, a.topic, available_now=True)
            q.awaitTermination()
            print(json.dumps({"cancellations": count_parquet(spark, workdir / "cancellations")}))
        else:
            print(json.dumps(run_all(spark, a.namesrv, workdir, a.topic, a.orders, a.delay_level, a.timeout)))
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
