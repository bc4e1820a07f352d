"""Spark <-> chronomq throughput: rows/s writing and reading N messages of 1 KiB through the ``chronomq`` data
source, next to Spark's own Kafka connector on a single-node Kafka broker (KRaft, ``acks=all``) and Spark
writing and reading the same rows as Parquet, in the same run (chronomq's read twice: every column, and with
``.schema("value binary")``, the one column the benchmark's query uses: "read1"); on local[2], or on a
standalone cluster the bench starts itself (``--cluster``). Each round also streams: a streaming query from
the earliest offset over the round's N rows into a counting ``foreachBatch`` sink (rows/s from the query's
start to the last row), and the produce-to-sink latency of min(N, 50,000) rows written in ten Spark batch
writes one second apart while a query from the latest offset collects each micro-batch's produce times
(chronomq's ``born_timestamp``, Kafka's ``timestamp``, CreateTime: both set by the producer when it sends); a
row's latency is the time its micro-batch reached the sink minus that time (p50 / p99 / max printed). And, for
chronomq alone (Kafka has no per-message delay), a delayed write: min(N, 20,000) rows written with a 5 s delay
each (``delay_ms``) while a streaming query from the latest offset waits for them; printed: how long after its
deliver time each row reached the sink, and how many were stored in their topic before it (0).

    .venv/bin/python bench/spark_io.py            # quick: 50,000 rows
    .venv/bin/python bench/spark_io.py --full     # 1,000,000 rows (about 1 GiB through the broker)
    .venv/bin/python bench/spark_io.py --rows 200000 --namesrv 127.0.0.1:9876   # an existing broker
    .venv/bin/python bench/spark_io.py --repeat 3  # three rounds (each: chronomq, then Parquet), medians
    .venv/bin/python bench/spark_io.py --cluster --full   # a master and two 1-core workers on 127.0.0.1
    .venv/bin/python bench/spark_io.py --no-kafka  # without the Kafka peer

The Kafka broker and Spark's Kafka connector (``spark-sql-kafka-0-10`` at the installed Spark's version, or
the newest one the repository serves, stated) come from Maven Central (bench/kafka_peer.py); without Java
or Maven, or when the repository refuses them, the Kafka columns are skipped with the reason printed.

Without --namesrv a fresh ``chronomq start`` is run in a temporary directory, and the broker's CPU time per
message (utime + stime from /proc/<pid>/stat) is printed for each phase. The load average is printed before
and after (the figures are only comparable within a run). Figures are printed, not asserted (bench, not a
test).

With --cluster the master and the workers are started from the installed PySpark (tests/spark/standalone.py,
as tests/spark/test_spark_cluster.py does) and stopped by PID at the end; this process is the driver (client
mode). The executors run this interpreter, named with ``spark.pyspark.python`` (docs/spark.md "On a
cluster"), and see this checkout's ``src`` first on their path (PYTHONPATH, inherited through the workers);
the bench prints where the executors imported chronomq from, so a figure cannot silently come from another
copy. Everything the run writes, the cluster's logs and Spark's scratch space included, is under one
temporary directory that is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
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


DELAYED_ROWS = 20_000  # rows of the delayed write (per round), each with a delay of DELAY_MS
DELAY_MS = 5_000


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def commit() -> str:
    """The checkout's commit, with "+changes" when tracked files differ from it."""
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)

    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    return head + ("+changes" if git("diff", "--quiet", "HEAD").returncode else "")


def executor_chronomq(_: object) -> str:
    """Runs on an executor: which interpreter, and where it imported chronomq from."""
    import chronomq

    return f"{sys.executable} chronomq from {Path(chronomq.__file__).parent}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--full", action="store_true", help="1,000,000 rows")
    ap.add_argument("--size", type=int, default=1024, help="value size in bytes")
    ap.add_argument("--namesrv", default=None, help="use a running chronomq instead of starting one")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--master", default="local[2]")
    where.add_argument("--cluster", action="store_true",
                       help="start a standalone cluster (a master and two workers of 1 core and 1 GiB each, "
                            "on 127.0.0.1) from the installed PySpark and run on it")
    ap.add_argument("--no-kafka", action="store_true", help="leave the Kafka peer out")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds, each writing and reading a new topic and Parquet table (a shared machine's "
                         "noise: the median of the rounds' ratios is printed)")
    a = ap.parse_args()
    rows = 1_000_000 if a.full else a.rows
    work = Path(tempfile.mkdtemp(prefix="chronomq-spark-bench-"))
    proc: Any = None
    cluster: Any = None
    spark: Any = None
    kafka: Any = None
    jars: list[str] = []
    try:  # whatever was started is stopped, and the directory removed, however far this gets
        if not a.no_kafka:
            import pyspark
            from bench.kafka_peer import KafkaBroker, KafkaUnavailable, connector_jars

            try:
                version, jars, note = connector_jars(pyspark.__version__)
                kafka = KafkaBroker(work / "kafka").start()
                print(f"Kafka peer: {kafka.describe()}; Spark's Kafka connector {version}"
                      + (f" ({note})" if note else ""), flush=True)
            except KafkaUnavailable as e:
                print(f"Kafka peer skipped: {e}", flush=True)
                kafka, jars = None, []
        if a.namesrv is None:
            from tests.compat.harness import ChronomqProcess

            proc = ChronomqProcess(work / "data")
            proc.start(timeout=120)
            namesrv = proc.namesrv_addr
        else:
            namesrv = a.namesrv
        master = a.master
        if a.cluster:
            from tests.spark.standalone import StandaloneCluster, pyspark_home

            (work / "spark-cluster").mkdir()
            cluster = StandaloneCluster(pyspark_home(), work / "spark-cluster")
            cluster.start()
            master = cluster.url
        spark = session(master, work, cluster, jars)
        results, broker_cpu, load_before = measure(spark, namesrv, rows, a.size, a.repeat, work,
                                                   proc.pid if proc is not None else None,
                                                   kafka.bootstrap if kafka is not None else None,
                                                   kafka.proc.pid if kafka is not None else None)
    finally:
        if spark is not None:
            spark.stop()
        if kafka is not None:
            kafka.stop()
        if cluster is not None:
            cluster.stop()
        if proc is not None:
            proc.stop()
        shutil.rmtree(work, ignore_errors=True)

    load_after = os.getloadavg()
    print(f"rows={rows} value={a.size} B master={'cluster' if a.cluster else master} cpus={os.cpu_count()} "
          f"rounds={a.repeat} load average before {load_before[0]:.2f} {load_before[1]:.2f}, after "
          f"{load_after[0]:.2f} {load_after[1]:.2f}")
    peers = [p for p in ("kafka", "parquet") if f"{p}_write_s" in results]
    print(f"{'':10} {'chronomq rows/s':>16}" + "".join(f" {p + ' rows/s':>16} {'chronomq/' + p:>17}"
                                                     for p in peers) + "   (medians; read1: chronomq "
                                                                              "with .schema('value binary'))")
    # "read1": chronomq's read with .schema("value binary"), against the peers' reads
    for what, theirs in (("write", "write"), ("read", "read"), ("read1", "read")):
        c = [rows / t for t in results[f"chronomq_{'readvalue' if what == 'read1' else what}_s"]]
        line, each = f"{what:10} {statistics.median(c):16,.0f}", ""
        for peer in peers:
            q = [rows / t for t in results[f"{peer}_{theirs}_s"]]
            ratios = [x / y for x, y in zip(c, q, strict=True)]
            line += f" {statistics.median(q):16,.0f} {statistics.median(ratios):16.1%}"
            if a.repeat > 1:
                each += f"  {peer} rounds: " + " ".join(f"{x:.2f}" for x in ratios)
        print(line + each)
    streamed = [p for p in ("chronomq", "kafka") if f"{p}_stream_s" in results]
    for system in streamed:
        rate = statistics.median(rows / t for t in results[f"{system}_stream_s"])
        lat = sorted(results[f"{system}_latency_ms"])
        pick = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan")
        print(f"{system:8} streaming read from earliest: {rate:,.0f} rows/s (query start to the last row); "
              f"produce-to-sink latency over {len(lat):,} rows: p50 {statistics.median(lat):,.0f} ms, "
              f"p99 {pick:,.0f} ms, max {lat[-1]:,.0f} ms")
    if "delayed_late_ms" in results:
        late = sorted(results["delayed_late_ms"])
        print(f"chronomq delayed write: {len(late):,} rows with a {DELAY_MS // 1000} s delay each, delivered "
              f"to a streaming query's sink p50 {statistics.median(late):,.0f} ms, p99 "
              f"{late[min(len(late) - 1, int(len(late) * 0.99))]:,.0f} ms, max {late[-1]:,.0f} ms after "
              f"their deliver time; stored before it: {sum(results['delayed_early']):.0f} (no Kafka "
              "counterpart)")
    for key, secs in broker_cpu.items():
        system, what = key.split("_")[:2]
        sec, wall = statistics.median(secs), statistics.median(results[key])
        print(f"{system} broker CPU during the {system} {what}: {sec:.2f} s of {wall:.2f} s wall, "
              f"{sec / rows * 1e6:.1f} us a message")
    print(json.dumps({"rows": rows, "master": "cluster" if a.cluster else master,
                      **{k: [round(v, 3) for v in vs] for k, vs in results.items()
                         if "latency" not in k and "late_ms" not in k}}))
    return 0


def session(master: str, work: Path, cluster: Any, jars: list[str]) -> Any:
    """The SparkSession with the ``chronomq`` format (and Spark's ``kafka`` format from ``jars``); Spark's
    scratch space under ``work``."""
    from pyspark.sql import SparkSession

    from chronomq.spark import register

    builder = (SparkSession.builder.master(master).appName("chronomq-spark-bench")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2").config("spark.driver.memory", "2g")
               .config("spark.local.dir", str(work / "spark-local")))
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    if cluster is not None:
        # the executors' interpreter, named as docs/spark.md "On a cluster" says; each executor takes its
        # worker's core and memory, and the session waits (bounded) until both executors are there
        builder = (builder.config("spark.pyspark.python", sys.executable)
                   .config("spark.executor.memory", cluster.memory).config("spark.executor.cores", "1")
                   .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
                   .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s"))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def measure(spark: Any, namesrv: str, rows: int, size: int, repeat: int, work: Path, pid: int | None,
            kafka: str | None = None, kafka_pid: int | None = None,
            ) -> tuple[dict[str, list[float]], dict[str, list[float]], tuple[float, ...]]:
    """The warm-up, then ``repeat`` rounds; (wall seconds, broker CPU seconds, load average before). With
    ``kafka`` (its bootstrap servers) each round writes and reads the same rows through Spark's Kafka
    connector too (``acks=all``, a batch read of the whole topic)."""
    from pyspark.sql import functions as F

    load_before = os.getloadavg()
    sc = spark.sparkContext
    where = sorted(set(sc.parallelize(range(4), 4).map(executor_chronomq).collect()))
    executors = sc._jsc.sc().getExecutorMemoryStatus().size() - (not sc.master.startswith("local"))
    print(f"master {sc.master}: {executors} executor(s), commit {commit()}", flush=True)
    for line in where:
        print(f"executor Python: {line}", flush=True)
    topic = f"SparkBench{int(time.time())}"
    pad = size - 12
    df = spark.range(rows).select(
        F.concat(F.lpad(F.col("id").cast("string"), 12, "0"), F.expr(f"repeat('x', {pad})")).alias("value"))
    results: dict[str, list[float]] = {}
    broker_cpu: dict[str, list[float]] = {}

    def timed(key: str, run: Callable[[], Any]) -> Any:
        """run(), its wall time into results[key] and its broker's CPU seconds into broker_cpu[key]."""
        of = kafka_pid if key.startswith("kafka_") else pid if key.startswith("chronomq_") else None
        c0, t0 = cpu_seconds(of), time.perf_counter()
        out = run()
        results.setdefault(key, []).append(time.perf_counter() - t0)
        c1 = cpu_seconds(of)
        if c0 is not None and c1 is not None:
            broker_cpu.setdefault(key, []).append(c1 - c0)
        return out

    # warm up both paths (Python workers, JIT, the topic route) on a few rows
    spark.range(100).select(F.col("id").cast("string").alias("value")).write.format("chronomq") \
        .option("namesrv", namesrv).option("topic", topic + "W").mode("append").save()
    spark.range(100).write.mode("overwrite").parquet(str(work / "warm.parquet"))
    spark.read.format("chronomq").option("namesrv", namesrv).option("subscribe", topic + "W").load().count()
    spark.read.parquet(str(work / "warm.parquet")).count()

    def kafka_writer(name: str, frame: Any) -> Any:
        return (frame.write.format("kafka").option("kafka.bootstrap.servers", kafka).option("topic", name)
                .option("kafka.acks", "all"))

    def kafka_reader(name: str) -> Any:
        return (spark.read.format("kafka").option("kafka.bootstrap.servers", kafka).option("subscribe", name)
                .option("startingOffsets", "earliest").option("endingOffsets", "latest"))

    if kafka is not None:
        kafka_writer(topic + "W", spark.range(100).select(F.col("id").cast("string").alias("value"))).save()
        kafka_reader(topic + "W").load().count()

    agg = [F.count("*").alias("n"), F.sum(F.length("value")).alias("b")]

    def one_round(name: str, parquet: str) -> None:
        timed("chronomq_write_s", lambda: df.write.format("chronomq").option("namesrv", namesrv)
              .option("topic", name).mode("append").save())
        timed("parquet_write_s", lambda: df.write.mode("overwrite").parquet(parquet))
        source = spark.read.format("chronomq").option("namesrv", namesrv).option("subscribe", name)
        r = timed("chronomq_read_s", lambda: source.load().agg(*agg).collect()[0])
        assert r.n == rows, f"read {r.n} rows, wrote {rows}"
        # the same read with a schema of the one column the query uses: only it is built
        v = timed("chronomq_readvalue_s", lambda: source.schema("value binary").load().agg(*agg).collect()[0])
        assert v.n == rows and v.b == r.b, f"value-only read {v.n} rows ({v.b} bytes), {rows} ({r.b})"
        p = timed("parquet_read_s", lambda: spark.read.parquet(parquet).agg(*agg).collect()[0])
        assert p.n == rows and p.b == r.b
        if kafka is not None:
            timed("kafka_write_s", lambda: kafka_writer(name, df).save())
            k = timed("kafka_read_s", lambda: kafka_reader(name).load().agg(*agg).collect()[0])
            assert k.n == rows and k.b == r.b, f"Kafka read {k.n} rows ({k.b} bytes), wrote {rows} ({r.b})"

    def chronomq_stream(name: str, start: str) -> Any:
        return (spark.readStream.format("chronomq").option("namesrv", namesrv).option("subscribe", name)
                .option("startingOffsets", start).load())

    def kafka_stream(name: str, start: str) -> Any:
        return (spark.readStream.format("kafka").option("kafka.bootstrap.servers", kafka)
                .option("subscribe", name).option("startingOffsets", start).load())

    streams: list[tuple[str, Callable[[str, str], Any], Callable[[str, Any], Any], str]] = [
        ("chronomq", chronomq_stream,
         lambda name, frame: frame.write.format("chronomq").option("namesrv", namesrv).option("topic", name)
         .mode("append").save(), "born_timestamp")]
    if kafka is not None:
        streams.append(("kafka", kafka_stream, lambda name, frame: kafka_writer(name, frame).save(),
                        "timestamp"))

    for i in range(repeat):
        one_round(f"{topic}R{i}", str(work / f"bench{i}.parquet"))
        for system, stream, write, ts_col in streams:
            # streaming read of the round's N rows from the earliest offset, into a counting sink
            counted = stream_until(stream(f"{topic}R{i}", "earliest"), rows, work / f"ckpt-{system}-{i}",
                                   lambda _df: None)
            results.setdefault(f"{system}_stream_s", []).append(counted)
            # produce-to-sink latency: rows produced at a steady pace while a query from the latest
            # offset hands each micro-batch to the sink; latency = the batch's sink time - the row's
            # produce time (chronomq's born timestamp, Kafka's CreateTime: both set by the producer)
            live = f"{topic}L{i}{system}"
            lat, _ = stream_latency(stream(live, "latest"), write, live, ts_col, min(rows, 50_000),
                                    work / f"ckptl-{system}-{i}", df)
            results.setdefault(f"{system}_latency_ms", []).extend(lat)
        # chronomq only (Kafka has no per-message delay): rows written with a 5 s delay each, one write,
        # received by a streaming query; lateness = sink time - deliver time, and rows stored early
        parked = f"{topic}D{i}"
        t0 = time.perf_counter()
        late, early = stream_latency(chronomq_stream(parked, "latest"), streams[0][2], parked, "deliver_time",
                                     min(rows, DELAYED_ROWS), work / f"ckptd-{i}",
                                     df.withColumn("delay_ms", F.lit(DELAY_MS)), chunks=1,
                                     early_col="timestamp")
        results.setdefault("delayed_s", []).append(time.perf_counter() - t0)
        results.setdefault("delayed_late_ms", []).extend(late)
        results.setdefault("delayed_early", []).append(early)
    return results, broker_cpu, load_before


def stream_until(frame: Any, rows: int, checkpoint: Path, on_batch: Callable[[Any], None],
                 timeout_s: float = 600) -> float:
    """Run a streaming query of ``frame`` whose sink counts rows (and hands each micro-batch to
    ``on_batch``) until ``rows`` were seen; the seconds it took from the query's start."""
    seen = [0]

    def sink(batch: Any, _batch_id: int) -> None:
        seen[0] += batch.count()
        on_batch(batch)

    t0 = time.perf_counter()
    q = frame.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint)).start()
    try:
        deadline = t0 + timeout_s
        while seen[0] < rows:
            if q.exception() is not None:
                raise RuntimeError(f"the streaming query failed: {q.exception()}")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the streaming query saw {seen[0]} of {rows} rows in {timeout_s:.0f} s")
            time.sleep(0.05)
        return time.perf_counter() - t0
    finally:
        q.stop()


def stream_latency(frame: Any, write: Callable[[str, Any], Any], topic: str, ts_col: str,
                   rows: int, checkpoint: Path, source: Any, chunks: int = 10, pace_s: float = 1.0,
                   timeout_s: float = 600, early_col: str | None = None) -> tuple[list[float], int]:
    """Each row's latency at the sink in ms: ``rows`` rows of ``source`` written to ``topic`` in ``chunks``
    batch writes, one every ``pace_s`` seconds, while a streaming query of ``frame`` (started first, from
    the latest offset) collects, in each micro-batch, the rows' times ``ts_col`` (the produce time, or a
    delayed row's deliver time); a row's latency is the time its micro-batch reached the sink minus that
    time. With ``early_col`` also the count of rows whose ``early_col`` time (a delivered row's store
    time in its topic) is before ``ts_col``'s."""
    from pyspark.sql import functions as F

    lat: list[float] = []
    seen = [0, 0]  # rows, early rows

    def sink(batch: Any, _batch_id: int) -> None:
        cols = [F.unix_millis(F.col(ts_col)).alias("t")]
        if early_col is not None:
            cols.append(F.unix_millis(F.col(early_col)).alias("e"))
        got = batch.select(*cols).collect()
        now = time.time() * 1000
        lat.extend(now - r[0] for r in got)
        seen[0] += len(got)
        if early_col is not None:
            seen[1] += sum(1 for r in got if r[1] < r[0])

    first = source.drop("delay_ms") if "delay_ms" in source.columns else source
    write(topic, first.limit(1))  # the topic exists before the query looks for it (1 row, not counted)
    q = frame.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint)) \
        .trigger(processingTime="0 seconds").start()
    try:
        deadline = time.perf_counter() + timeout_s
        while q.lastProgress is None:  # the query has planned its first batch: "latest" is fixed
            if q.exception() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"the streaming query did not start: {q.exception()}")
            time.sleep(0.05)
        per = rows // chunks
        t0 = time.perf_counter()
        for c in range(chunks):
            write(topic, source.limit(per))
            time.sleep(max(0.0, t0 + (c + 1) * pace_s - time.perf_counter()))
        while seen[0] < per * chunks:
            if q.exception() is not None:
                raise RuntimeError(f"the streaming query failed: {q.exception()}")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the streaming query saw {seen[0]} of {per * chunks} rows")
            time.sleep(0.05)
    finally:
        q.stop()
    return lat, seen[1]


if __name__ == "__main__":
    sys.exit(main())
