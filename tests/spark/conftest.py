"""One local[2] SparkSession for the whole run (starting a JVM costs seconds), with the ``chronomq``
format registered, and a chronomq broker per test module that needs one."""

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


def _java_available() -> str | None:
    import shutil

    if os.environ.get("JAVA_HOME") or shutil.which("java"):
        return None
    return "no Java runtime (java on PATH or JAVA_HOME) for PySpark"


@pytest.fixture(scope="session")
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
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A fresh ``chronomq start`` for a test module (short delay levels so delayed rows arrive fast)."""
    from tests.compat.harness import ChronomqProcess

    p = ChronomqProcess(tmp_path_factory.mktemp("chronomq") / "data",
                        overrides={"messageDelayLevel": "1s 2s 3s 4s"})
    p.start(timeout=60)
    yield p
    p.stop(timeout=30)
