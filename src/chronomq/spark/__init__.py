"""chronomq.spark: the ``chronomq`` PySpark data source (batch and streaming, read and write).

    from chronomq.spark import register
    register(spark)
    df = (spark.read.format("chronomq").option("namesrv", "127.0.0.1:9876")
          .option("subscribe", "orders").load())
    pending = (spark.read.format("chronomq").option("namesrv", "127.0.0.1:9876")
               .option("mode", "pending").option("topic", "orders").load())   # the timer stores' index

See docs/spark.md. Imports only chronomq.client and chronomq.message from chronomq (ARCHITECTURE.md).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from .offsets import QueueRange, offsets_from_json, offsets_to_json, plan_ranges, rate_limit
from .options import OptionError, parse_pending_options, parse_read_options, parse_write_options
from .schema import PENDING_SCHEMA, READ_SCHEMA, row_uniq_key

__all__ = [
    "PENDING_SCHEMA",
    "READ_SCHEMA",
    "ChronomqDataSource",
    "OptionError",
    "QueueRange",
    "offsets_from_json",
    "offsets_to_json",
    "parse_pending_options",
    "parse_read_options",
    "parse_write_options",
    "plan_ranges",
    "rate_limit",
    "register",
    "row_uniq_key",
    "worker_python",
]

log = logging.getLogger("chronomq.spark")


def worker_python(spark: Any) -> str:
    """Choose the interpreter Spark starts this data source's Python workers with, and say which.

    Spark uses ``PYSPARK_PYTHON`` as it was when the session started, else ``python3`` from PATH, which
    is usually not the environment that has chronomq installed (the worker then fails with
    ``ModuleNotFoundError: No module named 'chronomq'``). The rule here:
    - ``PYSPARK_PYTHON``, or the ``spark.pyspark.python`` setting, when the user gave one;
    - otherwise, on a ``local`` master, the interpreter running this driver (the workers run on this
      machine and this interpreter has chronomq);
    - otherwise (a cluster and nothing set), Spark's own choice, with a warning that says what to set.
    """
    sc = spark.sparkContext
    conf_python = sc.getConf().get("spark.pyspark.python", None)
    if os.environ.get("PYSPARK_PYTHON"):
        return str(sc.pythonExec)
    if conf_python:
        sc.pythonExec = conf_python
        return str(conf_python)
    master = str(sc.master)
    if master.startswith("local"):
        sc.pythonExec = sys.executable
        return sys.executable
    log.warning("chronomq.spark: the Python workers of master %s will run %r; unless every executor has "
                "chronomq installed for it, set PYSPARK_PYTHON (or spark.pyspark.python) to an interpreter "
                "that has, or ship the package with --py-files (docs/spark.md, 'On a cluster')",
                master, sc.pythonExec)
    return str(sc.pythonExec)


def register(spark: Any) -> None:
    """Register format ``chronomq`` on a SparkSession (its workers' interpreter: ``worker_python``)."""
    from .source import ChronomqDataSource

    worker_python(spark)
    spark.dataSource.register(ChronomqDataSource)


def __getattr__(name: str) -> Any:
    if name == "ChronomqDataSource":
        from .source import ChronomqDataSource

        return ChronomqDataSource
    raise AttributeError(name)
