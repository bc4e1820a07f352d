"""The client's compiled decode of a pull answer (chronomq.remoting._decode) against its pure-Python twins
in chronomq.client.model: the same messages, columns and property maps, and the same refusals (exception
type and message) on valid, edge, damaged and hostile bodies."""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronomq import message as m
from chronomq.client import model
from chronomq.client.model import MessageQueue, ReceivedMessage, RecordColumns
from chronomq.remoting import decode

native = decode.native
needs_native = pytest.mark.skipif(native is None, reason="chronomq.remoting._decode not in use")
_H16 = struct.Struct(">H")
RECEIVED_FIELDS = tuple(f.name for f in dataclasses.fields(ReceivedMessage))


_LOCAL = b"\x7f\0\0\x01\0\0\x11\xd7"  # 127.0.0.1:4567
_STORE = b"\x0a\0\0\x01\0\0\x2a\x9f"  # 10.0.0.1:10911


def _record(topic: bytes, props: bytes, body: bytes, *, qid: int = 0, flag: int = 0, qoff: int = 0,
            phys: int = 0, sys_flag: int = 0, born_ts: int = 0, born_host: bytes = _LOCAL, store_ts: int = 0,
            store_host: bytes = _STORE, reconsume: int = 0) -> bytes:
    """One stored V1 record with every field as given (the topic and properties as raw bytes)."""
    total = m.RECORD_FIXED_SIZE + len(body) + len(topic) + len(props)
    head = m.RECORD_HEAD.pack(total, m.MAGIC_V1, 0, qid, flag, qoff, phys, sys_flag, born_ts, born_host,
                              store_ts, store_host, reconsume, 0, len(body))
    return head + body + bytes([len(topic)]) + topic + _H16.pack(len(props)) + props


def _outcome(fn: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    try:
        return ("ok", fn(*args))
    except Exception as e:  # the refusal itself is what is compared
        return ("raised", type(e), str(e))


def _typed(msgs: list[Any]) -> list[tuple[tuple[type, Any], ...]]:
    """Each message field by field with the type of each value (an int must not come back a bool)."""
    return [tuple((type(v), v) for v in (getattr(x, f) for f in RECEIVED_FIELDS)) for x in msgs]


def _both_decode(buf: bytes, broker: str = "broker-a") -> tuple[Any, ...]:
    """decode_received, record_columns and parse_properties by the kernel and by the twin, held equal;
    the kernel's outcome."""
    assert native is not None
    got = _outcome(native.decode_received, buf, broker, ReceivedMessage, MessageQueue)
    want = _outcome(model.decode_received_py, buf, broker, ReceivedMessage, MessageQueue)
    assert got[0] == want[0], (got, want)
    if got[0] == "ok":
        assert _typed(got[1]) == _typed(want[1])
        # one MessageQueue per queue of the answer, shared by its messages, in both
        assert len({id(x.queue) for x in got[1]}) == len({(x.raw_topic, x.queue_id) for x in got[1]})
    else:
        assert got == want
    cols = _outcome(native.record_columns, buf, RecordColumns)
    assert cols == _outcome(model.record_columns_py, buf, RecordColumns)
    if cols[0] == "ok":
        for text in cols[1].properties:
            assert native.parse_properties(text) == model.parse_properties_py(text)
    return got


# --- what a record is made of --------------------------------------------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_names = st.one_of(_text, st.sampled_from([m.PROPERTY_UNIQ_KEY, m.PROPERTY_RETRY_TOPIC, m.PROPERTY_TAGS,
                                            m.PROPERTY_KEYS, m.PROPERTY_TIMER_DELIVER_MS]))
_prop_maps = st.dictionaries(_names, _text, max_size=8).map(lambda d: m.encode_properties(d).encode())
# text with separators anywhere: empty items, items without a separator or a name, repeated names
_prop_texts = st.lists(st.sampled_from(["\x01", "\x02", "a", "UNIQ_KEY", "RETRY_TOPIC", "é", "日本", "",
                                        "\U0001f600"]), max_size=24).map(lambda xs: "".join(xs).encode())
_bad_utf8 = st.binary(max_size=12).map(lambda b: b + b"\xc3\x28")  # an invalid 2-byte sequence
_props = st.one_of(_prop_maps, _prop_texts, _bad_utf8)
_topics = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20).map(str.encode),
    st.sampled_from([b"T", b"%RETRY%G", b"%RETRY%", b"%RETR", b"\xff\xfe", "%RETRY%é".encode()]),
).filter(lambda t: len(t) < 256)
_i32 = st.integers(-(2**31), 2**31 - 1)
_i64 = st.integers(-(2**63), 2**63 - 1)
_hosts = st.one_of(st.binary(min_size=8, max_size=8),
                   st.sampled_from([_LOCAL, _STORE]))


@st.composite
def _records(draw: st.DrawFn) -> bytes:
    compressed = draw(st.booleans())
    body = draw(st.one_of(st.binary(max_size=64), st.integers(0, 70_000).map(lambda n: bytes(range(256)) *
                                                                              (n // 256) + b"x" * (n % 256))))
    if compressed and draw(st.booleans()):
        body = zlib.compress(body)  # else a compressed flag over bytes that may not inflate: zlib.error
    sys_flag = draw(_i32) if draw(st.booleans()) else 0
    sys_flag = sys_flag | m.SYSFLAG_COMPRESSED if compressed else sys_flag & ~m.SYSFLAG_COMPRESSED
    return _record(draw(_topics), draw(_props), body, qid=draw(st.sampled_from([0, 1, 3]) | _i32),
                   flag=draw(_i32), qoff=draw(_i64), phys=draw(_i64), sys_flag=sys_flag, born_ts=draw(_i64),
                   born_host=draw(_hosts), store_ts=draw(_i64), store_host=draw(_hosts),
                   reconsume=draw(_i32))


# --- the switch and the layout -------------------------------------------------------------------------

def test_the_decode_is_built_unless_pure_python_is_asked_for():
    # built wherever chronomq.store._speedups is (one setup.py, the same compiler and headers)
    from chronomq.store import speedups

    if os.environ.get(decode.PURE_ENV, "") not in ("", "0"):
        assert native is None and decode.describe() == f"pure Python ({decode.PURE_ENV} set)"
        assert model._decode_received is model.decode_received_py
    elif speedups.native is None:
        pytest.skip("no compiled kernels in this install")
    else:
        assert native is not None, "chronomq.remoting._decode was not built beside chronomq.store._speedups"
        assert decode.describe() == "compiled (chronomq.remoting._decode)"
        assert model._decode_received is native.decode_received
        assert model._record_columns is native.record_columns
        assert model._parse_properties is native.parse_properties
    assert set(decode.twins) == decode.KERNEL_NAMES
    with pytest.raises(ValueError, match="not a kernel"):
        decode.pure_twin("decode_records")


def test_pure_python_switch_runs_the_pure_decode():
    code = ("from chronomq.remoting import decode; from chronomq.client import model;"
            "assert decode.native is None;"
            "assert model._decode_received is model.decode_received_py;"
            "assert model._record_columns is model.record_columns_py;"
            "assert model._parse_properties is model.parse_properties_py;"
            "from chronomq import message as m;"
            "b = bytes(m.encode_record(m.MessageExt(topic='T', body=b'x', properties={'UNIQ_KEY': 'U'})));"
            "[x] = model.decode_received(b, 'bk'); assert (x.id, x.body) == ('U', b'x');"
            "print(decode.describe())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, decode.PURE_ENV: "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"pure Python ({decode.PURE_ENV} set)"


@needs_native
def test_kernel_constants_match_the_message_module_and_the_model():
    assert native is not None
    kernel: Any = native
    assert kernel.DEF_MAGIC_V1 == m.MAGIC_V1
    assert (kernel.RECORD_FIXED_SIZE, kernel.POS_BODY) == (m.RECORD_FIXED_SIZE, m.POS_BODY)
    assert kernel.SYSFLAG_COMPRESSED == m.SYSFLAG_COMPRESSED
    assert (kernel.PROPERTY_UNIQ_KEY, kernel.PROPERTY_RETRY_TOPIC) == (m.PROPERTY_UNIQ_KEY,
                                                                       m.PROPERTY_RETRY_TOPIC)
    assert kernel.RETRY_GROUP_TOPIC_PREFIX == m.RETRY_GROUP_TOPIC_PREFIX
    assert kernel.RECEIVED_FIELDS == RECEIVED_FIELDS
    # record_columns calls its class with the columns in this order
    assert model._RECORD_FIELDS == ("queue_ids", "flags", "queue_offsets", "commit_log_offsets", "sys_flags",
                                    "born_timestamps", "born_hosts", "store_timestamps", "store_hosts",
                                    "reconsume_times", "store_sizes", "bodies", "topics", "properties")


# --- the same results and refusals ----------------------------------------------------------------------

@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(_records(), max_size=12))
def test_answers_decode_alike(records):
    _both_decode(b"".join(records))


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(_records(), min_size=1, max_size=4), st.data())
def test_damaged_answers_are_refused_alike(records, data):
    buf = bytearray(b"".join(records))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(buf) - 1))
        how = data.draw(st.sampled_from(["cut", "flip", "insert"]))
        if how == "cut":
            del buf[at:]
            if not buf:
                break
        elif how == "flip":
            buf[at] = data.draw(st.integers(0, 255))
        else:
            buf[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    _both_decode(bytes(buf))


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_is_refused_alike(junk):
    _both_decode(junk)
    _both_decode(_record(b"T", b"", b"x") + junk)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.text(st.sampled_from("\x01\x02a\u00e9\u65e5\U0001f600\ud800"), max_size=40))
def test_property_text_parses_alike(text):
    # any str, lone surrogates too (parse_properties reads text, not bytes)
    assert native is not None
    assert native.parse_properties(text) == model.parse_properties_py(text)


@needs_native
def test_a_batch_of_many_records_across_queues_topics_and_hosts():
    hosts = [bytes([10, 0, i, 1]) + struct.pack(">i", 10911 + i) for i in range(3)]
    body = b"".join(
        _record(b"%RETRY%G" if i % 7 == 0 else b"T%d" % (i % 3), m.encode_properties(
            {m.PROPERTY_UNIQ_KEY: f"U{i}" if i % 5 else "", m.PROPERTY_RETRY_TOPIC: "Orig",
             "k": "v" * (i % 4), m.PROPERTY_TIMER_DELIVER_MS: "1764300000000"}).encode(), os.urandom(1024),
            qid=i % 4, qoff=i, phys=i * 1300, store_host=hosts[i % 3], born_host=hosts[(i // 3) % 3],
            reconsume=i % 2, sys_flag=0x4 * (i % 2))
        for i in range(1000))
    got = _both_decode(body)[1]
    assert len(got) == 1000
    assert got[0].topic == "Orig" and got[0].raw_topic == "%RETRY%G"
    assert got[5].id == m.create_offset_msg_id(got[5].store_host, 5 * 1300)  # an empty UNIQ_KEY
    assert got[1].id == "U1" and got[1].topic == "T1"


@needs_native
def test_many_properties_and_many_hosts():
    # past the property items the kernel keeps for reuse (32 a record), and past its host cache (10,000)
    props = [m.encode_properties({f"p{j}": f"v{j % (i + 1)}" for j in range(40)}).encode() for i in range(3)]
    _both_decode(b"".join(_record(b"T", props[i % 3], b"x") for i in range(6)))
    hosts = [struct.pack(">4si", i.to_bytes(4, "big"), i - 5000) for i in range(10_050)]
    answer = b"".join(_record(b"T", b"", b"x", store_host=h, born_host=h[::-1]) for h in hosts)
    assert len(_both_decode(answer)[1]) == 10_050


@needs_native
def test_large_and_empty_bodies_and_compressed_ones():
    big = os.urandom(1 << 20)
    packed = zlib.compress(b"z" * 300_000)
    recs = [_record(b"T", b"", b""), _record(b"T", b"", big),
            _record(b"T", b"", packed, sys_flag=m.SYSFLAG_COMPRESSED | 0x8),
            _record(b"T", b"", b"not zlib", sys_flag=m.SYSFLAG_COMPRESSED)]
    got = _both_decode(b"".join(recs[:3]))[1]
    assert [x.body for x in got] == [b"", big, b"z" * 300_000] and got[2].sys_flag == 0x8
    assert _both_decode(b"".join(recs))[:2] == ("raised", zlib.error)


@needs_native
def test_the_answer_matches_the_message_ext_path():
    # the documented equivalence: ReceivedMessage.from_ext over m.decode_records
    exts = [m.MessageExt(topic="T", body=b"b%d" % i, properties={m.PROPERTY_UNIQ_KEY: f"U{i}", "u": "é"},
                         queue_id=i % 2, queue_offset=i, commit_log_offset=i * 100,
                         born_host=("192.168.1.9", 40000 + i), store_host=("10.0.0.1", 10911))
            for i in range(40)]
    buf = b"".join(bytes(m.encode_record(x)) for x in exts)
    assert native is not None
    assert native.decode_received(buf, "bk", ReceivedMessage, MessageQueue) == \
        [ReceivedMessage.from_ext(x, "bk") for x in m.decode_records(buf)]


@needs_native
def test_each_decoded_object_is_held_once():
    # the kernel writes a new message's slots itself: each value must be held as the twin's is, not twice
    assert native is not None
    buf = b"".join(_record(b"T", b"UNIQ_KEY\x01U%d" % i, b"body %d" % i) for i in range(3))

    def counts(msgs: list[ReceivedMessage]) -> list[tuple[int, int, int]]:
        return [(sys.getrefcount(x.body), sys.getrefcount(x.properties), sys.getrefcount(x.id)) for x in msgs]

    got = counts(native.decode_received(buf, "bk", ReceivedMessage, MessageQueue))
    assert got == counts(model.decode_received_py(buf, "bk"))
    assert got[0][0] == 2  # the slot and getrefcount's argument


@dataclasses.dataclass
class _PlainMessage:  # no slots: the kernel sets the fields through setattr, as the twin does
    topic: str = ""
    body: bytes = b""
    id: str = ""
    queue: Any = None
    queue_offset: int = 0
    commit_log_offset: int = 0
    properties: dict[str, str] = dataclasses.field(default_factory=dict)
    reconsume_times: int = 0
    born_timestamp: int = 0
    store_timestamp: int = 0
    born_host: tuple[str, int] = ("", 0)
    store_host: tuple[str, int] = ("", 0)
    flag: int = 0
    sys_flag: int = 0
    store_size: int = 0
    raw_topic: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class _FrozenMessage:  # its __setattr__ refuses: so must the kernel
    topic: str = ""


@needs_native
@pytest.mark.parametrize("cls", [_PlainMessage, _FrozenMessage])
def test_other_message_classes_are_filled_as_the_twin_fills_them(cls):
    assert native is not None
    buf = b"".join(_record(b"T", b"UNIQ_KEY\x01U\x02a\x01b", b"x", qoff=i) for i in range(3))
    got = _outcome(native.decode_received, buf, "bk", cls, MessageQueue)
    assert got == _outcome(model.decode_received_py, buf, "bk", cls, MessageQueue)
    assert (got[0] == "ok") == (cls is _PlainMessage)


def test_the_public_functions_keep_their_results():
    buf = b"".join(_record(b"T", b"UNIQ_KEY\x01U%d" % i, b"x", qid=i % 2, qoff=i) for i in range(4))
    msgs = model.decode_received(buf, "bk")
    assert [type(x) for x in msgs] == [ReceivedMessage] * 4
    assert msgs == model.decode_received_py(buf, "bk")
    assert model.record_columns(buf) == model.record_columns_py(buf)
    assert isinstance(model.record_columns(buf), RecordColumns)
    assert model.parse_properties("a\x01b\x02\x01c\x02a\x01d") == {"a": "d"}
    assert model.decode_received(b"", "bk") == [] and len(model.record_columns(b"")) == 0
    with pytest.raises(m.MessageFormatError, match="record truncated"):
        model.decode_received(buf[:-100], "bk")
