"""Unit tests of the pure parts of chronomq.spark: options, offset JSON, rate limiting, planning, UNIQ_KEY,
the write-schema rules and the Arrow conversion. No JVM, no broker."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

import asyncio
import itertools
import zlib

from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from chronomq import message as m
from chronomq.client import PullResult, PullStatus
from chronomq.client.model import RecordColumns, decode_received, parse_properties, record_columns
from chronomq.spark.io import DataLossError, select_records, send_slices
from chronomq.spark.offsets import (
    OffsetFormatError,
    QueueRange,
    offsets_from_json,
    offsets_to_json,
    plan_ranges,
    rate_limit,
)
from chronomq.spark.options import (
    EARLIEST,
    LATEST,
    OptionError,
    parse_pending_options,
    parse_read_options,
    parse_time_ms,
    parse_write_options,
    read_mode,
)
from chronomq.spark.schema import (
    DEFAULT_LEVELS_MS,
    PENDING_SCHEMA,
    READ_SCHEMA,
    WriteSchemaError,
    arrow_schema,
    deliver_ms,
    pending_to_batch,
    read_columns,
    records_to_batch,
    row_uniq_key,
    validate_write_schema,
)

pytestmark = pytest.mark.spark
NS = {"namesrv": "127.0.0.1:9876"}


def read(streaming: bool = False, **kw: str):
    return parse_read_options({**NS, **kw}, streaming)


# --- options ----------------------------------------------------------------------------------------------
def test_subscribe_and_defaults() -> None:
    o = read(subscribe="a, b,a")
    assert o.subscribe == ("a", "b")
    assert o.starting.kind == "earliest" and o.ending.kind == "latest"
    assert o.fail_on_data_loss is True and o.tag_expression == "*"
    s = read(True, subscribe="a")
    assert s.starting.kind == "latest"


def test_keys_are_case_insensitive_and_alias() -> None:
    o = parse_read_options({"NameServer": "h:1;h2:2", "SUBSCRIBE": "t", "FailOnDataLoss": "FALSE"}, False)
    assert o.namesrv == "h:1;h2:2" and o.fail_on_data_loss is False


@pytest.mark.parametrize("kw, text", [
    ({}, "exactly one of"),
    ({"subscribe": "a", "assign": '{"a": {"b": [0]}}'}, "exactly one of"),
    ({"subscribe": "a", "startingOffset": "earliest"}, "unknown read option"),
    ({"subscribePattern": "("}, "not a valid regular expression"),
    ({"subscribe": "bad topic!"}, "characters outside"),
    ({"assign": "[1]"}, "JSON object"),
    ({"assign": '{"t": {"b": [-1]}}'}, "queue ids"),
    ({"subscribe": "t", "startingOffsets": "latest"}, "not allowed in a batch"),
    ({"subscribe": "t", "endingOffsets": "earliest"}, "not allowed in a batch"),
    ({"subscribe": "t", "startingOffsets": '{"t": {"b": {"0": -1}}}'}, r"-1 \(latest\) is not allowed"),
    ({"subscribe": "t", "endingOffsets": '{"t": {"b": {"0": -2}}}'}, r"-2 \(earliest\) is not allowed"),
    ({"subscribe": "t", "startingOffsets": '{"t": {"b": {"x": 1}}}'}, "not an integer"),
    ({"subscribe": "t", "startingOffsets": '{"t": {"b": {"0": -3}}}'}, "must be an integer >= 0"),
    ({"subscribe": "t", "startingOffsets": '{"u": {"b": {"0": 1}}}'}, "not subscribed"),
    ({"subscribe": "t", "startingOffsets": "soon"}, "must be 'earliest'"),
    ({"subscribe": "t", "startingOffsets": "{oops"}, "not valid JSON"),
    ({"subscribe": "t", "maxOffsetsPerTrigger": "10"}, "streaming queries only"),
    ({"subscribe": "t", "minPartitions": "0"}, "must be >= 1"),
    ({"subscribe": "t", "failOnDataLoss": "maybe"}, "true or false"),
    ({"subscribe": "t", "startingTimestamp": "x"}, "not an integer"),
    ({"subscribe": "t", "startingTimestamp": "5", "startingOffsets": "earliest"}, "not both"),
    ({"assign": '{"t": {"b": [0]}}', "startingOffsets": '{"t": {"b": {"1": 3}}}'}, "not in 'assign'"),
])
def test_bad_read_options(kw: dict[str, str], text: str) -> None:
    with pytest.raises(OptionError, match=text):
        read(**kw)


def test_namesrv_required_and_checked() -> None:
    with pytest.raises(OptionError, match="required"):
        parse_read_options({"subscribe": "t"}, False)
    with pytest.raises(OptionError, match="not host:port"):
        parse_read_options({"namesrv": "localhost", "subscribe": "t"}, False)
    with pytest.raises(OptionError, match="differ"):
        parse_read_options({"namesrv": "a:1", "nameServer": "b:2", "subscribe": "t"}, False)


def test_streaming_only_and_batch_only_options() -> None:
    with pytest.raises(OptionError, match="batch queries only"):
        read(True, subscribe="t", endingOffsets="latest")
    assert read(True, subscribe="t", maxOffsetsPerTrigger="7").max_offsets_per_trigger == 7


def test_json_offsets_and_assign() -> None:
    o = read(assign='{"t": {"broker-a": [2, 0, 2]}}',
             startingOffsets='{"t": {"broker-a": {"0": 5, "2": -2}}}',
             endingOffsets='{"t": {"broker-a": {"0": 9}}}')
    assert o.assign == {"t": {"broker-a": (0, 2)}}
    assert o.starting.for_queue("t", "broker-a", 0) == 5
    assert o.starting.for_queue("t", "broker-a", 2) == EARLIEST
    assert o.starting.for_queue("t", "broker-a", 1) is None
    assert o.ending.for_queue("t", "broker-a", 0) == 9
    assert read(subscribe="t").ending.for_queue("t", "x", 3) == LATEST


def test_spark_injected_options_are_accepted() -> None:
    read(subscribe="t", path="/x", checkpointLocation="/c", **{"spark.foo": "1"})


def test_write_options() -> None:
    w = parse_write_options({**NS, "topic": "t", "batchSize": "10", "writeId": "job-7"})
    assert (w.topic, w.batch_size, w.write_id, w.max_in_flight) == ("t", 10, "job-7", 8)
    with pytest.raises(OptionError, match="unknown write option"):
        parse_write_options({**NS, "topics": "t"})
    with pytest.raises(OptionError, match="option 'topic'"):
        parse_write_options({**NS, "topic": "a b"})
    with pytest.raises(OptionError, match="must be <= 4096"):
        parse_write_options({**NS, "batchSize": "100000"})


def test_send_slices_cut_at_the_row_count_or_the_bodies_bytes() -> None:
    assert send_slices([], 64) == []
    assert send_slices([1024] * 130, 64) == [(0, 64), (64, 128), (128, 130)]  # rows alone
    assert send_slices([300] * 7, 64, max_bytes=1000) == [(0, 3), (3, 6), (6, 7)]  # bytes alone
    assert send_slices([10, 2000, 10, 10], 3, max_bytes=1000) == [(0, 1), (1, 2), (2, 4)]  # a large row alone
    assert send_slices([400, 400, 200, 1], 64, max_bytes=1000) == [(0, 3), (3, 4)]  # exactly the limit fits


@given(st.lists(st.integers(0, 3000), max_size=60), st.integers(1, 8), st.integers(1, 4000))
def test_send_slices_cover_every_row_in_order_within_the_limits(sizes, rows, limit) -> None:
    cuts = send_slices(sizes, rows, max_bytes=limit)
    assert [i for a, b in cuts for i in range(a, b)] == list(range(len(sizes)))
    for a, b in cuts:
        assert 0 < b - a <= rows
        assert b - a == 1 or sum(sizes[a:b]) <= limit
    for (a, b), (c, _) in itertools.pairwise(cuts):  # a cut only where the next row did not fit
        assert b - a == rows or sum(sizes[a:c + 1]) > limit


# --- offsets ------------------------------------------------------------------------------------------------
def test_offsets_json_roundtrip_through_text() -> None:
    offs = {("t", "b", 0): 5, ("t", "b", 10): 7, ("u", "c", 1): 0}
    data = json.loads(json.dumps(offsets_to_json(offs)))
    assert data == {"t": {"b": {"0": 5, "10": 7}}, "u": {"c": {"1": 0}}}
    assert offsets_from_json(data) == offs


@pytest.mark.parametrize("bad", [[], {"t": 1}, {"t": {"b": []}}, {"t": {"b": {"x": 1}}},
                                 {"t": {"b": {"0": -1}}}, {"t": {"b": {"0": True}}}])
def test_offsets_from_json_rejects(bad: object) -> None:
    with pytest.raises(OffsetFormatError):
        offsets_from_json(bad)


def q(i: int) -> tuple[str, str, int]:
    return ("t", "b", i)


def test_rate_limit_proportional_exact_total() -> None:
    start = {q(0): 0, q(1): 100, q(2): 0}
    latest = {q(0): 600, q(1): 400, q(2): 100}  # backlog 600 / 300 / 100
    end = rate_limit(start, latest, 100)
    assert {k: end[k] - start[k] for k in start} == {q(0): 60, q(1): 30, q(2): 10}
    assert sum(end[k] - start[k] for k in start) == 100


def test_rate_limit_under_limit_and_new_queues() -> None:
    start = {q(0): 0}
    latest = {q(0): 5, q(1): 3}
    assert rate_limit(start, latest, 10) == latest


def test_rate_limit_never_exceeds_and_does_not_starve() -> None:
    start = {q(i): 0 for i in range(4)}
    latest = {q(i): 10 for i in range(4)}
    seen: set[tuple[str, str, int]] = set()
    for _ in range(8):
        end = rate_limit(start, latest, 1)
        moved = [k for k in start if end[k] != start[k]]
        assert len(moved) == 1 and sum(end[k] - start[k] for k in start) == 1
        seen.update(moved)
        start = end
    assert seen == set(start)


def test_plan_ranges_one_per_nonempty_queue() -> None:
    start = {q(0): 0, q(1): 5, q(2): 3}
    end = {q(0): 10, q(1): 5, q(2): 4}
    assert plan_ranges(start, end) == [QueueRange("t", "b", 0, 0, 10), QueueRange("t", "b", 2, 3, 4)]


def test_plan_ranges_split_by_min_partitions() -> None:
    start = {q(0): 0, q(1): 0}
    end = {q(0): 100, q(1): 10}
    ranges = plan_ranges(start, end, min_partitions=6)
    assert len(ranges) >= 6
    covered: dict[int, list[tuple[int, int]]] = {}
    for r in ranges:
        covered.setdefault(r.queue_id, []).append((r.start, r.end))
    for qid, spans in covered.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == end[q(qid)]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert len(covered[0]) > len(covered[1])


# --- schema and rows ---------------------------------------------------------------------------------
def test_uniq_key_is_deterministic_and_distinct() -> None:
    a = row_uniq_key("q", 3, 1, 7)
    assert a == row_uniq_key("q", 3, 1, 7) and len(a) == 32 and a == a.upper()
    int(a, 16)
    others = {row_uniq_key("q", 3, 1, 8), row_uniq_key("q", 4, 1, 7), row_uniq_key("q", 3, 2, 7),
              row_uniq_key("r", 3, 1, 7)}
    assert a not in others and len(others) == 4


def schema(*fields: tuple[str, object]) -> StructType:
    return StructType([StructField(n, t, True) for n, t in fields])  # type: ignore[arg-type]


def test_write_schema_rules() -> None:
    validate_write_schema(schema(("value", StringType())), "t")
    validate_write_schema(schema(("value", BinaryType()), ("topic", StringType()), ("key", StringType()),
                                 ("keys", ArrayType(StringType())), ("tags", StringType()),
                                 ("properties", MapType(StringType(), StringType())),
                                 ("delay_level", IntegerType()), ("offset", LongType())), None)
    cases = [
        (schema(("body", StringType())), "needs a 'value' column"),
        (schema(("Value", StringType())), "case-sensitive"),
        (schema(("value", StringType()), ("tag", StringType())), "not understood"),
        (schema(("value", IntegerType())), "expects binary or string"),
        (schema(("value", StringType()), ("properties", MapType(StringType(), IntegerType()))), "map<string"),
        (schema(("value", StringType()), ("delay_level", StringType())), "int or bigint"),
        (schema(("value", StringType()), ("delay_level", IntegerType()), ("delay_ms", LongType())),
         "one per-row"),
        (schema(("value", StringType()), ("deliver_at", StringType())), "timestamp"),
    ]
    for sch, text in cases:
        with pytest.raises(WriteSchemaError, match=text):
            validate_write_schema(sch, "t")
    with pytest.raises(WriteSchemaError, match="no topic"):
        validate_write_schema(schema(("value", StringType())), None)


def test_deliver_time_rules() -> None:
    assert deliver_ms("SCHEDULE_TOPIC_XXXX", {"DELAY": "2"}, 1000, DEFAULT_LEVELS_MS) == 6000
    assert deliver_ms("SCHEDULE_TOPIC_XXXX", {"DELAY": "99"}, 0, [10, 20]) == 20
    assert deliver_ms("t", {"TIMER_DELIVER_MS": "123"}, 0, DEFAULT_LEVELS_MS) == 123
    assert deliver_ms("t", {"DELAY": "2"}, 0, DEFAULT_LEVELS_MS) is None


def _records(*msgs: m.MessageExt) -> RecordColumns:
    """Stored records as a pull answer carries them, split by the client."""
    return record_columns(b"".join(bytes(m.encode_record(x)) for x in msgs))


def _stored(body: bytes, offset: int, props: dict[str, str], **kw: object) -> m.MessageExt:
    return m.MessageExt(topic="t", body=body, properties=props, queue_id=3, queue_offset=offset,
                        commit_log_offset=1000 + offset, store_timestamp=1_700_000_000_123,
                        born_timestamp=1_700_000_000_000, born_host=("127.0.0.1", 1),
                        store_host=("127.0.0.1", 10911), **kw)  # type: ignore[arg-type]


def test_records_to_batch_matches_spark_schema_and_the_client_decoder() -> None:
    sch = arrow_schema()
    stored = [_stored(b"v0", 4, {"KEYS": "k1 k2", "TAGS": "a", "x": "y", "UNIQ_KEY": "U0"}),
              _stored(b"v1", 5, {}),
              _stored(zlib.compress(b"v2" * 100), 6, {"TIMER_DELIVER_MS": "1700000009000", "UNIQ_KEY": "U2"},
                      sys_flag=m.SYSFLAG_COMPRESSED)]
    recs = _records(*stored)
    half = _records(*stored[:1]), _records(*stored[1:])
    batch = records_to_batch([recs], "t", "broker-a", 3, DEFAULT_LEVELS_MS, sch)
    assert batch.schema.equals(sch)
    assert records_to_batch(list(half), "t", "broker-a", 3, DEFAULT_LEVELS_MS, sch).equals(batch)
    rows = batch.to_pylist()
    assert rows[0]["key"] == b"k1" and rows[0]["keys"] == ["k1", "k2"] and rows[0]["tags"] == "a"
    assert dict(rows[0]["properties"])["x"] == "y"
    assert rows[1]["key"] is None and rows[1]["keys"] == [] and rows[1]["offset"] == 5
    assert rows[0]["partition"] == 3 and rows[0]["broker"] == "broker-a" and rows[0]["topic"] == "t"
    assert int(rows[0]["timestamp"].timestamp() * 1000) == 1_700_000_000_123
    assert rows[0]["deliver_time"] is None
    assert int(rows[2]["deliver_time"].timestamp() * 1000) == 1_700_000_009_000
    assert rows[2]["value"] == b"v2" * 100  # inflated
    # the same ids, bodies and properties the client's own decoder gives (no UNIQ_KEY: the offset id)
    decoded = decode_received(b"".join(bytes(m.encode_record(x)) for x in stored), "broker-a")
    assert [r["msg_id"] for r in rows] == [x.id for x in decoded]
    assert rows[1]["msg_id"] == m.create_offset_msg_id(("127.0.0.1", 10911), 1005)
    assert [dict(r["properties"]) for r in rows] == [x.properties for x in decoded]
    assert [f.name for f in READ_SCHEMA.fields][:6] == ["key", "value", "topic", "partition", "offset",
                                                          "timestamp"]
    assert isinstance(READ_SCHEMA["timestamp"].dataType, TimestampType)


def test_a_narrower_schema_builds_only_its_columns_with_the_full_batchs_values(monkeypatch) -> None:
    stored = [_stored(b"v0", 4, {"KEYS": "k1 k2", "TAGS": "a", "UNIQ_KEY": "U0"}),
              _stored(b"v1", 5, {"TIMER_DELIVER_MS": "1700000009000"})]
    recs = _records(*stored)
    full = records_to_batch([recs], "t", "b", 1, DEFAULT_LEVELS_MS, arrow_schema())
    for names in (["value"], ["offset", "value"], ["key", "msg_id"], ["deliver_time", "tags", "partition"],
                  [f.name for f in reversed(READ_SCHEMA.fields)]):
        cols = StructType([READ_SCHEMA[n] for n in names])
        assert read_columns(cols) is cols
        got = records_to_batch([recs], "t", "b", 1, DEFAULT_LEVELS_MS, arrow_schema(cols))
        assert got.schema.names == names
        assert got.to_pydict() == {n: full.column(n).to_pylist() for n in names}
    assert read_columns(READ_SCHEMA) is READ_SCHEMA
    pending = StructType([PENDING_SCHEMA["deliver_time"], PENDING_SCHEMA["msg_id"]])
    assert read_columns(pending, PENDING_SCHEMA) is pending
    # columns that need no property split do not split them
    from chronomq.spark import schema as schema_mod

    monkeypatch.setattr(schema_mod, "_property_map", lambda *a: pytest.fail("properties split"))
    bare = StructType([READ_SCHEMA[n] for n in ("value", "offset", "timestamp", "partition")])
    got = records_to_batch([recs, recs], "t", "b", 1, DEFAULT_LEVELS_MS, arrow_schema(bare))
    assert got.num_rows == 4 and got.column("value").to_pylist() == [b"v0", b"v1"] * 2


@pytest.mark.parametrize(("fields", "says"), [
    ([StructField("value", StringType())], "value is string, not binary"),
    ([StructField("value", BinaryType()), StructField("payload", BinaryType())], "payload is not a column"),
    ([StructField("Value", BinaryType())], r"Value is not a column \(names are case-sensitive: value\)"),
    ([StructField("value", BinaryType()), StructField("value", BinaryType())], "value is named twice"),
    # Spark takes NOT NULL at its word (a null there would be read wrong): refused
    ([StructField("key", BinaryType(), nullable=False)], "key must be nullable"),
    ([StructField("keys", ArrayType(StringType(), containsNull=False))], '"containsNull":false'),
])
def test_a_schema_that_does_not_fit_the_source_is_refused_with_what_is_wrong(
        fields: list[StructField], says: str) -> None:
    with pytest.raises(ValueError, match=says) as e:
        read_columns(StructType(fields))
    assert "may name any of them" in str(e.value) and "offset bigint" in str(e.value)
    with pytest.raises(ValueError, match="it has no column"):
        read_columns(StructType([]))


def test_pending_rows_of_a_narrower_schema() -> None:
    from chronomq.client import PendingMessage

    items = [PendingMessage("ID1", "OFF1", "t", 2, "a", ["k1"], 1_700_000_005_000, 0, 10, "broker-a")]
    cols = StructType([PENDING_SCHEMA["broker"], PENDING_SCHEMA["msg_id"]])
    rows = pending_to_batch(items, arrow_schema(cols)).to_pylist()
    assert rows == [{"broker": "broker-a", "msg_id": "ID1"}]


def test_records_to_batch_reads_property_texts_as_the_client_does() -> None:
    """Odd property texts (no separator, no name, empty values and ids, extra spaces in KEYS) give the
    map, tags, keys and ids that parse_properties and the client's decoder give."""
    texts = ["a\x01b\x02noseparator\x02\x01nameless\x02KEYS\x01  k1   k2 \x02TAGS\x01\x02",
             "", "UNIQ_KEY\x01\x02x\x01\x02", "v\x01with\x01second\x02UNIQ_KEY\x01id-3"]
    recs = _records(*(_stored(b"v", i, {}) for i in range(len(texts))))
    recs.properties = texts
    rows = records_to_batch([recs], "t", "b", 0, DEFAULT_LEVELS_MS, arrow_schema()).to_pylist()
    parsed = [parse_properties(t) for t in texts]
    assert [dict(r["properties"]) for r in rows] == parsed
    assert [r["tags"] for r in rows] == [p.get("TAGS") for p in parsed] == ["", None, None, None]
    assert rows[0]["keys"] == ["k1", "k2"] and rows[0]["key"] == b"k1" and rows[1]["keys"] == []
    assert rows[3]["msg_id"] == "id-3" and parsed[3]["v"] == "with\x01second"
    offset_ids = [m.create_offset_msg_id(("127.0.0.1", 10911), 1000 + i) for i in range(3)]
    assert [r["msg_id"] for r in rows[:3]] == offset_ids  # no UNIQ_KEY, or an empty one


def test_records_to_batch_deliver_time_of_parked_rows() -> None:
    recs = _records(_stored(b"v", 0, {"DELAY": "2"}), _stored(b"v", 1, {}))
    batch = records_to_batch([recs], "SCHEDULE_TOPIC_XXXX", "b", 1, DEFAULT_LEVELS_MS, arrow_schema())
    rows = batch.to_pylist()
    assert int(rows[0]["deliver_time"].timestamp() * 1000) == 1_700_000_000_123 + 5000
    assert rows[1]["deliver_time"] is None


class CappedBroker:
    """A consumer whose broker answers at most ``cap`` records a pull, tagged by offset parity, and whose
    queue holds offsets [lo, hi): to drive range_batches without a broker."""

    def __init__(self, cap: int, lo: int = 0, hi: int = 10_000) -> None:
        self.cap, self.lo, self.hi = cap, lo, hi
        self.pulls: list[tuple[int, int]] = []
        self.outstanding = self.peak = 0  # pulls in flight, now and at most

    async def pull(self, mq: object, offset: int, n: int, *, expression: str, raw: object,
                   bulk: bool = False) -> PullResult:
        assert raw == "bytes" and bulk
        self.pulls.append((offset, n))
        self.outstanding += 1
        self.peak = max(self.peak, self.outstanding)
        try:
            await asyncio.sleep(0)
        finally:
            self.outstanding -= 1
        if offset < self.lo:
            return PullResult(PullStatus.OFFSET_ILLEGAL, self.lo, self.lo, self.hi)
        upto = min(offset + n, offset + self.cap, self.hi)
        body = b"".join(bytes(m.encode_record(_stored(b"v", i, {"TAGS": "odd" if i % 2 else "even"})))
                        for i in range(offset, upto))
        return PullResult(PullStatus.FOUND, upto, self.lo, self.hi, body=body)


def _read_offsets(consumer: CappedBroker, start: int, end: int, tags: str = "*", batch: int = 64,
                  fail_on_data_loss: bool = True) -> list[int]:
    from chronomq.spark.io import ReadSettings, range_batches

    settings = ReadSettings("ns", tags, fail_on_data_loss, batch, 5.0, rows_per_batch=100)

    async def run() -> list[int]:
        out: list[int] = []
        async for b in range_batches(consumer, settings, QueueRange("t", "b", 0, start, end), arrow_schema()):
            out += b.column("offset").to_pylist()
        return out

    return asyncio.run(run())


@pytest.mark.parametrize("cap", [1000, 64, 10])
def test_range_batches_pipelined_pulls_read_each_offset_once(cap: int) -> None:
    c = CappedBroker(cap)
    assert _read_offsets(c, 7, 1000) == list(range(7, 1000))
    from chronomq.spark.io import MAX_PULLS_IN_FLIGHT, PULLS_IN_FLIGHT

    if cap < 64:  # the broker answered fewer than asked: later windows shrink to what it answers, and
        assert c.pulls[-1][1] <= cap  # more of them are in flight, as many messages as 3 full windows
        assert c.peak == min(MAX_PULLS_IN_FLIGHT, PULLS_IN_FLIGHT * -(-64 // cap))
    else:
        assert c.peak == PULLS_IN_FLIGHT
    odd = CappedBroker(cap)
    assert _read_offsets(odd, 7, 300, tags="odd") == list(range(7, 300, 2))
    assert all(b[0] == a[0] + min(a[1], cap) for a, b in zip(odd.pulls, odd.pulls[1:], strict=False))


def test_range_batches_skips_cleaned_offsets_only_when_told() -> None:
    assert _read_offsets(CappedBroker(64, lo=50), 0, 200, fail_on_data_loss=False) == list(range(50, 200))
    with pytest.raises(DataLossError, match=r"offsets 0\.\.49 were cleaned away"):
        _read_offsets(CappedBroker(64, lo=50), 0, 200)


def test_select_records_by_range_and_tag() -> None:
    recs = _records(*(_stored(b"v", i, {"TAGS": "a" if i % 2 else "b"}) for i in range(10, 16)))
    assert select_records(recs, 0, 100, None) is recs
    assert select_records(recs, 12, 15, None).queue_offsets == [12, 13, 14]
    assert select_records(recs, 0, 100, {"a"}).queue_offsets == [11, 13, 15]
    assert select_records(recs, 12, 100, {"b", "c"}).queue_offsets == [12, 14]
    assert len(select_records(recs, 0, 100, {"zz"})) == 0


# --- mode=pending ---------------------------------------------------------------------------------------
def pending(streaming: bool = False, **kw: str):
    return parse_pending_options({**NS, "mode": "pending", **kw}, streaming)


def test_read_mode_default_and_values() -> None:
    assert read_mode({}) == "messages" and read_mode({"MODE": " Pending "}) == "pending"
    assert read_mode({"mode": ""}) == "messages"
    assert read(subscribe="t", mode="messages").subscribe == ("t",)
    with pytest.raises(OptionError, match="'mode': 'later' must be one of messages, pending"):
        read_mode({"mode": "later"})
    with pytest.raises(OptionError, match="own options"):
        read(mode="pending")


def test_pending_options_filters_and_defaults() -> None:
    p = pending()
    assert (p.topic, p.key, p.tag, p.deliver_from_ms, p.deliver_to_ms) == (None, None, None, None, None)
    assert p.page_size == 1000 and p.request_timeout_s == 10.0 and p.namesrv == NS["namesrv"]
    p = pending(Topic="Invoices", key="customer-42", tag="renew", deliverFrom="1767225600000",
                deliverTo="2026-01-01T00:00:01Z", pageSize="7")
    assert (p.topic, p.key, p.tag, p.page_size) == ("Invoices", "customer-42", "renew", 7)
    assert (p.deliver_from_ms, p.deliver_to_ms) == (1_767_225_600_000, 1_767_225_601_000)
    # an ISO timestamp without an offset is UTC; with one it is honoured; milliseconds are kept
    assert pending(deliverFrom="2026-01-01T00:00:00.250").deliver_from_ms == 1_767_225_600_250
    assert pending(deliverFrom="2026-01-01T01:00:00+01:00").deliver_from_ms == 1_767_225_600_000
    assert parse_time_ms("2026-01-01", "x") == 1_767_225_600_000


@pytest.mark.parametrize("kw, text", [
    ({"subscribe": "t"}, r"'subscribe'.* do not apply to mode 'pending'"),
    ({"startingOffsets": "earliest"}, r"'startingOffsets'.* do not apply to mode 'pending'"),
    ({"maxOffsetsPerTrigger": "5", "failOnDataLoss": "false"},
     r"'failOnDataLoss', 'maxOffsetsPerTrigger' do not apply"),
    ({"deliverFrm": "1"}, "unknown pending-mode option"),
    ({"deliverFrom": "tomorrow"}, "neither epoch milliseconds nor an ISO 8601"),
    ({"deliverFrom": "1969-12-31T23:59:59Z"}, "before 1970"),
    ({"deliverFrom": "2000", "deliverTo": "1000"}, "is before 'deliverFrom'"),
    ({"topic": "bad topic!"}, "option 'topic'"),
    ({"key": "a\x01b"}, "control characters"),
    ({"pageSize": "0"}, "must be >= 1"),
    ({"pageSize": "1001"}, "must be <= 1000"),
    ({"namesrv": ""}, "required"),
])
def test_bad_pending_options(kw: dict[str, str], text: str) -> None:
    with pytest.raises(OptionError, match=text):
        pending(**kw)


def test_pending_mode_is_batch_only_and_its_options_are_refused_elsewhere() -> None:
    with pytest.raises(OptionError, match=r"mode 'pending' is a batch read \(spark.read\)"):
        pending(True)
    with pytest.raises(OptionError, match=r"'deliverFrom', 'tag' apply to mode 'pending' only"):
        read(subscribe="t", tag="x", deliverFrom="1")
    # the default mode's own checks are unchanged
    with pytest.raises(OptionError, match="unknown read option"):
        read(subscribe="t", startingOffset="earliest")


def test_pending_schema_and_batch() -> None:
    from datetime import UTC, datetime

    from chronomq.client import PendingMessage

    sch = arrow_schema(PENDING_SCHEMA)
    items = [PendingMessage("ID1", "OFF1", "t", 2, "a", ["k1", "k2"], 1_700_000_005_000,
                            1_700_000_000_000, 10, "broker-a"),
             PendingMessage("ID2", "", "t", 0, None, [], 1_700_000_006_000, 0, 0, "broker-b")]
    batch = pending_to_batch(items, sch)
    assert batch.schema.equals(sch)
    assert [f.name for f in PENDING_SCHEMA.fields] == [
        "msg_id", "offset_msg_id", "topic", "queue_id", "tags", "keys", "deliver_time", "created",
        "body_size", "broker"]
    r0, r1 = batch.to_pylist()
    assert (r0["msg_id"], r0["offset_msg_id"], r0["queue_id"], r0["tags"], r0["keys"]) == (
        "ID1", "OFF1", 2, "a", ["k1", "k2"])
    assert r0["deliver_time"] == datetime.fromtimestamp(1_700_000_005, UTC)
    assert r0["created"] == datetime.fromtimestamp(1_700_000_000, UTC)
    assert (r0["body_size"], r0["broker"]) == (10, "broker-a")
    assert r1["offset_msg_id"] is None and r1["created"] is None and r1["tags"] is None and r1["keys"] == []


def test_acl_credentials_reach_every_client_the_source_builds() -> None:
    creds = {"accessKey": "RocketMQ", "secretKey": "12345678"}
    assert read(subscribe="t", **creds).credentials == ("RocketMQ", "12345678")
    assert read(subscribe="t").credentials is None
    assert parse_write_options({**NS, **creds}).credentials == ("RocketMQ", "12345678")
    assert parse_pending_options({**NS, "mode": "pending", **creds}, False).credentials == ("RocketMQ",
                                                                                           "12345678")
    with pytest.raises(OptionError, match="go together"):
        read(subscribe="t", accessKey="RocketMQ")
    from chronomq.spark.io import ReadSettings

    assert ReadSettings.of(read(subscribe="t", **creds), [1000]).credentials == ("RocketMQ", "12345678")


# --- the workers' interpreter -------------------------------------------------------------------------------
class _Conf:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


class _Context:
    def __init__(self, master: str, conf: dict[str, str] | None = None, exec_: str = "python3") -> None:
        self.master = master
        self.pythonExec = exec_
        self._conf = _Conf(conf or {})

    def getConf(self) -> _Conf:
        return self._conf


@dataclass
class _Session:
    sparkContext: _Context


@pytest.mark.parametrize("master,conf,env,want", [
    ("local[*]", {}, None, "SYS"),                                   # nothing set, local: this interpreter
    ("local-cluster[2,1,1024]", {}, None, "SYS"),
    ("spark://h:7077", {}, None, "python3"),                         # a cluster: Spark's, and a warning
    ("spark://h:7077", {"spark.pyspark.python": "/opt/py"}, None, "/opt/py"),  # the setting is honoured
    ("local[2]", {"spark.pyspark.python": "/opt/py"}, None, "/opt/py"),
    ("local[2]", {}, "/usr/bin/python3.11", "python3"),              # PYSPARK_PYTHON: Spark already used it
])
def test_worker_python_rules(monkeypatch, caplog, master, conf, env, want):
    import sys

    from chronomq.spark import worker_python

    if env is None:
        monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    else:
        monkeypatch.setenv("PYSPARK_PYTHON", env)
    session = _Session(_Context(master, conf))
    expected = sys.executable if want == "SYS" else want
    assert worker_python(session) == expected
    assert session.sparkContext.pythonExec == expected
    warned = any("PYSPARK_PYTHON" in r.getMessage() for r in caplog.records)
    assert warned == (master.startswith("spark://") and not conf)


class DamagingBroker(CappedBroker):
    """A CappedBroker whose answer at ``bad`` is cut short, or which answers FOUND at ``stuck`` with a
    next offset that does not move and records outside the window."""

    def __init__(self, bad: int | None = None, stuck: int | None = None) -> None:
        super().__init__(64)
        self.bad, self.stuck = bad, stuck

    async def pull(self, mq: object, offset: int, n: int, *, expression: str, raw: object,
                   bulk: bool = False) -> PullResult:
        res = await super().pull(mq, offset, n, expression=expression, raw=raw, bulk=bulk)
        if offset == self.bad and res.body:
            return PullResult(PullStatus.FOUND, res.next_offset, res.min_offset, res.max_offset,
                              body=res.body[:-7])
        if offset == self.stuck:
            body = bytes(m.encode_record(_stored(b"v", offset + 5000, {})))
            return PullResult(PullStatus.FOUND, offset, res.min_offset, res.max_offset, body=body)
        return res


def test_range_batches_refuse_an_undecodable_answer_and_one_that_does_not_move_on() -> None:
    from chronomq.spark.io import ChronomqSparkError

    with pytest.raises(ChronomqSparkError, match=r"t@b:0 at offsets 0\.\.127: the broker returned an "
                                                 r"undecodable message body: record length out of range"):
        _read_offsets(DamagingBroker(bad=64), 0, 300)
    with pytest.raises(ChronomqSparkError, match=r"the broker made no progress at offset 128"):
        _read_offsets(DamagingBroker(stuck=128), 0, 300)
