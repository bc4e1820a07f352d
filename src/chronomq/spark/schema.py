"""The row schema of the ``chronomq`` source, the conversion of received messages into Arrow record
batches, the write-side column rules, and the deterministic UNIQ_KEY of a written row."""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from chronomq.client.model import (
    WANT_DELIVER,
    WANT_KEYS,
    WANT_MSG_ID,
    WANT_PROPERTIES,
    WANT_TAGS,
    WANT_VALUE,
    RecordColumns,
    parse_properties,
    record_buffers,
    record_columns,
)
from chronomq.message import (
    NAME_VALUE_SEPARATOR,
    PROPERTY_DELAY_TIME_LEVEL,
    PROPERTY_KEYS,
    PROPERTY_SEPARATOR,
    PROPERTY_TAGS,
    PROPERTY_TIMER_DELIVER_MS,
    PROPERTY_UNIQ_KEY,
    SCHEDULE_TOPIC,
    create_offset_msg_id,
    unpack_host_cached,
)

# The RocketMQ 4.x default level table (docs/protocol.md#delay-levels), used when the broker cannot tell us
# its own.
DEFAULT_LEVELS_MS = [1000, 5000, 10000, 30000, 60000, 120000, 180000, 240000, 300000, 360000, 420000,
                     480000, 540000, 600000, 1200000, 1800000, 3600000, 7200000]
# Intended deliver time (epoch ms) a broker may stamp on a delivered delayed message.
PROPERTY_DELIVER_MS = "__CHRONOMQ_DELIVER_MS"

READ_SCHEMA = StructType([
    StructField("key", BinaryType(), True),
    StructField("value", BinaryType(), True),
    StructField("topic", StringType(), True),
    StructField("partition", IntegerType(), True),
    StructField("offset", LongType(), True),
    StructField("timestamp", TimestampType(), True),
    StructField("broker", StringType(), True),
    StructField("msg_id", StringType(), True),
    StructField("tags", StringType(), True),
    StructField("keys", ArrayType(StringType(), True), True),
    StructField("properties", MapType(StringType(), StringType(), True), True),
    StructField("born_timestamp", TimestampType(), True),
    StructField("reconsume_times", IntegerType(), True),
    StructField("deliver_time", TimestampType(), True),
])

# mode=pending: one row per message waiting in a broker's timer store (chronomq.client.PendingMessage)
PENDING_SCHEMA = StructType([
    StructField("msg_id", StringType(), True),
    StructField("offset_msg_id", StringType(), True),
    StructField("topic", StringType(), True),
    StructField("queue_id", IntegerType(), True),
    StructField("tags", StringType(), True),
    StructField("keys", ArrayType(StringType(), True), True),
    StructField("deliver_time", TimestampType(), True),
    StructField("created", TimestampType(), True),
    StructField("body_size", IntegerType(), True),
    StructField("broker", StringType(), True),
])


def arrow_schema(schema: StructType = READ_SCHEMA) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema, timezone="UTC")


def deliver_ms(topic: str, props: dict[str, str], store_ms: int, levels_ms: Sequence[int]) -> int | None:
    """The intended delivery time of a delayed message, when the message tells it:
    a stamped deliver time, a timer deliver time, or (parked in SCHEDULE_TOPIC_XXXX) store time + the
    level's delay."""
    for name in (PROPERTY_DELIVER_MS, PROPERTY_TIMER_DELIVER_MS):
        raw = props.get(name)
        if raw:
            try:
                return int(raw)
            except ValueError:
                pass
    if topic == SCHEDULE_TOPIC and levels_ms:
        try:
            level = int(props.get(PROPERTY_DELAY_TIME_LEVEL, "0"))
        except ValueError:
            return None
        if level > 0:
            return store_ms + levels_ms[min(level, len(levels_ms)) - 1]
    return None


@functools.cache
def _read_arrow_schema(pending: bool = False) -> pa.Schema:
    return arrow_schema(PENDING_SCHEMA if pending else READ_SCHEMA)


def read_columns(schema: StructType, full: StructType = READ_SCHEMA) -> StructType:
    """A user's ``.schema(...)`` for a read: ``full`` itself, or any of its columns with the same types and
    nullability (only those are built, which a ``select`` cannot do for a Python data source; Spark takes a
    column declared NOT NULL at its word, so one that can hold nulls must stay nullable); anything else is
    refused."""
    if schema == full:
        return full
    known = {f.name: f for f in full.fields}
    names = [f.name for f in schema.fields]
    problems: list[str] = []
    for f in schema.fields:
        want = known.get(f.name)
        if want is None:
            hint = [n for n in known if n.lower() == f.name.lower()]
            problems.append(f"{f.name} is not a column" + (f" (names are case-sensitive: {hint[0]})" if hint
                                                             else ""))
        elif f.dataType != want.dataType:
            same = f.dataType.simpleString() == want.dataType.simpleString()
            problems.append(f"{f.name} is {f.dataType.json() if same else f.dataType.simpleString()}, not "
                            f"{want.dataType.json() if same else want.dataType.simpleString()}")
        elif f.nullable != want.nullable:
            problems.append(f"{f.name} must be nullable" if want.nullable else f"{f.name} is never null")
    problems += [f"{n} is named twice" for n in sorted({n for n in names if names.count(n) > 1})]
    if not names:
        problems.append("it has no column")
    if problems:
        ddl = ", ".join(f"{f.name} {f.dataType.simpleString()}" for f in full.fields)
        raise ValueError(f"the schema given to the chronomq source does not fit ({'; '.join(problems)}): its "
                         f"columns are '{ddl}'; a .schema(...) may name any of them, with these types "
                         "(nullable), and only those are read")
    return schema


def records_to_batch(parts: Sequence[RecordColumns], topic: str, broker: str, queue_id: int,
                     levels_ms: Sequence[int], schema: pa.Schema) -> pa.RecordBatch:
    """Pulled records of one queue (chronomq.client RecordColumns, in offset order) -> one Arrow batch of
    ``schema``: READ_SCHEMA or any selection of its columns (a narrower user schema), only those built.

    The property texts are split by Arrow kernels (``_property_map``), and the tags, keys and ids looked
    up in the resulting map; Python touches a row only to put its fields in lists, and for the rare row
    with a deliver time or without a UNIQ_KEY."""
    def chained(name: str) -> list[Any]:
        if len(parts) == 1:
            return getattr(parts[0], name)
        return list(itertools.chain.from_iterable(getattr(p, name) for p in parts))

    n = sum(len(p.queue_offsets) for p in parts)
    full = _read_arrow_schema()
    memo: dict[str, Any] = {}

    def once(name: str, make: Any) -> Any:
        if name not in memo:
            memo[name] = make()
        return memo[name]

    def texts() -> list[str]:
        return once("texts", lambda: chained("properties"))

    def store_ms() -> list[int]:
        return once("store_ms", lambda: chained("store_timestamps"))

    def props() -> pa.MapArray:
        return once("props", lambda: _property_map(pa.array(texts(), pa.string()),
                                                   full.field("properties").type))

    def keys() -> pa.ListArray:
        return once("keys", lambda: _split_words(pc.fill_null(_lookup(props(), PROPERTY_KEYS), ""),
                                                 full.field("keys").type))

    def ids() -> pa.Array:
        found = _lookup(props(), PROPERTY_UNIQ_KEY)
        if not found.null_count and pc.all(pc.not_equal(found, "")).as_py():
            return found
        # no UNIQ_KEY: the offset message id (store host + commit-log offset), as the client's decoder
        hosts, phys = chained("store_hosts"), chained("commit_log_offsets")
        return pa.array([i or create_offset_msg_id(unpack_host_cached(hosts[j]), phys[j])
                         for j, i in enumerate(found.to_pylist())], pa.string())

    def deliver() -> pa.Array:
        timed = pc.or_kleene(pc.is_valid(_lookup(props(), PROPERTY_DELIVER_MS)),
                             pc.is_valid(_lookup(props(), PROPERTY_TIMER_DELIVER_MS)))
        if topic == SCHEDULE_TOPIC or pc.any(timed).as_py():
            return _ts_ms(pa.array([deliver_ms(topic, parse_properties(t), s, levels_ms)
                                    for t, s in zip(texts(), store_ms(), strict=True)], pa.int64()))
        return pa.nulls(n, _TS)

    build: dict[str, Any] = {
        "key": lambda: _first_word(keys()),
        "value": lambda: pa.array(chained("bodies"), type=pa.binary()),
        "topic": lambda: _const(topic, pa.string(), n),
        "partition": lambda: _const(queue_id, pa.int32(), n),
        "offset": lambda: pa.array(chained("queue_offsets"), type=pa.int64()),
        "timestamp": lambda: _ts_ms(pa.array(store_ms(), type=pa.int64())),
        "broker": lambda: _const(broker, pa.string(), n),
        "msg_id": ids,
        "tags": lambda: _lookup(props(), PROPERTY_TAGS),
        "keys": keys,
        "properties": props,
        "born_timestamp": lambda: _ts_ms(pa.array(chained("born_timestamps"), type=pa.int64())),
        "reconsume_times": lambda: pa.array(chained("reconsume_times"), type=pa.int32()),
        "deliver_time": deliver,
    }
    return pa.RecordBatch.from_arrays([build[name]() for name in schema.names], schema=schema)


def select_records(recs: RecordColumns, start: int, end: int, tags: set[str] | None) -> RecordColumns:
    """The pulled records with an offset in [start, end) and, with a tag filter, one of its tags (the
    broker filters by tag hash code only; the client's own pulls check the tag itself, so does this)."""
    offsets = recs.queue_offsets
    if tags is None and (not offsets or (min(offsets) >= start and max(offsets) < end)):
        return recs
    return recs.take([i for i, o in enumerate(offsets) if start <= o < end and
                      (tags is None or parse_properties(recs.properties[i]).get(PROPERTY_TAGS) in tags)])


# the record_buffers bits each column needs
_WANT = {"value": WANT_VALUE, "properties": WANT_PROPERTIES, "keys": WANT_KEYS, "key": WANT_KEYS,
         "tags": WANT_TAGS, "msg_id": WANT_MSG_ID, "deliver_time": WANT_DELIVER}


def stored_to_batch(parts: Sequence[tuple[bytes, int, int]], topic: str, broker: str, queue_id: int,
                    levels_ms: Sequence[int], schema: pa.Schema,
                    tags: set[str] | None = None) -> pa.RecordBatch:
    """Pull answers of one queue as the broker sent them (stored records, and the offsets [first, end)
    wanted of each), in offset order -> one Arrow batch of ``schema``, the records matching ``tags`` (None:
    all). Built straight from the compiled decode's column buffers (``record_buffers``) where it can, else
    through ``record_columns`` and ``records_to_batch``: the same batch either way. Raises
    MessageFormatError for a record the client refuses (zlib.error for a body that does not inflate)."""
    if tags is None and not (topic == SCHEDULE_TOPIC and "deliver_time" in schema.names):
        want = 0
        for name in schema.names:
            want |= _WANT.get(name, 0)
        bufs = record_buffers(list(parts), want)
        if bufs is not None:
            return _buffers_to_batch(bufs, topic, broker, queue_id, schema)
    return records_to_batch([select_records(record_columns(body), lo, hi, tags) for body, lo, hi in parts],
                            topic, broker, queue_id, levels_ms, schema)


def _buffers_to_batch(bufs: dict[str, Any], topic: str, broker: str, queue_id: int,
                      schema: pa.Schema) -> pa.RecordBatch:
    """record_buffers' column buffers -> one Arrow batch of ``schema`` (no copy of the buffers)."""
    n = bufs["rows"]
    full = _read_arrow_schema()
    buf = pa.py_buffer

    def fixed(name: str) -> pa.Array:
        return pa.Array.from_buffers(full.field(name).type, n, [None, buf(bufs[name])])

    def var(typ: pa.DataType, count: int, offsets: bytearray, data: bytearray,
            valid: bytearray | None = None) -> pa.Array:
        return pa.Array.from_buffers(typ, count, [None if valid is None else buf(valid), buf(offsets),
                                                  buf(data)])

    def offsets(raw: bytearray) -> pa.Array:
        return pa.Array.from_buffers(pa.int32(), len(raw) // 4, [None, buf(raw)])

    def properties() -> pa.MapArray:
        moff, koff, kdata, voff, vdata = bufs["properties"]
        count = len(koff) // 4 - 1
        return pa.MapArray.from_arrays(offsets(moff), var(pa.string(), count, koff, kdata),
                                       var(pa.string(), count, voff, vdata),
                                       type=full.field("properties").type)

    def keys() -> pa.ListArray:
        loff, woff, wdata = bufs["keys"]
        return pa.ListArray.from_arrays(offsets(loff), var(pa.string(), len(woff) // 4 - 1, woff, wdata),
                                        type=full.field("keys").type)

    def deliver() -> pa.Array:
        valid, data = bufs["deliver_time"]
        return pa.Array.from_buffers(_TS, n, [buf(valid), buf(data)])

    build: dict[str, Any] = {
        "key": lambda: var(pa.binary(), n, *bufs["key"]),
        "value": lambda: var(pa.binary(), n, *bufs["value"]),
        "topic": lambda: _const(topic, pa.string(), n),
        "partition": lambda: _const(queue_id, pa.int32(), n),
        "offset": lambda: fixed("offset"),
        "timestamp": lambda: fixed("timestamp"),
        "broker": lambda: _const(broker, pa.string(), n),
        "msg_id": lambda: var(pa.string(), n, *bufs["msg_id"]),
        "tags": lambda: var(pa.string(), n, *bufs["tags"]),
        "keys": keys,
        "properties": properties,
        "born_timestamp": lambda: fixed("born_timestamp"),
        "reconsume_times": lambda: fixed("reconsume_times"),
        "deliver_time": deliver,
    }
    return pa.RecordBatch.from_arrays([build[name]() for name in schema.names], schema=schema)


def _regroup(lists: pa.ListArray, keep: pa.Array) -> pa.Array:
    """New list offsets for ``lists`` when only its flattened values where ``keep`` is true stay."""
    kept = pc.cumulative_sum(pc.cast(keep, pa.int32()))
    return pc.take(pa.concat_arrays([pa.array([0], pa.int32()), kept]), lists.offsets)


def _property_map(texts: pa.Array, typ: pa.DataType) -> pa.MapArray:
    """Stored property texts (``name\\x01value\\x02...``) -> a map per row, as parse_properties reads them:
    an item without a name or without the separator is skipped (a repeated name, which no producer
    writes, would be kept twice; lookups take the last, as the dict does)."""
    items = pc.split_pattern(texts, PROPERTY_SEPARATOR)
    pairs = pc.split_pattern(pc.list_flatten(items), NAME_VALUE_SEPARATOR, max_splits=1)
    keep = pc.and_(pc.equal(pc.list_value_length(pairs), 2), pc.not_equal(pc.list_element(pairs, 0), ""))
    pairs = pc.filter(pairs, keep)
    return pa.MapArray.from_arrays(_regroup(items, keep), pc.list_element(pairs, 0),
                                   pc.list_element(pairs, 1), type=typ)


def _lookup(props: pa.MapArray, name: str) -> pa.Array:
    return pc.map_lookup(props, pa.scalar(name, pa.string()), "last")


def _split_words(text: pa.Array, typ: pa.DataType) -> pa.ListArray:
    """Space-separated words -> a list per row, empty words dropped (KEYS)."""
    words = pc.split_pattern(text, " ")
    flat = pc.list_flatten(words)
    keep = pc.not_equal(flat, "")
    return pa.ListArray.from_arrays(_regroup(words, keep), pc.filter(flat, keep), type=typ)


def _first_word(lists: pa.ListArray) -> pa.Array:
    """The first element of each list (binary), null for an empty list (the ``key`` column)."""
    has = pc.greater(pc.list_value_length(lists), 0)
    if not pc.any(has).as_py():
        return pa.nulls(len(lists), pa.binary())
    starts = pc.if_else(has, lists.offsets[:-1], 0)
    return pc.if_else(has, pc.take(lists.values, starts), None).cast(pa.binary())


def pending_to_batch(items: Sequence[Any], schema: pa.Schema) -> pa.RecordBatch:
    """Pending messages (chronomq.client.PendingMessage-like) -> one Arrow batch of PENDING_SCHEMA or of
    a selection of its columns (all ten are built, then the selection taken: a page is small)."""
    full = _read_arrow_schema(pending=True)
    cols = [
        pa.array([p.msg_id for p in items], type=pa.string()),
        pa.array([p.offset_msg_id or None for p in items], type=pa.string()),
        pa.array([p.topic for p in items], type=pa.string()),
        pa.array([p.queue_id for p in items], type=pa.int32()),
        pa.array([p.tags for p in items], type=pa.string()),
        pa.array([list(p.keys) for p in items], type=full.field("keys").type),
        _ts([p.deliver_ms for p in items]),
        _ts([p.created_ms or None for p in items]),
        pa.array([p.body_size for p in items], type=pa.int32()),
        pa.array([p.broker for p in items], type=pa.string()),
    ]
    at = {name: i for i, name in enumerate(full.names)}
    return pa.RecordBatch.from_arrays([cols[at[name]] for name in schema.names], schema=schema)


_TS = pa.timestamp("us", tz="UTC")


def _const(value: Any, typ: pa.DataType, n: int) -> pa.Array:
    """``n`` times ``value`` (vectorised: pa.repeat builds it element by element)."""
    return pa.nulls(n, typ).fill_null(value)


def _ts(values_ms: Iterable[int | None]) -> pa.Array:
    return _ts_ms(pa.array(list(values_ms), type=pa.int64()))


def _ts_ms(ms: pa.Array) -> pa.Array:
    """Epoch-ms int64 -> Spark's timestamp type (microseconds, UTC), vectorised (nulls stay null)."""
    return pc.multiply(ms, 1000).cast(_TS)


# --- writing --------------------------------------------------------------------------------------------
# Columns the writer uses; columns the reader produces are accepted and ignored (so a DataFrame read from
# chronomq can be written back), anything else is refused (a typo must not be silently dropped).
WRITE_COLUMNS = {"value", "topic", "key", "keys", "tags", "properties", "delay_level", "delay_ms",
                 "deliver_at"}
IGNORED_COLUMNS = {f.name for f in READ_SCHEMA.fields} - WRITE_COLUMNS


class WriteSchemaError(ValueError):
    """The DataFrame given to the writer does not have usable columns (the message says which)."""


def _is_text_or_binary(t: DataType) -> bool:
    return isinstance(t, StringType | BinaryType)


def validate_write_schema(schema: StructType, topic_option: str | None) -> None:
    fields = {f.name: f.dataType for f in schema.fields}
    lower = {n.lower(): n for n in fields}
    if "value" not in fields:
        hint = f" (found {lower['value']!r}: column names are case-sensitive)" if "value" in lower else ""
        raise WriteSchemaError("the DataFrame needs a 'value' column (binary or string) to write to chronomq"
                               + hint)
    unknown = sorted(n for n in fields if n not in WRITE_COLUMNS and n not in IGNORED_COLUMNS)
    if unknown:
        raise WriteSchemaError(
            f"column(s) {unknown} are not understood by the chronomq writer; it uses "
            f"{sorted(WRITE_COLUMNS)} (and ignores the reader's {sorted(IGNORED_COLUMNS)}). "
            "Put extra fields into the 'properties' map or drop them")
    checks: list[tuple[str, bool, str]] = [
        ("value", _is_text_or_binary(fields["value"]), "binary or string"),
    ]
    if "topic" in fields:
        checks.append(("topic", isinstance(fields["topic"], StringType), "string"))
    if "key" in fields:
        checks.append(("key", _is_text_or_binary(fields["key"]), "binary or string"))
    if "keys" in fields:
        t = fields["keys"]
        checks.append(("keys", isinstance(t, StringType) or (isinstance(t, ArrayType)
                                                             and isinstance(t.elementType, StringType)),
                       "array<string> or string (space separated)"))
    if "tags" in fields:
        checks.append(("tags", isinstance(fields["tags"], StringType), "string"))
    if "properties" in fields:
        t = fields["properties"]
        checks.append(("properties", isinstance(t, MapType) and isinstance(t.keyType, StringType)
                       and isinstance(t.valueType, StringType), "map<string,string>"))
    for name in ("delay_level", "delay_ms"):
        if name in fields:
            checks.append((name, isinstance(fields[name], IntegerType | LongType), "int or bigint"))
    if "deliver_at" in fields:
        checks.append(("deliver_at", isinstance(fields["deliver_at"], TimestampType | LongType),
                       "timestamp or bigint epoch ms"))
    for name, ok, expected in checks:
        if not ok:
            raise WriteSchemaError(f"column {name!r} has type {fields[name].simpleString()}; "
                                   f"the chronomq writer expects {expected}")
    delays = [n for n in ("delay_level", "delay_ms", "deliver_at") if n in fields]
    if len(delays) > 1:
        raise WriteSchemaError(f"give one per-row delay column, not {delays}")
    if topic_option is None and "topic" not in fields:
        raise WriteSchemaError("no topic: add a 'topic' column or set .option('topic', ...)")


def row_uniq_key(query_id: str, batch_id: int, partition_id: int, row_index: int) -> str:
    """A deterministic UNIQ_KEY (32 upper-case hex characters, the shape RocketMQ ids have) for the
    row_index-th row of a Spark partition in a batch of a query: a retried task re-sends the same ids."""
    return row_uniq_keys(query_id, batch_id, partition_id, row_index, 1)[0]


def row_uniq_keys(query_id: str, batch_id: int, partition_id: int, first_row: int, n: int) -> list[str]:
    """``row_uniq_key`` of rows first_row .. first_row + n - 1 (the common prefix is hashed once)."""
    head = hashlib.blake2b(f"{query_id}\x00{batch_id}\x00{partition_id}\x00".encode(), digest_size=16)
    out: list[str] = []
    for row in range(first_row, first_row + n):
        h = head.copy()
        h.update(str(row).encode())
        out.append(h.hexdigest().upper())
    return out


def to_epoch_ms(value: Any) -> int:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return int(value.timestamp() * 1000)
    return int(value)
