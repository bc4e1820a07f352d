"""The compiled kernels (chronomq.store._speedups) against the pure-Python functions they replace: same
results, same refusals, same exception types, on valid, edge and corrupt input."""

from __future__ import annotations

import ast
import gc
import inspect
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronomq import message
from chronomq.broker.processors import send
from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.delay import delivery
from chronomq.delay.timer import append, files
from chronomq.message import MessageExt, MessageFormatError
from chronomq.remoting import codec
from chronomq.store import MessageStore, commitlog, index, put, reads, reput, speedups
from chronomq.store.consumequeue import UNIT
from chronomq.store.types import DispatchRequest, EncodedRecord

native = speedups.native
needs_native = pytest.mark.skipif(native is None, reason="chronomq.store._speedups not in use")

HOST = struct.pack(">4si", bytes((127, 0, 0, 1)), 10911)
prop_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
prop_dicts = st.dictionaries(prop_text, prop_text, max_size=6)


def _can_build() -> bool:
    include = sysconfig.get_paths()["include"]
    return shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc") is not None and \
        os.path.exists(os.path.join(include, "Python.h"))


def test_the_kernels_are_built_unless_pure_python_is_asked_for():
    # The README's install builds the extension wherever a C compiler and Python's headers are; a
    # machine where it silently did not build would run the slow path, which this makes visible.
    if os.environ.get(speedups.PURE_ENV, "") not in ("", "0"):
        assert native is None and speedups.describe().startswith("pure Python")
    elif not _can_build():
        assert native is None and speedups.describe() == "pure Python (not built)"
    else:
        assert native is not None, "chronomq.store._speedups was not built (C compiler and zlib.h needed)"
        assert speedups.describe().startswith("compiled")
        assert speedups.kernels.property_fields is native.property_fields
        assert speedups.kernels.splice is native.splice
        assert append._encode_record is native.encode_record
        assert send._batch_items is native.batch_items


@needs_native
def test_kernel_constants_match_the_message_module():
    assert native.DEF_MAGIC_V1 == message.MAGIC_V1
    assert native.RECORD_FIXED_SIZE == message.RECORD_FIXED_SIZE
    assert native.POS_BODY == message.POS_BODY
    assert native.MAX_PROPERTIES_LENGTH == message.MAX_PROPERTIES_LENGTH
    assert native.HOST_V6_FLAGS == message.SYSFLAG_BORNHOST_V6 | message.SYSFLAG_STOREHOST_V6
    assert (native.PROPERTY_KEYS, native.PROPERTY_TAGS, native.PROPERTY_UNIQ_KEY) == (
        message.PROPERTY_KEYS, message.PROPERTY_TAGS, message.PROPERTY_UNIQ_KEY)
    assert native.PROPERTY_TIMER_DELIVER_MS == message.PROPERTY_TIMER_DELIVER_MS


def test_pure_python_switch_runs_the_pure_kernels_end_to_end(tmp_path):
    code = (
        "from chronomq.store import put, commitlog, speedups;"
        "assert speedups.native is None;"
        "assert speedups.kernels.property_fields is put.property_fields_py;"
        "assert speedups.kernels.splice is commitlog.splice_py;"
        "assert speedups.kernels.append_run is put.append_run_py;"
        "from chronomq import message; from chronomq.remoting import codec;"
        "from chronomq.delay.timer import append; from chronomq.broker.processors import send;"
        "assert append._encode_record is message.encode_record and send._batch_items is codec.batch_items;"
        "print(speedups.describe())"
    )
    env = dict(os.environ, CHRONOMQ_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CHRONOMQ_PURE_PYTHON set" in out.stdout


def _outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except Exception as e:  # compared by type: both sides must refuse the same way
        return "raised", type(e)


# --- properties ---------------------------------------------------------------------------------------------
@needs_native
@settings(max_examples=300, deadline=None)
@given(prop_dicts)
def test_property_fields_matches_pure(props):
    assert _outcome(native.property_fields, props) == _outcome(put.property_fields_py, props)


@needs_native
@pytest.mark.parametrize("props", [
    {}, {"": "x"}, {"a\x01": "x"}, {"a": "x\x02"}, {"KEYS": "  k1  k2 ", "TAGS": "t", "UNIQ_KEY": "u"},
    {"KEYS": ""}, {"a": "\ud800"}, {"a": "\ud800", "b\x01": "x"}, {"a": 1}, {"a": "x" * 40_000},
    {"é": "ü" * 10_000}, {"名": "値"},
])
def test_property_fields_edges(props):
    assert _outcome(native.property_fields, props) == _outcome(put.property_fields_py, props)


# --- records ------------------------------------------------------------------------------------------------
def _record(topic: str, body: bytes, props: dict[str, str], sys_flag: int = 0, props_b: bytes | None = None
            ) -> bytes:
    msg = MessageExt(topic, body, dict(props), 7, 3, sys_flag, 1_700_000_000_123, ("10.0.0.1", 4242), 0,
                     ("127.0.0.1", 10911), 2, 0, 0, 0, 0)
    if props_b is None:
        props_b = put.property_fields_py(props)[0]
    rec = bytearray(commitlog.encode(msg, topic.encode(), props_b, HOST, message.pack_host(msg.born_host)))
    struct.pack_into(">qq", rec, 20, 11, 12345)  # stored fields the copy must not keep
    struct.pack_into(">q", rec, 56, 1_700_000_000_999)
    return bytes(rec)


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(whitelist_categories=("Ll", "Lu", "Nd")), min_size=1, max_size=30),
       st.binary(max_size=300), prop_dicts.filter(lambda p: put.property_fields_py(p).__class__ is tuple),
       st.integers(0, 3), st.binary(max_size=20))
def test_splice_and_record_to_put_match_pure(topic, body, props, pad, new_props):
    rec = _record(topic, body, props, sys_flag=0x30)
    buf = bytes(pad) + rec + bytes(pad)
    for view in (buf, bytearray(buf), memoryview(buf)):
        args = (view, pad, len(rec), b"RealTopic", 5, new_props, HOST)
        assert native.splice(*args) == commitlog.splice_py(*args)
    got = native.record_to_put(buf, pad, len(rec))
    assert got == (topic, 3, message.decode_properties(put.property_fields_py(props)[0].decode()))


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "bc", "\x01", "\x02", "é", "名"]), max_size=20)
       .map(lambda parts: "".join(parts).encode())
       | st.text(max_size=60).map(str.encode) | st.binary(max_size=40))
def test_record_to_put_parses_any_properties_text_as_pure(props_b):
    # properties as another writer may have stored them: empty items, no separator, empty names,
    # repeated names, text that is not UTF-8
    rec = _record("T", b"b", {}, props_b=props_b)
    assert _outcome(native.record_to_put, rec, 0, len(rec)) == _outcome(delivery.record_to_put_py, rec, 0,
                                                                         len(rec))


@needs_native
@pytest.mark.parametrize("text", ["", "\x02\x02", "a\x01b\x02", "a\x01b", "\x01b\x02c\x01d\x02",
                                  "a\x01b\x01c\x02a\x01z\x02", "noseparator\x02", "ü\x01名\x02"])
def test_record_to_put_properties_edges(text):
    rec = _record("T", b"b", {}, props_b=text.encode())
    assert native.record_to_put(rec, 0, len(rec)) == delivery.record_to_put_py(rec, 0, len(rec))


@needs_native
def test_corrupt_records_are_refused_the_same_way():
    rec = _record("T", b"hello", {"KEYS": "k", "TAGS": "t"})
    cases = [
        (rec, 0, len(rec) - 1),                # size does not match TOTALSIZE
        (rec, 0, len(rec) + 1),                # past the buffer
        (rec, 1, len(rec)),                    # misaligned
        (rec[:50], 0, 50),                     # shorter than a record's fixed part
        (b"\x00" * 4 + rec[4:], 0, len(rec)),  # TOTALSIZE 0
        (rec[:4] + b"\x00\x00\x00\x01" + rec[8:], 0, len(rec)),  # bad magic
        (rec[:84] + struct.pack(">i", -1) + rec[88:], 0, len(rec)),  # negative body length
        (rec[:84] + struct.pack(">i", 10_000) + rec[88:], 0, len(rec)),  # body past the end
        (rec[:93] + b"\xff" + rec[94:], 0, len(rec)),  # topic length past the end
        (rec[:94] + b"\xff" + rec[95:], 0, len(rec)),  # topic not UTF-8
        (rec[:-3] + b"\xff\x01x", 0, len(rec)),  # properties not UTF-8
    ]
    for buf, pos, size in cases:
        want = _outcome(delivery.record_to_put_py, buf, pos, size)
        assert _outcome(native.record_to_put, buf, pos, size) == want, (buf[:100], pos, size)
        if want[0] == "raised":
            assert want[1] is MessageFormatError
        s_want = _outcome(commitlog.splice_py, buf, pos, size, b"R", 0, b"", HOST)
        s_got = _outcome(native.splice, buf, pos, size, b"R", 0, b"", HOST)
        assert s_got[0] == s_want[0], (buf[:100], pos, size)
        if s_want[0] == "ok":
            assert s_got == s_want
    # a negative position (no caller passes one): the pure parser fails inside struct, the kernel refuses
    with pytest.raises(MessageFormatError):
        native.record_to_put(rec, -1, len(rec))
    with pytest.raises(ValueError):
        native.splice(rec, -1, len(rec), b"R", 0, b"", HOST)


@needs_native
def test_splice_refuses_fields_wider_than_their_slots():
    rec = _record("T", b"x", {})
    with pytest.raises(ValueError):
        native.splice(rec, 0, len(rec), b"t" * 256, 0, b"", HOST)
    with pytest.raises(ValueError):
        native.splice(rec, 0, len(rec), b"t", 1 << 31, b"", HOST)
    with pytest.raises(ValueError):
        native.splice(rec, 0, len(rec), b"t", 0, b"p" * 65_536, HOST)


# --- the schedule path: batch bodies and record encoding ----------------------------------------------------
def _batch(items: list[tuple[bytes, dict[str, str], int]]) -> bytes:
    return codec.encode_batch_body([codec.BatchItem(body=b, properties=p, flag=f) for b, p, f in items])


clean_props = prop_dicts.filter(lambda p: put.property_fields_py(p).__class__ is tuple)


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=200), clean_props, st.integers(-(1 << 31), (1 << 31) - 1)),
                max_size=6))
def test_batch_items_match_pure(items):
    body = _batch(items)
    for view in (body, bytearray(body)):
        got = native.batch_items(view)
        assert got == codec.batch_items(view)
        assert got == [(b, p, f) for b, p, f in items] or any("\x01" in k or "\x02" in k or not k
                                                              for _b, p, _f in items for k in p)


@needs_native
@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=120), st.data())
def test_batch_items_refuse_any_damage_as_pure(noise, data):
    # random bytes, and a valid batch cut or overwritten at a random place
    body = _batch([(b"hello", {"KEYS": "k", "TIMER_DELIVER_MS": "1"}, 0), (b"", {}, 3)])
    cut = data.draw(st.integers(0, len(body)))
    at = data.draw(st.integers(0, len(body) - 1))
    damaged = bytearray(body)
    damaged[at] = data.draw(st.integers(0, 255))
    for buf in (noise, body[:cut], bytes(damaged)):
        want = _outcome(codec.batch_items, buf)
        assert _outcome(native.batch_items, buf) == want, buf
        if want[0] == "raised":
            assert want[1] is MessageFormatError


def _message(topic: str, body: bytes, props: dict[str, str], **fields) -> MessageExt:
    return MessageExt(topic, body, props, **fields)


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=140),
       st.binary(max_size=300), prop_dicts, st.integers(-(1 << 31), (1 << 31) - 1), st.integers(0, 0xFF),
       st.sampled_from([("10.0.0.1", 4242), ("::1", 1), ("not an ip", 7), ("127.0.0.1", 70_000_000_000)]),
       st.integers(-(1 << 63), (1 << 63) - 1), st.integers(0, (1 << 31) - 1))
def test_encode_record_matches_pure(topic, body, props, queue_id, sys_flag, born_host, born_ts, crc):
    msg = _message(topic, body, props, queue_id=queue_id, sys_flag=sys_flag, born_host=born_host,
                   born_timestamp=born_ts, store_host=("127.0.0.1", 10911), body_crc=crc, flag=5,
                   reconsume_times=2, store_timestamp=9, queue_offset=1, commit_log_offset=2,
                   prepared_transaction_offset=3)
    assert _outcome(native.encode_record, msg) == _outcome(message.encode_record, msg)
    text = message.encode_properties(props)
    assert _outcome(native.encode_record, msg, text) == _outcome(message.encode_record, msg, text)


@needs_native
@pytest.mark.parametrize("fields", [
    {"queue_id": 1 << 31}, {"flag": -(1 << 31) - 1}, {"queue_offset": 1 << 63}, {"born_timestamp": "1"},
    {"reconsume_times": 1.5}, {"sys_flag": 0x30}, {"body": bytearray(b"ba")}, {"body": memoryview(b"mv")},
    {"properties": {"a": 1}}, {"properties": {"a": "\ud800"}}, {"properties": {"k": "v" * 40_000}},
    {"topic": "t" * 128}, {"topic": "名" * 43}, {"born_host": ["10.0.0.1", 1]},
])
def test_encode_record_edges(fields):
    msg = _message(fields.pop("topic", "T"), fields.pop("body", b"body"),
                   fields.pop("properties", {"a": "b"}), **fields)
    got, want = _outcome(native.encode_record, msg), _outcome(message.encode_record, msg)
    assert got == want


# --- the deliver time of a delivered copy (pull lateness) ---------------------------------------------------
_DUE = "TIMER_DELIVER_MS"
due_values = st.one_of(st.integers(0, 10**25).map(str),
                       st.sampled_from(["", "12a", "-5", "٣", " 7", "1\x01"]), prop_text)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80), prop_dicts, due_values,
       st.sampled_from(["", "X", "a\x01b\x02"]), st.booleans(), st.integers(0, 40))
def test_due_ms_of_matches_pure(body, props, due, name_prefix, in_body, cut):
    from chronomq.broker.processors import pull

    props = {**props, name_prefix + _DUE: due}
    if in_body:  # the mark inside the body never counts
        body = body + f"\x02{_DUE}\x0199".encode()
    rec = bytes(message.encode_record(_message("T", body, props)))
    for r in (rec, rec[: max(0, len(rec) - cut)], rec[:60]):
        assert _outcome(native.due_ms_of, r) == _outcome(pull.due_ms_of_py, r)
    if not name_prefix and due.isdigit() and due.isascii():
        assert native.due_ms_of(rec) == int(due)


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=40), prop_dicts, st.one_of(st.none(), due_values),
                          st.integers(0, 30)), max_size=12),
       st.one_of(st.integers(0, 1 << 45), st.integers(-(1 << 70), 1 << 70)))
def test_count_lateness_matches_pure(rows, now):
    from chronomq.broker.processors import pull

    records = []
    for body, props, due, cut in rows:
        if due is not None:
            props = {**props, _DUE: due}
        rec = bytes(message.encode_record(_message("T", body, props)))
        records.append(rec[: len(rec) - cut] if cut < 5 else rec)
    got: dict = {3: 1}
    want: dict = {3: 1}
    native.count_lateness(records, now, got)
    pull.count_lateness_py(records, now, want)
    assert got == want and all(type(k) is int for k in got)


def test_count_lateness_counts_by_value():
    from chronomq.broker.processors import pull

    def rec(due: str | None) -> bytes:
        return bytes(message.encode_record(_message("T", b"b", {} if due is None else {_DUE: due})))

    records = [rec("1000"), rec("1000"), rec("990"), rec("2000"), rec(None), rec("x1"), rec("9" * 25)]
    for fn in (pull.count_lateness_py, *(() if native is None else (native.count_lateness,))):
        lates: dict = {}
        fn(records, 1_010, lates)
        assert lates == {10: 2, 20: 1, 0: 2}, fn  # a due time ahead of now counts 0, as does 25 digits


@needs_native
def test_due_ms_of_on_damaged_records():
    from chronomq.broker.processors import pull

    rec = bytes(message.encode_record(_message("T", b"body", {_DUE: "1764000000000"})))
    assert native.due_ms_of(rec) == pull.due_ms_of_py(rec) == 1764000000000
    bad_len = bytearray(rec)
    bad_len[message.POS_BODY - 4 : message.POS_BODY] = (-1).to_bytes(4, "big", signed=True)
    too_long = bytearray(rec)
    too_long[message.POS_BODY - 4 : message.POS_BODY] = (len(rec)).to_bytes(4, "big")
    for r in (b"", rec[:90], bytes(bad_len), bytes(too_long), rec.replace(b"1764", b"17x4")):
        assert _outcome(native.due_ms_of, r) == _outcome(pull.due_ms_of_py, r)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=60), prop_dicts, st.sampled_from(["", "src", "due", "both"]),
                          st.booleans(), st.integers(0, 40)), max_size=6))
def test_props_marks_matches_pure_and_never_reads_a_body(items):
    """The marks a pull answer is searched for, in the records' properties only: a mark in a body does
    not count; a record cut short counts as holding every mark."""
    from chronomq.broker.processors import pull

    records, want = [], 0
    for body, props, which, in_body, cut in items:
        props = dict(props)
        if which in ("src", "both"):
            props["__CHRONOMQ_DELAY_SRC"] = "3:1:100"
        if which in ("due", "both"):
            props[_DUE] = "1764000000000"
        if in_body:
            body = body + pull._SRC_MARK + pull._DUE_MARK
        rec = bytes(message.encode_record(_message("T", body, props)))
        records.append(rec[: len(rec) - cut] if cut > 30 else rec)
    for rs in (records, records[:1], []):
        got = native.props_marks(rs, pull._MARKS)
        assert got == pull.props_marks_py(rs, pull._MARKS)
    if all(cut <= 30 for *_, cut in items):
        want = ((1 if any(w in ("src", "both") for _, _, w, _, _ in items) else 0)
                | (2 if any(w in ("due", "both") for _, _, w, _, _ in items) else 0))
        assert native.props_marks(records, pull._MARKS) == want


@needs_native
def test_props_marks_on_damaged_records():
    from chronomq.broker.processors import pull

    rec = bytes(message.encode_record(_message("T", b"body", {})))
    bad_len = bytearray(rec)
    bad_len[message.POS_BODY - 4 : message.POS_BODY] = (-1).to_bytes(4, "big", signed=True)
    for r in (b"", rec[:90], bytes(bad_len), memoryview(rec)):
        assert native.props_marks([rec, r], pull._MARKS) == pull.props_marks_py([rec, r], pull._MARKS)
    assert native.props_marks([rec[:50]], pull._MARKS) == 3  # damaged: every mark, the exact path decides
    with pytest.raises(TypeError):
        native.props_marks([rec], ("not bytes",))


# --- the commit-log append of a run of records -----------------------------------------------------------
@needs_native
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=91, max_size=300), st.integers(-(1 << 62), 1 << 62),
                          st.one_of(st.none(), st.integers(0, 1 << 40)),
                          st.one_of(st.none(), st.lists(prop_text, max_size=3)),
                          st.one_of(st.none(), prop_text)), max_size=12),
       st.integers(0, 64), st.integers(0, 1 << 50), st.integers(0, 1 << 40), st.integers(0, 1 << 45))
def test_append_run_matches_pure(entries, r, wrote, qoff, ts):
    size = r + sum(len(e[0]) for e in entries) + 64
    results = []
    for fn in (native.append_run, put.append_run_py):
        buf, pending = bytearray(size), [("earlier",)]
        got = fn(buf, r, wrote, qoff, ts, [EncodedRecord(bytearray(e[0]) if i % 2 else e[0], *e[1:])
                                            for i, e in enumerate(entries)], "T", 3, pending)
        results.append((got, bytes(buf), pending))
    assert results[0] == results[1]
    _, buf, pending = results[0]
    assert [p.queue_offset for p in pending[1:]] == list(range(qoff, qoff + len(entries)))
    for p in pending[1:]:  # each copy carries its queue offset, physical offset and store time
        at = r + p.phys - wrote
        assert struct.unpack_from(">qq", buf, at + 20) == (p.queue_offset, p.phys)
        assert struct.unpack_from(">q", buf, at + 56) == (ts,)


@needs_native
@pytest.mark.parametrize("r, size", [(0, 120), (60, 41), (-1, 91), (40, 10)])
def test_append_run_refuses_a_run_larger_than_the_buffer(r, size):
    for fn in (native.append_run, put.append_run_py):
        with pytest.raises(ValueError):
            fn(bytearray(100), r, 0, 0, 1, [EncodedRecord(b"r" * size, 0, None, None, None)], "T", 0, [])


@pytest.mark.parametrize("kernel", ["compiled", "pure"])
def test_append_run_builds_dispatch_requests_field_by_field(kernel):
    # the kernel builds DispatchRequest from positions: these must be the class's fields, by name
    if kernel == "compiled" and native is None:
        pytest.skip("chronomq.store._speedups not in use")
    fn = native.append_run if kernel == "compiled" else put.append_run_py
    entries = [EncodedRecord(b"a" * 100, 11, None, ["k1", "k2"], "U1"),
               EncodedRecord(b"b" * 91, 0, 5000, None, None)]
    pending: list[DispatchRequest] = []
    assert fn(bytearray(400), 10, 1000, 7, 50, entries, "T", 3, pending) == (201, 1191, 9)
    assert [type(p) for p in pending] == [DispatchRequest, DispatchRequest]
    assert pending[0]._asdict() == {"phys": 1000, "size": 100, "topic": "T", "queue_id": 3, "queue_offset": 7,
                                    "tags_code": 11, "store_timestamp": 50, "keys": ["k1", "k2"],
                                    "uniq_key": "U1"}
    assert pending[1]._asdict() == {"phys": 1100, "size": 91, "topic": "T", "queue_id": 3, "queue_offset": 8,
                                    "tags_code": 5050, "store_timestamp": 50, "keys": None, "uniq_key": None}


@needs_native
def test_a_kernel_built_dispatch_request_is_left_to_the_cycle_collector_only_when_it_holds_a_container():
    # as CPython untracks a plain tuple of atomic items: a request without KEYS words is never traversed
    pending: list[DispatchRequest] = []
    entries = [EncodedRecord(b"a" * 100, 1, None, None, "U1"),
               EncodedRecord(b"b" * 100, 1, None, ["k"], "U2"),
               EncodedRecord(b"c" * 100, 0, 5000, None, None)]
    native.append_run(bytearray(400), 0, 0, 0, 5, entries, "T", 3, pending)
    assert [gc.is_tracked(p) for p in pending] == [False, True, False]


# --- the dispatcher's consume-queue units -----------------------------------------------------------------
def _requests(rows):
    """Requests in commit-log order from (topic, queue, offset step, size, tags code) rows: each queue's
    offsets run on from 0 (a step of 0 repeats one, 2 leaves a gap), topics as separate objects."""
    nxt: dict[tuple[str, int], int] = {}
    out, phys = [], 1000
    for ts, (topic, qid, step, size, tags) in enumerate(rows):
        key = (topic, qid)
        off = nxt.get(key, -1) + step if key in nxt else 0
        nxt[key] = off
        out.append(DispatchRequest(phys, size, "".join(list(topic)), qid, off, tags, ts, None, None))
        phys += size
    return out


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["A", "B", "%RETRY%g"]), st.integers(0, 3),
                          st.sampled_from([1, 1, 1, 0, 2]), st.integers(0, (1 << 31) - 1),
                          st.integers(-(1 << 63), (1 << 63) - 1)), max_size=40))
def test_queue_runs_matches_pure(rows):
    batch = _requests(rows)
    assert native.queue_runs(batch) == reput.queue_runs_py(batch)


@pytest.mark.parametrize("kernel", ["compiled", "pure"])
def test_queue_runs_groups_by_queue_and_splits_where_offsets_break(kernel):
    if kernel == "compiled" and native is None:
        pytest.skip("chronomq.store._speedups not in use")
    fn = native.queue_runs if kernel == "compiled" else reput.queue_runs_py

    def req(phys, topic, qid, off, tags, ts):
        return DispatchRequest(phys, 100, topic, qid, off, tags, ts, None, None)

    batch = [req(0, "T", 1, 5, 7, 10), req(100, "T", 2, 0, 8, 11), req(200, "T", 1, 6, -1, 12),
             req(300, "T", 1, 9, 9, 13), req(400, "T", 2, 1, 1 << 40, 14)]
    assert fn(batch) == [
        ("T", 1, 5, struct.pack(">qiqqiq", 0, 100, 7, 200, 100, -1), 2, 12),
        ("T", 1, 9, struct.pack(">qiq", 300, 100, 9), 1, 13),
        ("T", 2, 0, struct.pack(">qiqqiq", 100, 100, 8, 400, 100, 1 << 40), 2, 14),
    ]
    assert fn([]) == []


@needs_native
@pytest.mark.parametrize("field, value", [("size", 1 << 31), ("phys", 1 << 63), ("tags_code", -(1 << 63) - 1),
                                          ("size", "12")])
def test_queue_runs_refuses_what_the_unit_cannot_hold_as_struct_does(field, value):
    batch = [DispatchRequest(0, 100, "T", 0, 0, 0, 1, None, None)._replace(**{field: value})]
    for fn in (native.queue_runs, reput.queue_runs_py):
        with pytest.raises(struct.error):
            fn(batch)


# --- a pull's records from its queue units -----------------------------------------------------------------
def _filled_store(root):
    """A store with records of 100-2,000 bytes over several 16 KiB commit-log segments; its records'
    (offset, size)."""
    store = MessageStore(BrokerConfig(storePathRootDir=str(root), mappedFileSizeCommitLog=16 * 1024,
                                      maxHashSlotNum=64, maxIndexNum=128), VirtualClock())
    store.start()
    placed = []
    for i in range(40):
        res = store.put_message(MessageExt(topic="T", body=bytes([i]) * (60 + (i * 277) % 1900),
                                           born_timestamp=1, born_host=("127.0.0.1", 1)))
        assert res.append is not None
        placed.append((res.append.wrote_offset, res.append.wrote_bytes))
    return store, placed


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    store, placed = _filled_store(tmp_path_factory.mktemp("read_units"))
    yield store._cl, placed
    store.shutdown()


def _unit_rows(placed, wrote):
    """A queue unit: a stored record, an empty unit, or any offset and size (beyond the log, inside a
    record, negative)."""
    return st.one_of(st.sampled_from(placed),
                     st.tuples(st.sampled_from([p for p, _ in placed]), st.integers(-3, 0)),
                     st.tuples(st.integers(-50, wrote + 3000), st.integers(-3, 3000)))


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_read_units_matches_pure(filled, data):
    cl, placed = filled
    rows = data.draw(st.lists(_unit_rows(placed, cl.wrote), max_size=20))
    units = b"".join(UNIT.pack(p, s, 0) for p, s in rows)
    min_phys = data.draw(st.sampled_from([0, placed[5][0], placed[30][0] + 1, cl.wrote + 1]))
    max_msgs, max_bytes = data.draw(st.integers(1, 25)), data.draw(st.integers(1, 40_000))
    want = reads.read_units_py(units, cl, min_phys, max_msgs, max_bytes)
    assert native.read_units(units, cl, min_phys, max_msgs, max_bytes) == want
    out, used, removed = want
    assert used <= len(rows) and removed <= used and len(out) <= max_msgs


@pytest.mark.parametrize("kernel", ["compiled", "pure"])
def test_read_units_reads_skips_and_counts_as_a_pull_does(filled, kernel):
    if kernel == "compiled" and native is None:
        pytest.skip("chronomq.store._speedups not in use")
    fn = native.read_units if kernel == "compiled" else reads.read_units_py
    cl, placed = filled
    (p0, s0), (p1, s1), (p2, s2) = placed[3:6]
    units = b"".join(UNIT.pack(p, s, 7) for p, s in [(p0, s0), (p1, 0), (p2, s2), (cl.wrote, 10), (p1, s1)])
    assert fn(units, cl, 0, 10, 1 << 20) == ([cl.read(p0, s0), cl.read(p2, s2), cl.read(p1, s1)], 5, 1)
    # cleaned below p2: the first counts as removed; the byte limit stops after the first record
    assert fn(units, cl, p2, 10, 1) == ([cl.read(p2, s2)], 3, 1)
    assert fn(units, cl, 0, 1, 1 << 20) == ([cl.read(p0, s0)], 1, 0)
    assert fn(b"", cl, 0, 10, 1 << 20) == ([], 0, 0)
    with pytest.raises(struct.error):  # units are whole or refused
        fn(units[:-1], cl, 0, 10, 1 << 20)


@pytest.mark.parametrize("kernel", ["compiled", "pure"])
def test_read_units_counts_a_segment_closed_meanwhile_as_removed(tmp_path, kernel):
    if kernel == "compiled" and native is None:
        pytest.skip("chronomq.store._speedups not in use")
    fn = native.read_units if kernel == "compiled" else reads.read_units_py
    store, placed = _filled_store(tmp_path)
    cl = store._cl
    try:
        assert len(cl.segments) > 2
        first = cl.segments[0]
        inside = [(p, s) for p, s in placed if p + s <= first.end]
        later = placed[-1]
        first.mm.close()  # as the cleaner does while a pull reads
        units = b"".join(UNIT.pack(p, s, 0) for p, s in [*inside, later])
        assert fn(units, cl, 0, 100, 1 << 20) == ([cl.read(*later)], len(inside) + 1, len(inside))
    finally:
        store.shutdown()


# --- the chooser --------------------------------------------------------------------------------------------
def _params(fn) -> list[bool]:
    """Whether each positional parameter is required (self left out)."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    return [p.default is p.empty for p in params]


def test_kernels_is_the_compiled_module_or_the_registered_pure_twins():
    k = speedups.kernels
    if native is not None:
        assert k is native
    else:
        assert (k.splice, k.property_fields, k.append_run) == (
            commitlog.splice_py, put.property_fields_py, put.append_run_py)
        assert k.crc32 is zlib.crc32 and k.encode_record is message.encode_record
    assert {"splice", "property_fields", "append_run", "crc32", "encode_record"} <= speedups.twins.keys()


def test_each_pure_twin_and_kernel_takes_the_parameters_the_protocol_describes():
    assert {"splice", "append_run", "pack_timer_records", "mark_delivered_run"} <= speedups.KERNEL_NAMES
    for name, fn in speedups.twins.items():
        assert _params(fn) == _params(getattr(speedups.Kernels, name)), name
    if native is not None:
        for name in speedups.KERNEL_NAMES:
            assert _params(getattr(native, name)) == _params(getattr(speedups.Kernels, name)), name


@needs_native
def test_the_stub_mypy_reads_has_every_compiled_function_with_its_parameters():
    stub = ast.parse(Path(speedups.__file__).with_name("_speedups.pyi").read_text())
    declared = {f.name: [a.arg for a in f.args.args] for f in stub.body if isinstance(f, ast.FunctionDef)}
    compiled = {name for name, v in vars(native).items() if type(v) is type(native.splice)}
    assert set(declared) == compiled
    for name, args in declared.items():
        assert list(inspect.signature(getattr(native, name)).parameters) == args, name


def test_a_twin_is_registered_only_under_a_kernels_name():
    with pytest.raises(ValueError):
        speedups.pure_twin("splice_fast")
    with pytest.raises(AttributeError, match="no pure twin of the kernel 'nothing'"):
        speedups._PureKernels().nothing  # noqa: B018


# --- the timer's schedule path ----------------------------------------------------------------------------
key_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=" "), min_size=1,
                   max_size=10)


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["T", "Topic-2", "ü"]), st.integers(0, 1 << 45),
                          st.binary(max_size=300), key_text,
                          st.one_of(st.none(), st.lists(st.one_of(key_text, st.just("")), max_size=3))),
                min_size=1, max_size=12),
       st.integers(0, 1 << 40), st.integers(-1, 1 << 40), st.integers(0, 5_000), st.sampled_from([700, 4096]))
def test_pack_timer_records_matches_pure(entries, now, origin, pos, seg_size):
    from chronomq.delay.timer.types import ScheduleResult

    encoded = []
    for topic, deliver, rec, uniq, keys in entries:
        props = {"UNIQ_KEY": uniq}
        if keys is not None:
            props["KEYS"] = " ".join(keys)
        encoded.append((MessageExt(topic=topic, body=b"x", properties=props), deliver, bytearray(rec)))
    tids = {"T": 1, "Topic-2": 2, "ü": 70_000}
    outs = []
    for fn in (append.pack_timer_records_py, native.pack_timer_records):
        placed: list = []
        hashes: list = []
        results: list = []
        writes, end = fn(encoded, tids, now, origin, pos, seg_size, placed, hashes, results, ScheduleResult,
                         "C0A8000100002A9F")
        outs.append(([(p, bytes(c)) for p, c in writes], end, placed, hashes, results))
    assert outs[0] == outs[1]


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 44), st.integers(0, 1 << 50), st.integers(0, 1000),
                          st.integers(0, 1 << 20), st.integers(64, 1 << 22)), min_size=1, max_size=30),
       st.integers(0, 1 << 40), st.sampled_from([1, 100, 1000]), st.integers(0, 1 << 30),
       st.sampled_from([1, 7, 4096]),
       st.dictionaries(st.integers(0, 100), st.integers(0, 1 << 40), max_size=3), st.integers(-1, 1 << 40),
       st.dictionaries(st.integers(0, 1 << 44), st.integers(0, 1 << 40), max_size=5))
def test_pack_index_entries_matches_pure(links, floor, slot_ms, start_idx, per_seg, seg_max, hot, wheel):
    outs = []
    for fn in (append.pack_index_entries_py, native.pack_index_entries):
        seg = dict(seg_max)
        buf, heads, items, min_deliver = fn(links, floor, slot_ms, start_idx, per_seg, seg, hot,
                                            lambda s: wheel.get(s, 0))
        outs.append((bytes(buf), heads, items, min_deliver, seg))
    assert outs[0] == outs[1]


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, (1 << 31) - 1), st.integers(0, 1 << 50)), min_size=1, max_size=30),
       st.integers(0, 1 << 30), st.sampled_from([1, 3, 1024, 4096]), st.integers(0, 1 << 32),
       st.sets(st.integers(0, 7)))
def test_pack_hash_entries_matches_pure(items, count, buckets, seed, backed):
    import mmap
    import random

    bmap = mmap.mmap(-1, buckets * 8)
    bmap[:] = random.Random(seed).randbytes(buckets * 8)
    try:
        got = [fn(items, count, buckets, bmap, backed)
               for fn in (files.pack_hash_entries_py, native.pack_hash_entries)]
        assert (bytes(got[0][0]), *got[0][1:]) == (bytes(got[1][0]), *got[1][1:])
    finally:
        bmap.close()


def test_the_timer_kernels_are_in_use_when_built():
    if native is None:
        assert append.pack_timer_records is append.pack_timer_records_py
        assert files.pack_hash_entries is files.pack_hash_entries_py
    else:
        assert append.pack_timer_records is native.pack_timer_records
        assert append.pack_index_entries is native.pack_index_entries
        assert files.pack_hash_entries is native.pack_hash_entries


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.integers(0, (1 << 32) - 1), st.integers(0, 15))
def test_crc32_is_zlibs(data, value, skew):
    import zlib

    view = memoryview(bytes(skew) + data)[skew:]  # any alignment
    assert native.crc32(view, value) == zlib.crc32(data, value)
    assert native.crc32_bytewise(view, value) == zlib.crc32(data, value)
    assert native.crc32(data) == zlib.crc32(data)
    for v in (-1, -value, value + (1 << 32)):  # taken modulo 2**32, as zlib does
        assert native.crc32(data, v) == zlib.crc32(data, v)


@needs_native
@pytest.mark.parametrize("n", [0, 1, 15, 16, 63, 64, 65, 79, 80, 127, 128, 1199, 65_536 + 7])
def test_crc32_at_the_fold_boundaries(n):
    import zlib

    data = bytes((i * 131 + 7) & 0xFF for i in range(n))
    assert native.crc32(data) == zlib.crc32(data)
    assert native.crc32(bytearray(data), 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF)


def test_the_shared_crc32_is_the_compiled_one_when_built():
    import zlib

    assert speedups.crc32 is (native.crc32 if native is not None else zlib.crc32)


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 44), st.integers(0, 1 << 44), st.integers(0, 1 << 40),
                          st.integers(-1, 1 << 40), st.integers(0, 1 << 40), st.sampled_from([1, 2, 70_000]),
                          st.integers(0, 3)), min_size=1, max_size=20, unique_by=lambda x: x[2]),
       st.integers(0, 1 << 44), st.integers(0, 1 << 40))
def test_mark_delivered_run_matches_pure(rows, t, seq):
    from chronomq.delay.timer import window
    from chronomq.delay.timer.records import Item, Taken, TimerHeader

    group = []
    for k, (deliver, created, pos, origin, done_seq, tid, gen) in enumerate(rows):
        h = TimerHeader(0x54494D52, 100, 0, gen, deliver, 0, created, origin, done_seq, 0, tid)
        group.append(Taken(k, None, h, Item(deliver, k, pos, gen, tid, 100)))
    want = _marked(window.mark_delivered_run_py, group, t, seq)
    assert _marked(native.mark_delivered_run, group, t, seq) == want


def _marked(fn: object, group: list, t: int, seq: int, fails: bool = False) -> tuple:
    """What ``fn`` (a mark_delivered_run) returns and leaves in its arguments; with ``fails``, it must raise
    TypeError and the return value is None."""
    from collections import Counter

    marks: dict = {}
    buf = bytearray(b"head")
    pending: Counter = Counter({1: 5})
    lates: dict = {}
    out = ["?"] * len(group)
    last = None
    assert callable(fn)
    if fails:
        with pytest.raises(TypeError):
            fn(group, t, seq, marks, buf, pending, lates, out)
    else:
        last = fn(group, t, seq, marks, buf, pending, lates, out)
    return last, marks, bytes(buf), dict(pending), lates, out


def _marks_group(bad_deliver: object = None) -> list:
    from chronomq.delay.timer.records import Item, Taken, TimerHeader

    group = []
    for k in range(3):
        deliver = bad_deliver if k == 2 and bad_deliver is not None else 1_000 + k
        h = TimerHeader(0x54494D52, 100, 0, 1, 1_000 + k, 0, 900, -1, 0, 0, 1)
        group.append(Taken(k, None, h, Item(deliver, k, 4_096 * k, 1, 1, 100)))
    return group


@needs_native
def test_mark_delivered_run_stopped_midway_leaves_what_the_twin_leaves():
    """A failure on the third entry: the first two marked, the third's mark and done-log entry written and
    its topic counted down (as the twin does them before it fails), nothing after."""
    from chronomq.delay.timer import window

    group = _marks_group(bad_deliver="x")
    state = _marked(native.mark_delivered_run, group, 2_000, 10, fails=True)
    assert state == _marked(window.mark_delivered_run_py, group, 2_000, 10, fails=True)
    assert len(state[2]) == 4 + 3 * 56 and state[5] == ["delivered", "delivered", "?"]


@needs_native
@pytest.mark.parametrize("entry", [None, (0, None), (0, None, (1, 2), (3, 4, 5, 6, 7))])
def test_mark_delivered_run_refuses_an_entry_that_is_not_a_taken(entry):
    buf = bytearray(b"head")
    with pytest.raises(TypeError):
        native.mark_delivered_run([*_marks_group()[:1], entry], 2_000, 10, {}, buf, {1: 5}, {}, ["?"] * 2)
    assert len(buf) == 4 + 56  # the first entry's, written before the refusal


_words = st.text(st.characters(codec="utf-8"), min_size=1, max_size=6)


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 50), st.integers(0, 1 << 45), st.sampled_from(["T", "Ü", "t2"]),
                          st.one_of(st.none(), st.just(""), _words),
                          st.one_of(st.none(), st.lists(_words, max_size=3))), max_size=12),
       st.integers(1, 9), st.integers(0, 14), st.integers(0, 16), st.integers(0, 1 << 45), st.integers(0, 13),
       st.integers(0, 3), st.binary(min_size=36, max_size=36))
def test_index_entries_match_pure(reqs, slot_num, n, index_num, begin_ts, room, w, slot_bytes):
    """Same entries, slots, dirty pages and stopping point, whether every word fits, the file fills, or the
    allocated room ends first; from any word of the first item on."""
    items = [DispatchRequest(phys, 100, topic, 0, 0, 0, ts, keys, uniq)
             for phys, ts, topic, uniq, keys in reqs]
    entries_at = 40 + slot_num * 4
    size = entries_at + 20 * 16
    allocated = entries_at + 20 * room
    results = []
    for fn in (native.index_entries, index.index_entries_py):
        mm, slots, dirty = bytearray(size), bytearray(slot_bytes[:slot_num * 4]), {99}
        got = fn(mm, entries_at, allocated, slots, slot_num, n, index_num, begin_ts, items, 0, w, dirty)
        results.append((got, bytes(mm), bytes(slots), dirty))
    assert results[0] == results[1]
    end, _, i, _, _, _, _, _ = results[0][0]
    # it stops only when done, at a full file, or at the end of the allocated room
    assert i == len(items) or end >= index_num or entries_at + end * 20 + 20 > allocated


def test_index_entries_refuse_a_short_slot_table():
    if native is None:
        pytest.skip("chronomq.store._speedups not in use")
    with pytest.raises(ValueError):
        native.index_entries(bytearray(100), 40, 100, bytearray(3), 1, 1, 5, 0, [], 0, 0, set())


_record_rows = st.lists(st.tuples(st.sampled_from([0, 0, 1, 2, 4]), st.integers(64, 3000),
                                  st.integers(-5, 1 << 42), st.integers(0, 8), st.booleans()),
                        min_size=0, max_size=40)  # few done_seq values: they meet the bounds below


def _timer_records(rows: list, tail: bytes) -> bytes:
    """Data records (state, size, deliver time, done_seq, in marks) laid end to end, then ``tail``."""
    from chronomq.delay.timer.records import DATA_HDR, DATA_MAGIC

    out = bytearray()
    for state, size, deliver, seq, _marked in rows:
        out += DATA_HDR.pack(DATA_MAGIC, size, state, 0, deliver, 0, 0, -1, seq, 0, 1)
        out += bytes(size - DATA_HDR.size)
    return bytes(out + tail)


@needs_native
@settings(max_examples=300, deadline=None)
@given(_record_rows, st.sampled_from([b"", bytes(64), b"\x01" * 70, b"RMIT" + bytes(60)]),
       st.integers(0, 50), st.integers(0, 4000), st.integers(-1, 9),
       st.lists(st.tuples(st.integers(-1, 8), st.integers(0, 9)), max_size=3),
       st.sampled_from([0, 64, 4096]), st.integers(0, 200_000), st.integers(0, 60),
       st.tuples(st.one_of(st.none(), st.integers(-10, 1 << 42)), st.integers(-1, 3000),
                 st.integers(-1, 3000), st.integers(0, 5)))
def test_scan_records_matches_pure(rows, tail, limit, skip_front, done_seq, open_ranges, min_run, cut,
                                   start_at, st0):
    """The retention scan's kernel walks the same records as its twin: a record's start, a buffer that
    begins before it or ends inside a header, a stop inside the walk, the written end (zeros or a header
    that is no record's), marks, open ranges, and a run carried in from an earlier call."""
    from chronomq.delay.timer import retention

    data = _timer_records(rows, tail)
    starts, p = [], 0
    for _state, size, *_ in rows:
        starts.append(p)
        p += size
    pos = starts[min(start_at, len(starts) - 1)] if starts else 0
    buf_at = max(0, pos - skip_front)
    buf = data[buf_at:]
    have = min(len(buf), cut if cut else len(buf))
    marks = {starts[i]: None for i, r in enumerate(rows) if r[4]}
    results = []
    for fn in (retention.scan_records_py, native.scan_records):
        state, runs = list(st0), []
        got = fn(buf, buf_at, have, pos, pos + cut // 2 + 64, limit, marks, done_seq, open_ranges, min_run,
                 state, runs)
        results.append((got, state, runs))
    assert results[0] == results[1]


@needs_native
def test_scan_records_counts_runs_and_the_latest_pending():
    from chronomq.delay.timer import retention

    rows = [(0, 100, 50, 0, False), (1, 200, 0, 3, False), (2, 300, 0, 4, False), (1, 100, 0, 9, False),
            (0, 100, 70, 0, True), (1, 100, 0, 1, False)]
    data = _timer_records(rows, bytes(64))
    for fn in (retention.scan_records_py, native.scan_records):
        state, runs = [None, -1, -1, 0], []
        got = fn(data, 0, len(data), 0, 1 << 40, 100, {700: None}, 5, [(0, 2)], 500, state, runs)
        # 1 and 2 reclaimable (seq 3, 4 <= 5, not in (0, 2)); 3 waits (seq 9 > 5); the pending one at 700
        # is in the marks (so 50 is the latest); the last one (seq 1) is in an open range
        assert got == (sum(r[1] for r in rows), 6, True)
        assert state == [50, -1, 100, 2] and runs == [(100, 600)]
