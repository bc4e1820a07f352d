"""Spark <-> chronomq throughput: rows/s writing and reading N messages of 1 KiB through the ``chronomq``
data source on local[2], next to Spark writing and reading the same rows as Parquet in the same run.

    .venv/bin/python bench/spark_io.py            # quick: 50,000 rows
    .venv/bin/python bench/spark_io.py --full     # 1,000,000 rows (about 1 GiB through the broker)
    .venv/bin/python bench/spark_io.py --rows 200000 --namesrv 127.0.0.1:9876   # an existing broker
    .venv/bin/python bench/spark_io.py --repeat 3  # three rounds (each: chronomq, then Parquet), medians

Without --namesrv a fresh ``chronomq start`` is run in a temporary directory, and the broker's CPU time per
message (utime + stime from /proc/<pid>/stat) is printed for each phase. The load average is printed before
and after (the figures are only comparable within a run). Figures are printed, not asserted (bench, not a
test).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--full", action="store_true", help="1,000,000 rows")
    ap.add_argument("--size", type=int, default=1024, help="value size in bytes")
    ap.add_argument("--namesrv", default=None, help="use a running chronomq instead of starting one")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds, each writing and reading a new topic and Parquet table (a shared machine's "
                         "noise: the median of the rounds' ratios is printed)")
    a = ap.parse_args()
    rows = 1_000_000 if a.full else a.rows
    work = Path(tempfile.mkdtemp(prefix="chronomq-spark-bench-"))
    proc = None
    if a.namesrv is None:
        from tests.compat.harness import ChronomqProcess

        proc = ChronomqProcess(work / "data")
        proc.start(timeout=120)
        namesrv = proc.namesrv_addr
    else:
        namesrv = a.namesrv
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from chronomq.spark import register

    spark = (SparkSession.builder.master(a.master).appName("chronomq-spark-bench")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.memory", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    topic = f"SparkBench{int(time.time())}"
    pad = a.size - 12
    df = spark.range(rows).select(
        F.concat(F.lpad(F.col("id").cast("string"), 12, "0"), F.expr(f"repeat('x', {pad})")).alias("value"))
    results: dict[str, list[float]] = {}
    broker_cpu: dict[str, list[float]] = {}
    pid = proc.pid if proc is not None else None
    load_before = os.getloadavg()

    def timed(key: str, run: Callable[[], Any]) -> Any:
        """run(), its wall time into results[key] and the broker's CPU seconds into broker_cpu[key]."""
        c0, t0 = cpu_seconds(pid), time.perf_counter()
        out = run()
        results.setdefault(key, []).append(time.perf_counter() - t0)
        c1 = cpu_seconds(pid)
        if c0 is not None and c1 is not None:
            broker_cpu.setdefault(key, []).append(c1 - c0)
        return out

    try:
        # warm up both paths (Python workers, JIT, the topic route) on a few rows
        spark.range(100).select(F.col("id").cast("string").alias("value")).write.format("chronomq") \
            .option("namesrv", namesrv).option("topic", topic + "W").mode("append").save()
        spark.range(100).write.mode("overwrite").parquet(str(work / "warm.parquet"))
        (spark.read.format("chronomq").option("namesrv", namesrv).option("subscribe", topic + "W")
         .load().count())
        spark.read.parquet(str(work / "warm.parquet")).count()

        agg = [F.count("*").alias("n"), F.sum(F.length("value")).alias("b")]

        def one_round(name: str, parquet: str) -> None:
            timed("chronomq_write_s", lambda: df.write.format("chronomq").option("namesrv", namesrv)
                  .option("topic", name).mode("append").save())
            timed("parquet_write_s", lambda: df.write.mode("overwrite").parquet(parquet))
            source = spark.read.format("chronomq").option("namesrv", namesrv).option("subscribe", name)
            r = timed("chronomq_read_s", lambda: source.load().agg(*agg).collect()[0])
            assert r.n == rows, f"read {r.n} rows, wrote {rows}"
            p = timed("parquet_read_s", lambda: spark.read.parquet(parquet).agg(*agg).collect()[0])
            assert p.n == rows and p.b == r.b

        for i in range(a.repeat):
            one_round(f"{topic}R{i}", str(work / f"bench{i}.parquet"))
    finally:
        spark.stop()
        if proc is not None:
            proc.stop()
        shutil.rmtree(work, ignore_errors=True)

    load_after = os.getloadavg()
    print(f"rows={rows} value={a.size} B master={a.master} cpus={os.cpu_count()} rounds={a.repeat} "
          f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} "
          f"{load_after[1]:.2f}")
    print(f"{'':10} {'chronomq rows/s':>16} {'parquet rows/s':>16} {'chronomq/parquet':>17}   (medians)")
    for what in ("write", "read"):
        c = [rows / t for t in results[f"chronomq_{what}_s"]]
        q = [rows / t for t in results[f"parquet_{what}_s"]]
        ratios = [x / y for x, y in zip(c, q, strict=True)]
        each = "  rounds: " + " ".join(f"{x:.2f}" for x in ratios) if a.repeat > 1 else ""
        print(f"{what:10} {statistics.median(c):16,.0f} {statistics.median(q):16,.0f} "
              f"{statistics.median(ratios):16.1%}{each}")
    for key, secs in broker_cpu.items():
        if key.startswith("chronomq_"):
            sec, wall = statistics.median(secs), statistics.median(results[key])
            print(f"broker CPU during the chronomq {key.split('_')[1]}: {sec:.2f} s of {wall:.2f} s wall, "
                  f"{sec / rows * 1e6:.1f} us a message")
    print(json.dumps({"rows": rows, **{k: [round(v, 3) for v in vs] for k, vs in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
