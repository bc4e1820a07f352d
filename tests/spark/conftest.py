"""One local[2] SparkSession for the Spark tests of a run (starting a JVM costs seconds), with the
``chronomq`` format registered, and one chronomq broker for them."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Executors must run the same interpreter (and so see the same chronomq and pyarrow) as the tests.
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
_SRC = str(Path(__file__).resolve().parents[2] / "src")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_SRC, os.environ.get("PYTHONPATH")]))
# The drivers' JVMs (this session's, and those of every Spark process a test starts: spark-submit reads
# SPARK_SUBMIT_OPTS) and the standalone cluster's executors (QUICK_JVM_OPTIONS as their extraJavaOptions)
# run with the serial collector and the client compiler only: the same results for about a quarter less
# CPU on test-sized jobs (measured: 95 -> 72 CPU-s for the batch, stream and example modules, the same wall
# time), and the suite's 2-core machine is CPU bound. Long-lived servers keep both compilers: there C1-only
# code costs more than it saves (measured on the reference RocketMQ).
QUICK_JVM_OPTIONS = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"
os.environ.setdefault("SPARK_SUBMIT_OPTS", QUICK_JVM_OPTIONS)


def _java_available() -> str | None:
    import shutil

    if os.environ.get("JAVA_HOME") or shutil.which("java"):
        return None
    return "no Java runtime (java on PATH or JAVA_HOME) for PySpark"


# Package scope: the session and the broker are made once (the modules that take the session run one after
# the other, on one xdist worker) and stopped when that worker's run leaves tests/spark, so that their JVM
# and process do not idle beside the rest of the suite.
@pytest.fixture(scope="package")
def spark() -> Iterator[object]:
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install -e '.[spark]')")
    reason = _java_available()
    if reason:
        pytest.skip(reason)
    from pyspark.sql import SparkSession

    from chronomq.spark import register

    session = (SparkSession.builder.master("local[2]").appName("chronomq-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.driver.memory", "1g")
               .config("spark.python.worker.reuse", "true")
               # a loaded CI box can take longer than the default 15 s to start a Python worker
               .config("spark.python.authenticate.socketTimeout", "120s")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()


@pytest.fixture(scope="package")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One ``chronomq start`` for the Spark tests (short delay levels so delayed rows arrive fast); every test
    uses its own topics."""
    from tests.compat.harness import ChronomqProcess

    p = ChronomqProcess(tmp_path_factory.mktemp("chronomq") / "data",
                        overrides={"messageDelayLevel": "1s 2s 3s 4s"})
    p.start(timeout=60)
    yield p
    p.stop(timeout=30)


SPARK_WORKER_FLAKE = "Python worker failed to connect back"


def process_all(start, query=None, attempts: int = 3):  # type: ignore[no-untyped-def]
    """``query.processAllAvailable()`` for a query made by ``start()``; returns the query.

    Spark starts the Python worker that plans a Python streaming source with a fixed 10 s connect-back
    timeout (PythonWorkerFactory.createSimpleWorker); on an overloaded machine the worker's imports can
    take longer and the query dies with "Python worker failed to connect back" before reading anything.
    That one infrastructure error is retried by restarting the query from its checkpoint (which is
    exactly what a restarted production query does); any other failure is raised."""
    q = query if query is not None else start()
    for attempt in range(attempts):
        try:
            q.processAllAvailable()
            return q
        except Exception as e:
            if SPARK_WORKER_FLAKE not in str(e) or attempt + 1 == attempts:
                q.stop()
                raise
            q.stop()
            q = start()
    return q
