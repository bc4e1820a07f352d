"""The ``chronomq`` PySpark data source (Python Data Source API, PySpark 4.x): batch and streaming reads
and writes. Register it with ``chronomq.spark.register(spark)`` then use ``format("chronomq")``."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from .io import ChronomqSparkError, Metadata, ReadSettings, key_of, read_pending, read_range, write_rows
from .offsets import QueueKey, QueueRange, offsets_from_json, offsets_to_json, plan_ranges, rate_limit
from .options import (
    EARLIEST,
    LATEST,
    MODE_PENDING,
    OptionError,
    PendingOptions,
    parse_pending_options,
    parse_read_options,
    parse_write_options,
    read_mode,
)
from .schema import (
    PENDING_SCHEMA,
    READ_SCHEMA,
    WriteSchemaError,
    arrow_schema,
    read_columns,
    validate_write_schema,
)

if TYPE_CHECKING:
    from pyspark import TaskContext

log = logging.getLogger("chronomq.spark")


class RangePartition(InputPartition):
    """One Spark partition: a range of one queue (picklable)."""

    def __init__(self, qr: QueueRange, settings: ReadSettings) -> None:
        super().__init__(qr)
        self.range = qr
        self.settings = settings


class PendingPartition(InputPartition):
    """mode=pending: the one partition that pages through the pending index of every broker."""

    def __init__(self, opts: PendingOptions) -> None:
        super().__init__(None)
        self.opts = opts


def _columns(schema: StructType, full: StructType = READ_SCHEMA) -> StructType:
    try:
        return read_columns(schema, full)
    except ValueError as e:
        raise OptionError(str(e)) from None


class ChronomqDataSource(DataSource):
    """Options: see chronomq.spark.options (Kafka-source names) and docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return "chronomq"

    def schema(self) -> StructType:
        return PENDING_SCHEMA if read_mode(self.options) == MODE_PENDING else READ_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        if read_mode(self.options) == MODE_PENDING:
            return ChronomqPendingReader(self.options, _columns(schema, PENDING_SCHEMA))
        return ChronomqBatchReader(self.options, _columns(schema))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        if read_mode(self.options) == MODE_PENDING:
            parse_pending_options(self.options, streaming=True)  # raises: batch only
        return ChronomqStreamReader(self.options, _columns(schema))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:
        opts = parse_write_options(self.options)
        validate_write_schema(schema, opts.topic)
        if overwrite:
            raise WriteSchemaError("a message queue cannot be overwritten: use mode('append')")
        return ChronomqBatchWriter(opts)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamArrowWriter:
        opts = parse_write_options(self.options)
        validate_write_schema(schema, opts.topic)
        return ChronomqStreamWriter(opts)


# --- batch read ---------------------------------------------------------------------------------------------
class ChronomqBatchReader(DataSourceReader):
    def __init__(self, options: Any, columns: StructType = READ_SCHEMA) -> None:
        self.opts = parse_read_options(options, streaming=False)
        self.columns = columns
        meta = Metadata(self.opts)
        try:
            queues = meta.queues(missing_ok=False)
            bounds = meta.bounds(queues)
            start = meta.resolve(self.opts.starting, queues, bounds, EARLIEST, "startingOffsets",
                                 self.opts.starting_timestamp)
            end = meta.resolve(self.opts.ending, queues, bounds, LATEST, "endingOffsets")
            for k in start:
                if end[k] < start[k]:
                    raise OptionError(f"endingOffsets {end[k]} is before startingOffsets {start[k]} for "
                                      f"{k[0]}/{k[1]}/{k[2]}")
            settings = ReadSettings.of(self.opts, meta.levels_ms())
        finally:
            meta.close()
        self.ranges = plan_ranges(start, end, self.opts.min_partitions)
        self.settings = settings

    def partitions(self) -> list[InputPartition]:
        return [RangePartition(r, self.settings) for r in self.ranges]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if not isinstance(partition, RangePartition):
            return iter(())  # Spark plans one empty partition when there is nothing to read
        return read_range(partition.settings, partition.range, arrow_schema(self.columns))


# --- batch read, mode=pending ----------------------------------------------------------------------------
class ChronomqPendingReader(DataSourceReader):
    """The messages waiting in the brokers' timer stores (PENDING_SCHEMA), one partition."""

    def __init__(self, options: Any, columns: StructType = PENDING_SCHEMA) -> None:
        self.opts = parse_pending_options(options, streaming=False)
        self.columns = columns

    def partitions(self) -> list[InputPartition]:
        return [PendingPartition(self.opts)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        opts = partition.opts if isinstance(partition, PendingPartition) else self.opts
        return read_pending(opts, arrow_schema(self.columns))


# --- streaming read ---------------------------------------------------------------------------------------
class ChronomqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets (in Spark's checkpoint) are ``{"topic": {"broker": {"queueId": next offset}}}``.
    New queues (or topics matching the pattern) join with an empty range at their earliest offset, and
    are read from the next micro-batch on."""

    def __init__(self, options: Any, columns: StructType = READ_SCHEMA) -> None:
        self.opts = parse_read_options(options, streaming=True)
        self.columns = columns
        self._meta: Metadata | None = None
        self._settings: ReadSettings | None = None
        self._target: dict[QueueKey, int] | None = None  # Trigger.AvailableNow

    def _m(self) -> Metadata:
        if self._meta is None:
            self._meta = Metadata(self.opts)
        return self._meta

    def settings(self) -> ReadSettings:
        if self._settings is None:
            self._settings = ReadSettings.of(self.opts, self._m().levels_ms())
        return self._settings

    def initialOffset(self) -> dict:
        meta = self._m()
        queues = meta.queues(missing_ok=True)
        bounds = meta.bounds(queues)
        start = meta.resolve(self.opts.starting, queues, bounds, EARLIEST, "startingOffsets",
                             self.opts.starting_timestamp)
        return offsets_to_json(start)

    def _latest(self, start: dict[QueueKey, int]) -> dict[QueueKey, int]:
        meta = self._m()
        queues = meta.queues(missing_ok=True)
        bounds = meta.bounds(queues)
        latest = dict(start)  # a queue that vanished from the route keeps its position
        for q in queues:
            k = key_of(q)
            lo, hi = bounds[k]
            latest[k] = hi if k in start else lo  # a new queue joins at its earliest offset
        return latest

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin = offsets_from_json(start)
        latest = self._latest(begin)
        if self._target is not None:
            latest = {k: min(v, self._target.get(k, v)) if k in begin else v for k, v in latest.items()}
        if isinstance(limit, ReadMaxRows):
            latest = rate_limit(begin, latest, limit.max_rows)
        elif not isinstance(limit, ReadAllAvailable):
            log.warning("chronomq: read limit %r is not supported; reading all available", limit)
        return offsets_to_json(latest)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_offsets_per_trigger:
            return ReadMaxRows(self.opts.max_offsets_per_trigger)
        return ReadAllAvailable()

    def reportLatestOffset(self) -> dict | None:
        return None

    def prepareForTriggerAvailableNow(self) -> None:
        meta = self._m()
        queues = meta.queues(missing_ok=True)
        self._target = {k: hi for k, (lo, hi) in meta.bounds(queues).items()}

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        begin = offsets_from_json(start)
        stop = offsets_from_json(end)
        # a queue new in this batch has an empty range (it joins at its earliest offset)
        begin = {k: begin.get(k, v) for k, v in stop.items()}
        settings = self.settings()
        return [RangePartition(r, settings) for r in plan_ranges(begin, stop, self.opts.min_partitions)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, RangePartition)
        return read_range(partition.settings, partition.range, arrow_schema(self.columns))

    def commit(self, end: dict) -> None:
        """Nothing to do: the offsets live in Spark's checkpoint, not in a broker consumer group."""

    def stop(self) -> None:
        if self._meta is not None:
            self._meta.close()
            self._meta = None


# --- writing --------------------------------------------------------------------------------------------
@dataclass
class ChronomqCommitMessage(WriterCommitMessage):
    partition: int
    rows: int
    topics: dict[str, int] = field(default_factory=dict)


def _task_ids() -> tuple[int, TaskContext | None]:
    from pyspark import TaskContext

    task = TaskContext.get()
    if task is None:  # not inside a Spark task (direct call in a test)
        return 0, None
    return task.partitionId(), task


class ChronomqBatchWriter(DataSourceArrowWriter):
    def __init__(self, opts: Any) -> None:
        self.opts = opts
        # part of every row's UNIQ_KEY: a retried task re-sends the same ids; give 'writeId' to keep them
        # across re-runs of the whole job
        self.write_id = opts.write_id or uuid.uuid4().hex

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ChronomqCommitMessage:
        pid, _ = _task_ids()
        stats = write_rows(self.opts, iterator, self.write_id, 0, pid)
        return ChronomqCommitMessage(pid, stats.rows, stats.topics)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        rows = sum(m.rows for m in messages if isinstance(m, ChronomqCommitMessage))
        log.info("chronomq: write %s committed: %d rows", self.write_id, rows)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        rows = sum(m.rows for m in messages if isinstance(m, ChronomqCommitMessage))
        log.warning("chronomq: write %s aborted after %d rows were sent by successful tasks (messages cannot "
                    "be taken back; their UNIQ_KEYs identify them)", self.write_id, rows)


class ChronomqStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, opts: Any) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ChronomqCommitMessage:
        pid, task = _task_ids()
        query_id = (task.getLocalProperty("sql.streaming.queryId") if task is not None else None) or "unknown"
        raw_batch = task.getLocalProperty("streaming.sql.batchId") if task is not None else None
        try:
            batch_id = int(raw_batch) if raw_batch is not None else 0
        except ValueError:
            raise ChronomqSparkError(f"unexpected streaming batch id {raw_batch!r}") from None
        stats = write_rows(self.opts, iterator, query_id, batch_id, pid)
        return ChronomqCommitMessage(pid, stats.rows, stats.topics)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        rows = sum(m.rows for m in messages if isinstance(m, ChronomqCommitMessage))
        log.info("chronomq: micro-batch %d committed: %d rows", batchId, rows)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning("chronomq: micro-batch %d aborted; Spark re-runs it (same UNIQ_KEYs)", batchId)
