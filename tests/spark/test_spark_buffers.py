"""The Spark source's compiled route from pull answers to Arrow batches (chronomq.client.model.record_buffers,
chronomq.spark.schema.stored_to_batch) against its general route (record_columns, select_records,
records_to_batch): the same batch for every schema, offset window and record, or the general route's own
refusal. No JVM, no broker."""

from __future__ import annotations

import zlib
from typing import Any

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.types import StructType

from chronomq import message as m
from chronomq.client import model
from chronomq.client.model import record_buffers, record_columns
from chronomq.remoting import decode
from chronomq.spark import schema as schema_mod
from chronomq.spark.schema import (
    DEFAULT_LEVELS_MS,
    PROPERTY_DELIVER_MS,
    READ_SCHEMA,
    arrow_schema,
    records_to_batch,
    select_records,
    stored_to_batch,
)
from tests.unit.test_client_decode import _LOCAL, _STORE, _record

native: Any = decode.native
needs_native = pytest.mark.skipif(native is None, reason="chronomq.remoting._decode not in use")
NAMES = [f.name for f in READ_SCHEMA.fields]


def _general(parts: list[tuple[bytes, int, int]], topic: str, names: list[str]) -> Any:
    """The general route's batch, or its refusal (type and message)."""
    sch = arrow_schema(StructType([READ_SCHEMA[n] for n in names]))
    try:
        return records_to_batch([select_records(record_columns(b), lo, hi, None) for b, lo, hi in parts],
                                topic, "broker-a", 3, DEFAULT_LEVELS_MS, sch)
    except Exception as e:  # the refusal itself is what is compared
        return (type(e), str(e))


def _compiled(parts: list[tuple[bytes, int, int]], topic: str, names: list[str]) -> Any:
    sch = arrow_schema(StructType([READ_SCHEMA[n] for n in names]))
    try:
        return stored_to_batch(parts, topic, "broker-a", 3, DEFAULT_LEVELS_MS, sch)
    except Exception as e:
        return (type(e), str(e))


def _alike(parts: list[tuple[bytes, int, int]], topic: str, names: list[str]) -> Any:
    got, want = _compiled(parts, topic, names), _general(parts, topic, names)
    if isinstance(want, tuple):
        assert got == want
    else:
        assert not isinstance(got, tuple), got
        assert got.schema.equals(want.schema) and got.equals(want), (got.to_pylist(), want.to_pylist())
    return got


# --- what the answers are made of ----------------------------------------------------------------------

_word = st.sampled_from(["", " ", "k1", "k 2", "  a  b ", "x" * 40, "0", "-12", "1700000009000", "+5", " 7",
                         "1_000", "1234567890123456", "-", "é", "\x00"])
_name = st.sampled_from([m.PROPERTY_UNIQ_KEY, m.PROPERTY_TAGS, m.PROPERTY_KEYS, m.PROPERTY_TIMER_DELIVER_MS,
                         PROPERTY_DELIVER_MS, "DELAY", "a", "", "KEYSX", "TAG"])
# items with and without a separator or a name, repeated names, values with separators in them
_item = st.one_of(st.tuples(_name, _word).map(lambda nv: f"{nv[0]}\x01{nv[1]}"), _name, _word,
                  st.tuples(_name, _word, _word).map(lambda t: f"{t[0]}\x01{t[1]}\x01{t[2]}"))
_props = st.lists(_item, max_size=8).map(lambda xs: "\x02".join(xs)).flatmap(
    lambda t: st.sampled_from([t, t + "\x02", "\x02" + t]).map(str.encode))


@st.composite
def _answer(draw: st.DrawFn, first: int) -> bytes:
    """An answer of consecutive queue offsets from ``first`` (sometimes a gap or a repeat)."""
    out = []
    qoff = first
    for _ in range(draw(st.integers(0, 6))):
        body = draw(st.binary(max_size=40))
        compressed = draw(st.integers(0, 5)) == 0
        if compressed and draw(st.booleans()):
            body = zlib.compress(body)  # else a compressed flag over bytes that may not inflate
        out.append(_record(draw(st.sampled_from([b"t"] * 6 + [b"%RETRY%g", "tö".encode(), b"\xff"])),
                           draw(_props),
                           body, qid=3, qoff=qoff, phys=draw(st.integers(0, 2**63 - 1)),
                           sys_flag=m.SYSFLAG_COMPRESSED if compressed else 0,
                           born_ts=draw(st.integers(-(2**63), 2**63 - 1)),
                           store_ts=draw(st.integers(0, 2**45)), reconsume=draw(st.integers(0, 20)),
                           born_host=_LOCAL, store_host=draw(st.sampled_from([_LOCAL, _STORE]))))
        qoff += draw(st.sampled_from([1, 1, 1, 0, 2]))
    return b"".join(out)


@st.composite
def _parts(draw: st.DrawFn) -> list[tuple[bytes, int, int]]:
    parts = []
    at = draw(st.integers(0, 5))
    for _ in range(draw(st.integers(1, 4))):
        body = draw(_answer(at))
        lo = at + draw(st.integers(0, 2))
        hi = lo + draw(st.integers(0, 8))
        parts.append((body, lo, hi))
        at += 7
    return parts


# --- the tests ---------------------------------------------------------------------------------------------

@needs_native
def test_kernel_constants_match_the_model_and_the_schema():
    for name in ("VALUE", "PROPERTIES", "KEYS", "TAGS", "MSG_ID", "DELIVER"):
        assert getattr(native, f"WANT_{name}") == getattr(model, f"WANT_{name}")
    assert (native.PROPERTY_KEYS, native.PROPERTY_TAGS) == (m.PROPERTY_KEYS, m.PROPERTY_TAGS)
    assert native.PROPERTY_DELIVER_MS == PROPERTY_DELIVER_MS
    assert native.PROPERTY_TIMER_DELIVER_MS == m.PROPERTY_TIMER_DELIVER_MS
    assert set(schema_mod._WANT) < set(NAMES)


@needs_native
@settings(max_examples=400, deadline=None)
@given(_parts(), st.lists(st.sampled_from(NAMES), min_size=1, unique=True),
       st.sampled_from(["t", m.SCHEDULE_TOPIC]))
def test_the_compiled_route_gives_the_general_routes_batch(parts, names, topic):
    _alike(parts, topic, names)


@needs_native
@settings(max_examples=200, deadline=None)
@given(_parts(), st.data())
def test_damaged_answers_are_refused_as_the_general_route_refuses_them(parts, data):
    body, lo, hi = parts[0]
    buf = bytearray(body)
    if buf:
        at = data.draw(st.integers(0, len(buf) - 1))
        if data.draw(st.booleans()):
            del buf[at:]
        else:
            buf[at] = data.draw(st.integers(0, 255))
    _alike([(bytes(buf), lo, hi), *parts[1:]], "t", NAMES)


def _plain(first: int, n: int, props: dict[str, str]) -> bytes:
    return b"".join(bytes(m.encode_record(m.MessageExt(
        topic="t", body=b"v%d" % i, properties=props, queue_id=3, queue_offset=i,
        commit_log_offset=100 * i, store_timestamp=1_700_000_000_000 + i, store_host=("10.0.0.1", 10911))))
        for i in range(first, first + n))


@needs_native
def test_plain_answers_take_the_compiled_route_and_odd_ones_the_general_one():
    """The compiled route is taken for what producers write (ASCII texts, plain deliver times), the general
    one for the rest, each giving the same batch."""
    usual = {"UNIQ_KEY": "U1", "KEYS": "k1 k2", "TAGS": "a", PROPERTY_DELIVER_MS: "1700000009000"}
    parts = [(_plain(0, 32, usual), 0, 32), (_plain(32, 32, {}), 32, 40)]
    assert record_buffers(parts, 63) is not None
    batch = _alike(parts, "t", NAMES)
    assert batch.num_rows == 40 and batch.column("offset").to_pylist() == list(range(40))
    assert batch.column("msg_id").to_pylist()[32] == m.create_offset_msg_id(("10.0.0.1", 10911), 3200)
    for odd in ({"TAGS": "é"}, {PROPERTY_DELIVER_MS: " 5"}, {m.PROPERTY_TIMER_DELIVER_MS: "1_000"}):
        parts = [(_plain(0, 4, odd), 0, 4)]
        assert record_buffers(parts, 63) is None
        _alike(parts, "t", NAMES)
