"""Talking to chronomq from Spark: queue discovery and offset resolution (driver side), reading one
queue range into Arrow batches and writing rows through a batched async producer (executor side).

Everything here goes through chronomq.client's blocking facade (one background event-loop thread per
Python process, shared), so it works the same in Spark's planner worker, its executors and tests.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyarrow as pa

from chronomq.client import (
    Admin,
    BrokerError,
    ClientError,
    InvalidMessage,
    Message,
    MessageQueue,
    NoRouteError,
    NotSupported,
    Producer,
    PullStatus,
    SimpleConsumer,
    encode_rows,
)
from chronomq.client.model import record_columns, tag_set
from chronomq.message import DEFAULT_TOPIC, SCHEDULE_TOPIC, MessageFormatError

from .offsets import QueueKey, QueueRange
from .options import EARLIEST, LATEST, OffsetSpec, PendingOptions, ReadOptions, WriteOptions
from .schema import (
    DEFAULT_LEVELS_MS,
    pending_to_batch,
    row_uniq_keys,
    select_records,
    stored_to_batch,
    to_epoch_ms,
)

log = logging.getLogger("chronomq.spark")
T = TypeVar("T")
MESSAGE_ILLEGAL = 13  # RocketMQ ResponseCode.MESSAGE_ILLEGAL

READER_GROUP = "chronomq_spark_reader"
# Topics a subscribePattern never matches (name them with 'subscribe' to read them anyway).
SYSTEM_TOPICS = {SCHEDULE_TOPIC, DEFAULT_TOPIC, "OFFSET_MOVED_EVENT", "SELF_TEST_TOPIC", "BenchmarkTest",
                 "TRANS_CHECK_MAX_TIME_TOPIC", "RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRACE_TOPIC"}


class ChronomqSparkError(RuntimeError):
    """A failure of the chronomq data source that the user must act on (the message says what to do)."""


class DataLossError(ChronomqSparkError):
    """Requested offsets are no longer on the broker (cleaned away) and failOnDataLoss is true."""


def key_of(mq: MessageQueue) -> QueueKey:
    return (mq.topic, mq.broker_name, mq.queue_id)


def _run(proxy: Any, make: Callable[[Any], Awaitable[T]], timeout: float | None = None) -> T:
    """Run ``make(async_client)`` on the client's loop thread and wait for it."""
    fut = asyncio.run_coroutine_threadsafe(_call(make, proxy.async_client), proxy.loop)
    return fut.result(timeout)


async def _call(make: Callable[[Any], Awaitable[T]], client: Any) -> T:
    return await make(client)


# --- driver side: queues and offsets ----------------------------------------------------------------------
class Metadata:
    """Queue discovery and offset lookups for the driver (batch planning, the stream reader)."""

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self._consumer: Any = None
        self._admin: Any = None

    def _c(self) -> Any:
        if self._consumer is None:
            self._consumer = SimpleConsumer(READER_GROUP, self.opts.namesrv,
                                            request_timeout=self.opts.request_timeout_s,
                                            credentials=self.opts.credentials, tls=self.opts.tls).blocking()
        return self._consumer

    def _a(self) -> Any:
        if self._admin is None:
            self._admin = Admin(self.opts.namesrv, request_timeout=self.opts.request_timeout_s,
                                credentials=self.opts.credentials, tls=self.opts.tls).blocking()
        return self._admin

    def close(self) -> None:
        for proxy in (self._consumer, self._admin):
            if proxy is not None:
                try:
                    proxy.close()
                except Exception as e:  # closing must not hide the real outcome
                    log.debug("closing a chronomq client failed: %s", e)
        self._consumer = self._admin = None

    # topics and queues
    def topics(self) -> list[str]:
        named = self.opts.named_topics()
        if named is not None:
            return named
        assert self.opts.subscribe_pattern is not None
        rx = re.compile(self.opts.subscribe_pattern)
        admin = self._a()
        names = set(admin.list_topics())
        try:  # brokers register topics named after their cluster and themselves, as in RocketMQ
            hidden = set(admin.brokers())
            hidden.update(admin.cluster())
        except ClientError:
            hidden = set()
        return sorted(t for t in names if rx.fullmatch(t) and t not in SYSTEM_TOPICS and t not in hidden
                      and not t.startswith("rmq_sys_"))

    def queues(self, *, missing_ok: bool) -> list[MessageQueue]:
        c = self._c()
        out: list[MessageQueue] = []
        for topic in self.topics():
            try:
                qs = c.queues(topic, refresh=True)
            except NoRouteError as e:
                if missing_ok or self.opts.subscribe_pattern is not None:
                    log.info("chronomq: topic %s has no route yet (%s)", topic, e)
                    continue
                raise ChronomqSparkError(f"cannot read topic {topic!r}: {e}") from None
            if self.opts.assign is not None:
                wanted = self.opts.assign.get(topic, {})
                have = {(q.broker_name, q.queue_id) for q in qs}
                missing = sorted((b, q) for b, ids in wanted.items() for q in ids if (b, q) not in have)
                if missing and not missing_ok:
                    raise ChronomqSparkError(f"option 'assign': topic {topic!r} has no queue(s) {missing}; "
                                             f"it has {sorted(have)}")
                qs = [q for q in qs if q.queue_id in wanted.get(q.broker_name, ())]
            out.extend(qs)
        return sorted(out)

    def bounds(self, queues: Sequence[MessageQueue]) -> dict[QueueKey, tuple[int, int]]:
        """(min offset, max offset) of every queue, asked concurrently."""
        if not queues:
            return {}

        async def ask(c: Any) -> list[tuple[int, int]]:
            async def one(q: MessageQueue) -> tuple[int, int]:
                lo, hi = await asyncio.gather(c.min_offset(q), c.max_offset(q))
                return lo, hi
            return await asyncio.gather(*(one(q) for q in queues))

        res = _run(self._c(), ask)
        return {key_of(q): r for q, r in zip(queues, res, strict=True)}

    def offsets_for_time(self, queues: Sequence[MessageQueue], ts: int) -> dict[QueueKey, int]:
        async def ask(c: Any) -> list[int]:
            return await asyncio.gather(*(c.offset_for_timestamp(q, ts) for q in queues))

        res = _run(self._c(), ask) if queues else []
        return {key_of(q): int(r) for q, r in zip(queues, res, strict=True)}

    def levels_ms(self) -> list[int]:
        """The broker's delay-level table (chronomq's stats request), else RocketMQ's default table."""
        try:
            stats = self._a().delay_stats()
            for s in stats.values():
                levels = sorted(s.get("levels") or [], key=lambda x: x["level"])
                if levels:
                    return [int(x["delay_ms"]) for x in levels]
        except Exception as e:
            log.debug("chronomq: delay stats unavailable (%s); using the default level table", e)
        return list(DEFAULT_LEVELS_MS)

    # resolving an offset spec against the broker
    def resolve(self, spec: OffsetSpec, queues: Sequence[MessageQueue],
                bounds: dict[QueueKey, tuple[int, int]], default: int, name: str,
                timestamp: int | None = None) -> dict[QueueKey, int]:
        """Concrete offsets per queue. Queues a JSON spec does not name get ``default`` (-2/-1).
        Offsets below a queue's min are data loss (failOnDataLoss), above its max are clamped."""
        by_time = self.offsets_for_time(queues, timestamp) if timestamp is not None else {}
        out: dict[QueueKey, int] = {}
        for q in queues:
            k = key_of(q)
            lo, hi = bounds[k]
            if timestamp is not None:
                out[k] = min(max(by_time[k], lo), hi)
                continue
            want = spec.for_queue(*k)
            if want is None:
                want = default
            if want == EARLIEST:
                out[k] = lo
            elif want == LATEST:
                out[k] = hi
            elif want < lo:
                msg = (f"{name}: {q} offset {want} is no longer available (the oldest retained offset is "
                       f"{lo}: older messages were cleaned)")
                if self.opts.fail_on_data_loss:
                    raise DataLossError(msg + "; set failOnDataLoss=false to start at the oldest retained "
                                        "message instead")
                log.warning("chronomq: %s; starting at %d (failOnDataLoss=false)", msg, lo)
                out[k] = lo
            elif want > hi:
                log.warning("chronomq: %s: %s offset %d is beyond the end of the queue (%d); using %d",
                            name, q, want, hi, hi)
                out[k] = hi
            else:
                out[k] = want
        return out


# --- executor side: reading one range ----------------------------------------------------------------------
@dataclass(frozen=True)
class ReadSettings:
    """What an executor needs to read (picklable, small)."""

    namesrv: str
    tag_expression: str
    fail_on_data_loss: bool
    pull_batch_size: int
    request_timeout_s: float
    levels_ms: tuple[int, ...] = field(default_factory=lambda: tuple(DEFAULT_LEVELS_MS))
    rows_per_batch: int = 4096
    credentials: tuple[str, str] | None = field(default=None, repr=False)  # never in a repr
    tls: bool | str | None = None  # the clients' tls=: True, or a CA file's path (the same on executors)

    @classmethod
    def of(cls, opts: ReadOptions, levels_ms: Sequence[int]) -> ReadSettings:
        return cls(opts.namesrv, opts.tag_expression, opts.fail_on_data_loss, opts.pull_batch_size,
                   opts.request_timeout_s, tuple(levels_ms), credentials=opts.credentials, tls=opts.tls)


def read_range(settings: ReadSettings, qr: QueueRange, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """Every message of ``[qr.start, qr.end)`` (matching the tag expression) as Arrow batches.

    The pulls and the conversion run on the client's event-loop thread (``range_batches``); this thread
    only takes the finished batches, one hand-over per batch instead of one per pull."""
    if qr.end <= qr.start:
        return
    proxy = SimpleConsumer(READER_GROUP, settings.namesrv, request_timeout=settings.request_timeout_s,
                           credentials=settings.credentials, tls=settings.tls).blocking()
    batches = range_batches(proxy.async_client, settings, qr, schema)
    try:
        while True:
            # each pull has the client's request timeout; a batch is at most this many pulls
            pulls = -(-settings.rows_per_batch // settings.pull_batch_size) + 1
            batch = _run(proxy, lambda _c: _next_or_none(batches), (settings.request_timeout_s + 30) * pulls)
            if batch is None:
                return
            yield batch
    finally:
        try:
            _run(proxy, lambda _c: batches.aclose(), settings.request_timeout_s + 30)
        finally:
            proxy.close()


async def _next_or_none(it: AsyncIterator[T]) -> T | None:
    try:
        return await anext(it)
    except StopAsyncIteration:
        return None


PULLS_IN_FLIGHT = 3  # pulls of one queue range outstanding at once (without a tag filter)
# a broker that answers fewer messages a pull than asked (RocketMQ's maxTransferCountOnMessageInMemory, 32
# by default) gets more pulls at once, up to this many, so as many messages are on their way
MAX_PULLS_IN_FLIGHT = 24
BATCH_BYTES = 64 << 20  # a batch ends at rows_per_batch rows or at this many bytes of answers, if sooner
# a batched send ends at batchSize rows or once its bodies reach this many bytes, if sooner: large rows
# then still go in requests under the broker's message limit (4 MiB by default; maxMessageSize)
SEND_BYTES = 1 << 20


async def range_batches(consumer: Any, settings: ReadSettings, qr: QueueRange,
                        schema: pa.Schema) -> AsyncGenerator[pa.RecordBatch, None]:
    """``read_range``'s batches, on the event loop. Without a tag filter, up to PULLS_IN_FLIGHT pulls of
    consecutive offset windows are outstanding while an answer is converted; an answer that ends before
    its window (a broker that returns fewer a pull, a gap) drops the pulls after it and the next ones start
    where it ended; a broker that answers fewer than asked gets that many a pull and more pulls at once.
    With a tag filter the broker decides where an answer ends: one pull at a time."""
    mq = MessageQueue(qr.topic, qr.broker, qr.queue_id)
    tags = tag_set(settings.tag_expression)
    depth = PULLS_IN_FLIGHT if tags is None else 1
    window = settings.pull_batch_size
    inflight: collections.deque[tuple[int, int, asyncio.Task[Any]]] = collections.deque()
    planned = qr.start
    pending: list[tuple[bytes, int, int]] = []  # answers not converted yet: body, first and end offset
    npending = nbytes = 0

    def replan(at: int) -> None:
        nonlocal planned
        for _, _, t in inflight:
            t.cancel()
        inflight.clear()
        planned = at

    def fill() -> None:
        nonlocal planned
        while len(inflight) < depth and planned < qr.end:
            n = min(window, qr.end - planned)
            inflight.append((planned, n, asyncio.ensure_future(
                consumer.pull(mq, planned, n, expression=settings.tag_expression, raw="bytes", bulk=True))))
            planned += n

    def undecodable(e: Exception, frm: int, to: int) -> ChronomqSparkError:
        return ChronomqSparkError(f"reading {mq} at offsets {frm}..{to - 1}: the broker returned an "
                                  f"undecodable message body: {e}")

    def convert(parts: list[tuple[bytes, int, int]]) -> pa.RecordBatch:
        try:
            return stored_to_batch(parts, qr.topic, qr.broker, qr.queue_id, settings.levels_ms, schema, tags)
        except MessageFormatError as e:
            raise undecodable(e, parts[0][1], parts[-1][2]) from None

    try:
        fill()
        while inflight:
            offset, count, task = inflight.popleft()
            res = await task
            part: tuple[bytes, int, int] | None = None
            if res.status == PullStatus.FOUND and res.body is not None:
                nxt = max(res.next_offset, offset + 1)
                part = (res.body, max(qr.start, offset), min(qr.end, nxt))
                if res.next_offset <= offset:  # rare: the answer must hold a wanted record to move on
                    try:
                        recs = select_records(record_columns(res.body), part[1], part[2], tags)
                    except MessageFormatError as e:
                        raise undecodable(e, part[1], part[2]) from None
                    if not recs:
                        raise ChronomqSparkError(f"reading {mq}: the broker made no progress at offset "
                                                 f"{offset} (next offset {res.next_offset})")
            elif res.status == PullStatus.NO_MATCHED_MSG:
                nxt = res.next_offset
                if nxt <= offset:
                    raise ChronomqSparkError(f"reading {mq}: the broker made no progress at offset {offset} "
                                             f"(next offset {nxt})")
            elif res.status == PullStatus.OFFSET_ILLEGAL and offset < res.min_offset:
                nxt = _lost(settings, mq, offset, min(res.min_offset, qr.end), qr.end)
            elif offset < res.min_offset:
                # NO_NEW_MSG or an offset beyond the end: the planned messages are not there (any more)
                nxt = _lost(settings, mq, offset, min(res.min_offset, qr.end), qr.end)
            else:
                _lost(settings, mq, offset, qr.end, qr.end, beyond=res.max_offset)
                nxt = qr.end
            if nxt != offset + count:
                if res.status == PullStatus.FOUND and offset < nxt < offset + count:
                    window = nxt - offset  # this broker answers at most that many a pull
                    if tags is None:  # as many messages in flight as PULLS_IN_FLIGHT full-size pulls
                        depth = min(MAX_PULLS_IN_FLIGHT,
                                    PULLS_IN_FLIGHT * -(-settings.pull_batch_size // window))
                replan(min(nxt, qr.end))
            fill()
            await asyncio.sleep(0)  # let the new pulls send their requests before this answer is converted
            if part is not None and part[1] < part[2]:
                pending.append(part)
                npending += part[2] - part[1]  # at most that many rows (fewer with a tag filter)
                nbytes += len(part[0])
                if npending >= settings.rows_per_batch or nbytes >= BATCH_BYTES:
                    batch = convert(pending)
                    pending, npending, nbytes = [], 0, 0
                    if batch.num_rows:
                        yield batch
        if pending:
            batch = convert(pending)
            if batch.num_rows:
                yield batch
    finally:
        replan(qr.end)


def _lost(settings: ReadSettings, mq: MessageQueue, frm: int, to: int, end: int,
          beyond: int | None = None) -> int:
    if beyond is not None:
        what = (f"{mq}: offsets {frm}..{end - 1} were planned but the queue now ends at {beyond} "
                "(the broker lost or truncated them)")
    else:
        what = f"{mq}: offsets {frm}..{to - 1} were cleaned away before they could be read"
    if settings.fail_on_data_loss:
        raise DataLossError(f"data loss: {what}. Set failOnDataLoss=false to skip them (they are logged)")
    log.warning("chronomq: data loss skipped (failOnDataLoss=false): %s", what)
    return to


# --- mode=pending: the timer stores' pending index ----------------------------------------------------------
def read_pending(opts: PendingOptions, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """Every pending message matching the filters, one Arrow batch per page, paging through all master
    brokers with Admin.pending's cursor (ordered by broker, then deliver time)."""
    proxy = Admin(opts.namesrv, request_timeout=opts.request_timeout_s,
                  credentials=opts.credentials, tls=opts.tls).blocking()
    seen: set[str] = set()
    cursor: str | None = None
    try:
        while True:
            try:
                page = proxy.pending(topic=opts.topic, key=opts.key, tag=opts.tag,
                                     start=opts.deliver_from_ms, end=opts.deliver_to_ms,
                                     limit=opts.page_size, cursor=cursor)
            except NotSupported as e:
                raise ChronomqSparkError(f"mode 'pending': a broker does not keep a pending index (it is "
                                         f"not chronomq, or too old to have a timer store): {e}") from e
            except (ClientError, ValueError) as e:
                raise ChronomqSparkError(f"mode 'pending': listing the pending messages failed: {e}") from e
            if page.items:
                yield pending_to_batch(page.items, schema)
            cursor = page.next_cursor
            if cursor is None:
                return
            if cursor in seen:  # bounded: a broker that hands out the same cursor again would loop forever
                raise ChronomqSparkError(f"mode 'pending': the brokers returned cursor {cursor!r} twice; "
                                         "the listing makes no progress")
            seen.add(cursor)
    finally:
        proxy.close()


# --- executor side: writing ---------------------------------------------------------------------------------
@dataclass
class WriteStats:
    rows: int = 0
    topics: dict[str, int] = field(default_factory=dict)


def _column(batch: pa.RecordBatch, name: str, as_bytes: bool = False) -> list[Any] | None:
    """A column as a Python list; ``as_bytes``: a string column comes as its UTF-8 bytes (a cast in Arrow,
    instead of decoding every value to str and encoding it again)."""
    idx = batch.schema.get_field_index(name)
    if idx < 0:
        return None
    col = batch.column(idx)
    if as_bytes and pa.types.is_string(col.type):
        col = col.cast(pa.binary())
    return col.to_pylist()


@dataclass
class RowFields:
    """The sendable fields of a batch's rows, column by column (row i of each list is row i)."""

    topics: list[str]
    bodies: list[bytes]
    keys: list[str | None]  # KEYS as sent: the key and the keys, space separated
    tags: list[str | None] | None
    properties: list[list[tuple[str, str | None]] | None] | None


def row_fields(batch: pa.RecordBatch, topic_option: str | None) -> RowFields:
    """Arrow rows -> their message fields. Raises ValueError with the row's problem."""
    n = batch.num_rows
    values = _column(batch, "value", as_bytes=True) or [None] * n
    topics = _column(batch, "topic")
    key = _column(batch, "key")
    keys = _column(batch, "keys")
    for i, v in enumerate(values):
        if v is None:
            raise ValueError(f"row {i}: 'value' is null (a message needs a body)")
    if topic_option:
        row_topics = [topic_option] * n
    else:
        row_topics = topics if topics is not None else [""] * n  # "": no topic, refused below
        for i, t in enumerate(row_topics):
            if not t:
                raise ValueError(f"row {i}: no topic (the 'topic' column is null and no 'topic' option is "
                                 "set)")
    keys_text: list[str | None] = [None] * n
    if key is not None or keys is not None:
        for i in range(n):
            ks: list[str] = []
            if key is not None and key[i] is not None:
                k = key[i]
                ks.append(k.decode() if isinstance(k, bytes | bytearray) else str(k))
            if keys is not None and keys[i] is not None:
                kv = keys[i]
                more = kv.split(" ") if isinstance(kv, str) else [str(x) for x in kv if x is not None]
                ks.extend(x for x in more if x and x not in ks)
            keys_text[i] = " ".join(x for x in ks if x) or None
    return RowFields(row_topics, values, keys_text, _column(batch, "tags"),
                     _column(batch, "properties"))


def row_delays(batch: pa.RecordBatch) -> list[dict[str, Any]] | None:
    """Each row's deliver-time arguments for Message (delay_level / delay / deliver_at), or None when no
    row of the batch has one."""
    delay_level = _column(batch, "delay_level")
    delay_ms = _column(batch, "delay_ms")
    deliver_at = _column(batch, "deliver_at")
    if not ((delay_level is not None and any(delay_level))
            or any(c is not None and any(v is not None for v in c) for c in (delay_ms, deliver_at))):
        return None
    out: list[dict[str, Any]] = []
    for i in range(batch.num_rows):
        kwargs: dict[str, Any] = {}
        if delay_level is not None and delay_level[i]:
            kwargs["delay_level"] = int(delay_level[i])
        if delay_ms is not None and delay_ms[i] is not None:
            kwargs["delay"] = int(delay_ms[i]) / 1000.0
        if deliver_at is not None and deliver_at[i] is not None:
            kwargs["deliver_at"] = to_epoch_ms(deliver_at[i])
        out.append(kwargs)
    return out


def batch_to_messages(batch: pa.RecordBatch, topic_option: str | None) -> list[tuple[Message, bool]]:
    """Arrow rows -> (client Message, is_delayed). Raises ValueError with the row's problem."""
    f = row_fields(batch, topic_option)
    delays = row_delays(batch)
    out: list[tuple[Message, bool]] = []
    for i, body in enumerate(f.bodies):
        p = f.properties[i] if f.properties is not None else None
        pmap = {a: b for a, b in p if b is not None} if p else None
        kwargs = delays[i] if delays is not None else {}
        msg = Message(f.topics[i], body, keys=f.keys[i], tags=f.tags[i] if f.tags is not None else None,
                      properties=pmap or None, **kwargs)
        out.append((msg, bool(kwargs)))
    return out


def send_slices(sizes: Sequence[int], max_rows: int, max_bytes: int = SEND_BYTES) -> list[tuple[int, int]]:
    """``[start, end)`` pairs cutting rows of these body sizes into sends of at most ``max_rows`` rows whose
    bodies hold at most ``max_bytes`` (a row larger than that goes alone), in order, none empty."""
    n = len(sizes)
    if n and max(sizes) * max_rows <= max_bytes:  # the usual case: only the row count cuts
        return [(s, min(n, s + max_rows)) for s in range(0, n, max_rows)]
    out: list[tuple[int, int]] = []
    start = size = 0
    for i, b in enumerate(sizes):
        if i > start and (i - start >= max_rows or size + b > max_bytes):
            out.append((start, i))
            start, size = i, 0
        size += b
    if start < n:
        out.append((start, n))
    return out


def write_rows(opts: WriteOptions, batches: Iterator[pa.RecordBatch], query_id: str, batch_id: int,
               partition_id: int) -> WriteStats:
    """Send every row of a Spark task, with a deterministic UNIQ_KEY per row. Non-delayed rows go in
    batched sends of up to ``batchSize`` per topic and SEND_BYTES of bodies, delayed rows one by one (the
    broker parks each by its own level); at most ``maxInFlight`` sends are outstanding. The first failure
    fails the task (Spark retries it: at-least-once, the same UNIQ_KEYs are sent again)."""
    stats = WriteStats()
    proxy = Producer(opts.producer_group, opts.namesrv, send_timeout=opts.request_timeout_s,
                     credentials=opts.credentials, tls=opts.tls).blocking()
    producer = proxy.async_client
    sem_holder: dict[str, asyncio.Semaphore] = {}

    async def bounded(make: Callable[[], Awaitable[Any]]) -> None:
        sem = sem_holder.get("s")
        if sem is None:
            sem = sem_holder["s"] = asyncio.Semaphore(opts.max_in_flight)
        async with sem:
            await make()

    futures: collections.deque[Any] = collections.deque()

    def submit(make: Callable[[], Awaitable[Any]]) -> None:
        futures.append(asyncio.run_coroutine_threadsafe(bounded(make), proxy.loop))
        while len(futures) > opts.max_in_flight * 4:
            _wait(futures.popleft())

    def _wait(f: Any) -> None:
        try:
            f.result(opts.request_timeout_s * 4 + 30)
        except InvalidMessage as e:
            raise ChronomqSparkError(f"chronomq write: a row cannot be sent as a message: {e}") from e
        except BrokerError as e:
            if e.code == MESSAGE_ILLEGAL:
                raise ChronomqSparkError(f"chronomq write: the broker refused a row: {e}") from e
            raise ChronomqSparkError(f"chronomq write failed (Spark will retry the task; rows already sent "
                                     f"are sent again with the same UNIQ_KEY): {e}") from e
        except ClientError as e:
            raise ChronomqSparkError(f"chronomq write failed (Spark will retry the task; rows already sent "
                                     f"are sent again with the same UNIQ_KEY): {e}") from e

    def send_plain(f: RowFields, uniq: list[str], first_row: int) -> None:
        """Rows without a deliver time: encoded straight into batch bodies, ``batchSize`` rows a send."""
        n = len(f.bodies)
        groups: dict[str, list[int]] = {}
        if len(set(f.topics)) == 1:
            groups[f.topics[0]] = list(range(n))
        else:
            for i, t in enumerate(f.topics):
                groups.setdefault(t, []).append(i)
        def send(topic: str, sel: list[int]) -> None:
            ids = [uniq[j] for j in sel]
            try:
                data = encode_rows([f.bodies[j] for j in sel], ids,
                                   keys=[f.keys[j] for j in sel],
                                   tags=[f.tags[j] for j in sel] if f.tags is not None else None,
                                   properties=([f.properties[j] for j in sel] if f.properties is not None
                                               else None),
                                   dedup=opts.dedup, row_numbers=[first_row + j for j in sel])
            except InvalidMessage as e:
                raise ChronomqSparkError(f"chronomq write: a row cannot be sent as a message: {e}") from e
            if len(data) > producer.max_message_size and len(sel) > 1:  # large properties: halve it
                half = len(sel) // 2
                send(topic, sel[:half])
                send(topic, sel[half:])
                return
            submit(functools.partial(producer.send_encoded_batch, topic, data, ids))

        for topic, rows in groups.items():
            stats.topics[topic] = stats.topics.get(topic, 0) + len(rows)
            for a, b in send_slices([len(f.bodies[j]) for j in rows], opts.batch_size):
                send(topic, rows[a:b])

    def send_messages(items: list[tuple[Message, bool]], uniq: list[str]) -> None:
        """Rows of a batch that has deliver times: delayed rows one by one, the others batched per topic."""
        per_topic: dict[str, list[Message]] = {}
        for (msg, delayed), key in zip(items, uniq, strict=True):
            msg.uniq_key = key
            msg.dedup = opts.dedup
            stats.topics[msg.topic] = stats.topics.get(msg.topic, 0) + 1
            # (the producer validates each message; an invalid one fails the task with its reason)
            if delayed:
                submit(functools.partial(producer.send, msg))
            else:
                per_topic.setdefault(msg.topic, []).append(msg)
        for ms in per_topic.values():
            for a, b in send_slices([len(m.body) for m in ms], opts.batch_size):
                submit(functools.partial(producer.send_batch, ms[a:b]))

    try:
        row = 0
        for batch in batches:
            n = batch.num_rows
            if n == 0:
                continue
            uniq = row_uniq_keys(query_id, batch_id, partition_id, row, n)
            try:
                if row_delays(batch) is None:
                    fields, items = row_fields(batch, opts.topic), None
                else:
                    fields, items = None, batch_to_messages(batch, opts.topic)
            except (ValueError, ClientError) as e:
                raise ChronomqSparkError(f"chronomq write: {e}") from e
            if fields is not None:
                send_plain(fields, uniq, row)
            else:
                assert items is not None
                send_messages(items, uniq)
            row += n
        while futures:
            _wait(futures.popleft())
        stats.rows = row
        return stats
    finally:
        for f in futures:
            f.cancel()
        proxy.close()
