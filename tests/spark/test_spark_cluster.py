"""The data source on a real standalone Spark cluster: a master and two workers started from the installed
PySpark (separate JVMs, each executor with Python workers of its own), all on 127.0.0.1, and drivers in
processes of their own with ``--master spark://...``. Executors run this interpreter, which has chronomq
installed (``spark.pyspark.python``, the route docs/spark.md "On a cluster" gives).

- batch write with a per-row delay and a per-row deliver time, read back in batch;
- a streaming query from chronomq into Parquet whose driver is killed (SIGKILL) part way and restarted
  from its checkpoint: every message is in the Parquet table exactly once;
- the order-timeout example through spark-submit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.spark.conftest import QUICK_JVM_OPTIONS
from tests.spark.standalone import StandaloneCluster as Cluster
from tests.spark.standalone import pyspark_home

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    pytest.importorskip("pyspark")
    with Cluster(pyspark_home(), tmp_path_factory.mktemp("spark_cluster")) as c:
        yield c


SESSION = textwrap.dedent("""
    import sys
    from pyspark.sql import SparkSession
    from chronomq.spark import register
    spark = (SparkSession.builder.master({master!r}).appName({app!r})
             .config("spark.pyspark.python", sys.executable)      # the executors' interpreter: this one
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             .config("spark.executor.memory", "512m").config("spark.sql.session.timeZone", "UTC")
             .config("spark.executor.extraJavaOptions", {quick!r})
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
""")


def driver(cluster: Cluster, body: str, tmp_path: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    """A driver process (output in <name>.out / <name>.err: a pipe left unread could block it)."""
    script = tmp_path / f"{name}.py"
    script.write_text(SESSION.format(master=cluster.url, app=name, quick=QUICK_JVM_OPTIONS)
                      + textwrap.dedent(body))
    with (tmp_path / f"{name}.out").open("wb") as out, (tmp_path / f"{name}.err").open("wb") as err:
        # a session of its own: the driver is the Python process and its JVM, killed together
        return subprocess.Popen([sys.executable, str(script), *args], stdout=out, stderr=err, cwd=tmp_path,
                                env=cluster.env(), start_new_session=True)


def output(tmp_path: Path, name: str, which: str = "err") -> str:
    return (tmp_path / f"{name}.{which}").read_text(errors="replace")


def run_driver(cluster: Cluster, body: str, tmp_path: Path, name: str, *args: str) -> str:
    p = driver(cluster, body, tmp_path, name, *args)
    p.wait(300)
    assert p.returncode == 0, output(tmp_path, name)[-4000:]
    return output(tmp_path, name, "out")


def test_batch_write_with_per_row_delay_and_deliver_time(cluster: Cluster, broker, tmp_path) -> None:
    body = """
        import json, time
        from pyspark.sql import functions as F
        ns = sys.argv[1]
        now = int(time.time() * 1000)
        ids = spark.range(0, 300, numPartitions=4)
        value = F.concat(F.lit("c-"), F.col("id").cast("string")).alias("value")
        for rows in (ids.where("id % 3 = 0").select(value, F.lit(1500).alias("delay_ms")),        # a delay
                     ids.where("id % 3 = 1").select(value, F.lit(now + 2500).alias("deliver_at")),  # a time
                     ids.where("id % 3 = 2").select(value)):                                    # at once
            rows.write.format("chronomq").option("namesrv", ns).option("topic", "ClusterT").mode("append") \
                .save()
        deadline = time.monotonic() + 120
        while True:
            got = (spark.read.format("chronomq").option("namesrv", ns).option("subscribe", "ClusterT").load()
                   .selectExpr("CAST(value AS STRING) AS v", "timestamp", "deliver_time").collect())
            if len(got) >= 300 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        early = [r.v for r in got if r.deliver_time is not None and r.timestamp < r.deliver_time]
        print("RESULT " + json.dumps({"rows": len(got), "distinct": len({r.v for r in got}),
                                      "timed": sum(1 for r in got if r.deliver_time is not None),
                                      "early": len(early), "started": now}))
        spark.stop()
    """
    out = run_driver(cluster, body, tmp_path, "batch", broker.namesrv_addr)
    result = json.loads(re.search(r"^RESULT (.*)$", out, flags=re.M).group(1))
    assert result["rows"] == result["distinct"] == 300
    assert result["timed"] == 200 and result["early"] == 0  # 100 by delay, 100 by deliver time, none early


PER_TRIGGER = 300  # 3,000 messages: ten micro-batches, the first driver killed after its third
STREAM = f"""
    import json, time
    ns, checkpoint, table = sys.argv[1], sys.argv[2], sys.argv[3]
    q = (spark.readStream.format("chronomq").option("namesrv", ns).option("subscribe", "ClusterS")
         .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", "{PER_TRIGGER}").load()
         .selectExpr("CAST(value AS STRING) AS v", "msg_id", "partition", "offset")
         .writeStream.format("parquet").option("path", table).option("checkpointLocation", checkpoint)
         .trigger(processingTime="500 milliseconds").start())
    print("STARTED", flush=True)
    q.awaitTermination()
"""


def test_stream_to_parquet_survives_a_killed_driver_exactly_once(cluster: Cluster, broker, tmp_path) -> None:
    from chronomq.client import Admin, Message, Producer

    n = 3_000
    with Admin(broker.namesrv_addr) as admin:
        admin.create_topic("ClusterS", 4)
    with Producer("cluster_stream", broker.namesrv_addr) as p:
        for i in range(0, n, 100):
            p.send_batch([Message("ClusterS", f"s-{j}") for j in range(i, i + 100)])
    checkpoint, table = tmp_path / "ckpt", tmp_path / "table"

    def committed_batches() -> int:
        commits = checkpoint / "commits"
        return len([f for f in commits.iterdir() if f.name.isdigit()]) if commits.exists() else 0

    first = driver(cluster, STREAM, tmp_path, "stream1", broker.namesrv_addr, str(checkpoint), str(table))
    try:
        wait_for(lambda: committed_batches() >= 3 or first.poll() is not None, timeout=180, interval=0.2,
                 message="three micro-batches committed")
        assert first.poll() is None, output(tmp_path, "stream1")[-4000:]
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver (Python and JVM) dies between or inside batches
        first.wait(30)
    assert committed_batches() < n // PER_TRIGGER, "the first driver had already read everything"
    second = driver(cluster, STREAM, tmp_path, "stream2", broker.namesrv_addr, str(checkpoint), str(table))
    try:
        def all_in_table() -> bool:
            if second.poll() is not None:
                raise AssertionError(output(tmp_path, "stream2")[-4000:])
            return _parquet_rows(table) >= n

        wait_for(all_in_table, timeout=240, interval=0.5, message="every message in the Parquet table")
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        try:
            second.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(30)
    values = _committed_values(table)
    assert len(values) == n and len(set(values)) == n  # each message once, none lost, none twice


def _committed_values(table: Path) -> list[str]:
    """The rows of a streaming Parquet sink as Spark reads it: only the files its _spark_metadata log
    committed (a batch the killed driver was writing may have left files that no batch committed)."""
    import pyarrow.parquet as pq

    meta = table / "_spark_metadata"
    files: list[str] = []
    for log in sorted(meta.iterdir()) if meta.exists() else []:
        if not log.name.split(".")[0].isdigit():
            continue
        for line in log.read_text().splitlines()[1:]:  # "v1", then one JSON entry per file
            entry = json.loads(line)
            if entry.get("action") == "add":
                files.append(entry["path"].removeprefix("file://").removeprefix("file:"))
    # a compacted log (every 10th, N.compact) repeats the entries of the logs before it: count a file once
    return [v for f in dict.fromkeys(files) for v in pq.read_table(f, columns=["v"]).column("v").to_pylist()]


def _parquet_rows(table: Path) -> int:
    try:
        return len(_committed_values(table))
    except (OSError, ValueError):  # a log entry being written; the next poll reads it
        return 0


def test_order_timeout_example_with_spark_submit(cluster: Cluster, broker, tmp_path) -> None:
    submit = cluster.home / "bin" / "spark-submit"
    work = tmp_path / "work"
    out = subprocess.run(
        [str(submit), "--master", cluster.url, "--conf", f"spark.pyspark.python={sys.executable}",
         "--conf", "spark.executor.memory=512m", "--conf", "spark.ui.enabled=false",
         "--conf", f"spark.executor.extraJavaOptions={QUICK_JVM_OPTIONS}",
         str(REPO / "examples" / "order_timeout" / "pipeline.py"), "all", "--namesrv", broker.namesrv_addr,
         "--workdir", str(work), "--orders", "400", "--delay-level", "2", "--topic", "cluster_checks"],
        capture_output=True, text=True, timeout=400, env=cluster.env(), cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cancellations"] == result["expected_cancellations"] > 0
