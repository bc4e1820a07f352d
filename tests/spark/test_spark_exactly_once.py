"""A Spark write whose task dies half way through its first attempt and is retried: with the sink's
de-duplication (the default) every row is stored once; with ``dedup=false`` the rows the first attempt
had sent are stored twice, and counted. Runs in its own process: the suite's session (local[2]) never
retries a task, this one's master (local[2,2]) retries each once."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.spark
ROWS = 2_000
FAIL_AT = 1_500

SCRIPT = textwrap.dedent(f"""
    import json, sys
    from pyspark import TaskContext
    from pyspark.sql import SparkSession, functions as F
    from pyspark.sql.types import StringType
    from chronomq.spark import register

    ns = sys.argv[1]
    spark = (SparkSession.builder.master("local[2,2]").config("spark.ui.enabled", "false")
             .config("spark.sql.execution.arrow.maxRecordsPerBatch", "20").getOrCreate())
    spark.sparkContext.setLogLevel("OFF")
    register(spark)

    @F.udf(StringType())
    def value(i):
        if i == {FAIL_AT} and TaskContext.get().attemptNumber() == 0:
            raise RuntimeError("the first attempt dies half way")
        return f"row-{{i}}-" + "x" * 1000  # 1 KiB rows: well past the JVM's 64 KiB pipe buffer

    out = {{}}
    for topic, dedup in (sys.argv[2], "true"), (sys.argv[3], "false"):
        (spark.range(0, {ROWS}, numPartitions=1).select(value("id").alias("value"))
         .write.format("chronomq").option("namesrv", ns).option("topic", topic).option("dedup", dedup)
         .option("batchSize", "10").option("maxInFlight", "1").mode("append").save())
        rows = (spark.read.format("chronomq").option("namesrv", ns).option("subscribe", topic).load()
                .selectExpr("substring_index(CAST(value AS STRING), '-x', 1) AS v", "msg_id").collect())
        out[dedup] = {{"total": len(rows), "values": len({{r.v for r in rows}}),
                      "ids": len({{r.msg_id for r in rows}})}}
    print("RESULT " + json.dumps(out))
    spark.stop()
""")


def test_a_retried_write_task_stores_each_row_once_with_dedup(broker, tmp_path) -> None:
    from chronomq.client import Admin

    with Admin(broker.namesrv_addr) as admin:
        for topic in ("EoOn", "EoOff"):
            admin.create_topic(topic, 2)
    script = tmp_path / "retry_write.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), broker.namesrv_addr, "EoOn", "EoOff"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"^RESULT (.*)$", out.stdout, flags=re.M)
    assert m, out.stdout[-2000:]
    result = json.loads(m.group(1))
    on, off = result["true"], result["false"]
    # de-duplication on: every row exactly once, though the first attempt had sent some of them
    assert on == {"total": ROWS, "values": ROWS, "ids": ROWS}
    # off: every row, and the first attempt's rows a second time (same UNIQ_KEY: a reader could drop them)
    assert off["values"] == ROWS and off["ids"] == ROWS
    assert ROWS < off["total"] <= ROWS + FAIL_AT, off
