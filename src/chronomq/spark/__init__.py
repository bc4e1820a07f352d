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
]


def register(spark: Any) -> None:
    """Register format ``chronomq`` on a SparkSession."""
    from .source import ChronomqDataSource

    spark.dataSource.register(ChronomqDataSource)


def __getattr__(name: str) -> Any:
    if name == "ChronomqDataSource":
        from .source import ChronomqDataSource

        return ChronomqDataSource
    raise AttributeError(name)
