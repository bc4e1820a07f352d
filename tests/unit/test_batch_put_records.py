"""A send's batch body encoded in one pass (put.batch_records_py and its kernel): the kernel equals its pure
twin on any body, valid or damaged, and either twin's records are byte for byte what the general path
(the body decoded into messages, stamped, ``put_messages``' encoding) stores, taken exactly when that
path would store the batch as it came; what de-duplication is asked for is what SendDedup reads from the
decoded messages."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronomq.broker.processors import send
from chronomq.message import (
    PROPERTY_DEDUP,
    PROPERTY_UNIQ_KEY,
    MessageExt,
    MessageFormatError,
    pack_host,
    tags_code,
)
from chronomq.remoting import codec
from chronomq.store import put, speedups

native = speedups.native
needs_native = pytest.mark.skipif(native is None, reason="chronomq.store._speedups not in use")

STAMPS = {"CLUSTER": "DefaultCluster", "MSG_REGION": "DefaultRegion", "TRACE_ON": "true"}
STAMPS_B = "".join(f"{k}\x01{v}\x02" for k, v in STAMPS.items()).encode()
BORN = ("10.1.2.3", 40001)
STORE_HOST_B = pack_host(("127.0.0.1", 10911))
SPECIAL_NAMES = [n.decode() for n in send.PLAIN_ONLY]

names = st.one_of(st.sampled_from(["TAGS", "KEYS", "UNIQ_KEY", "CHRONOMQ_DEDUP", "WAIT", "a", "é", "",
                                   *SPECIAL_NAMES]),
                  st.text(st.characters(blacklist_categories=("Cs",)), max_size=5))
values = st.one_of(st.sampled_from(["true", "false", "", " k1  k2 ", "tag", "名"]),
                   st.text(st.characters(blacklist_categories=("Cs",)), max_size=8))
pieces = st.one_of(st.tuples(names, values).map(lambda nv: f"{nv[0]}\x01{nv[1]}".encode()),
                   st.binary(max_size=5))  # anything: no separator, stray 0x01/0x02, bytes that are not UTF-8
props_texts = st.tuples(st.lists(pieces, max_size=6), st.booleans()).map(
    lambda pc: b"\x02".join(pc[0]) + (b"\x02" if pc[1] else b""))
items = st.lists(st.tuples(st.binary(max_size=64), props_texts, st.integers(-(1 << 31), (1 << 31) - 1)),
                 max_size=5)
fields = st.fixed_dictionaries({
    "queue_id": st.integers(0, 7), "sys_flag": st.sampled_from([0, 0x10 | 0x20, 0x2, -1]),
    "born_ts": st.integers(-(1 << 63), (1 << 63) - 1), "reconsume": st.integers(-(1 << 31), (1 << 31) - 1),
    "max_body": st.sampled_from([1 << 20, 8]), "max_record": st.sampled_from([1 << 20, 200])})


def _item(body: bytes, props: bytes, flag: int) -> bytes:
    total = 20 + len(body) + 2 + len(props)
    return struct.pack(">iiiii", total, 0, 0, flag, len(body)) + body + struct.pack(">h", len(props)) + props


def _run(kernel, data: bytes | bytearray, f: dict[str, int]):  # type: ignore[no-untyped-def]
    return kernel(data, b"T", f["queue_id"], f["sys_flag"], f["born_ts"], pack_host(BORN), STORE_HOST_B,
                  f["reconsume"], STAMPS_B, send.PLAIN_ONLY, f["max_body"], f["max_record"],
                  put._Cache(tags_code, 100))


class _Path(put.PutPath):
    """The put path's encoding state without a store: what ``_prepare`` reads."""

    def __init__(self, max_body: int, max_record: int) -> None:
        self._max_body = max_body
        self._seg_size = max_record + 8
        self._delay_levels = [1000]
        self._store_host_b = STORE_HOST_B
        self._init_caches()


def _simple(props: bytes) -> bool:
    """What the one pass takes as it came: UTF-8, pieces name 0x01 value (no empty piece or name, one 0x01,
    each name once, none that admission, the timer or the stamps act on)."""
    try:
        props.decode()
    except UnicodeDecodeError:
        return False
    ps = props.split(b"\x02")
    if ps[-1] == b"":
        ps.pop()
    seen = set()
    for p in ps:
        name, sep, value = p.partition(b"\x01")
        if not name or not sep or b"\x01" in value or name in seen or name in send.PLAIN_ONLY:
            return False
        seen.add(name)
    return True


def _general(data: bytes, f: dict[str, int]) -> tuple[list, list[str | None] | None, int] | None:
    """The general path: the body decoded into stamped messages and encoded one by one (None: refused)."""
    try:
        decoded = codec.batch_items(data)
    except MessageFormatError:
        return None
    if not decoded:
        return None
    path = _Path(f["max_body"], f["max_record"])
    entries, asks = [], []
    for body, props, flag in decoded:
        props.update(STAMPS)
        msg = MessageExt(topic="T", body=body, properties=props, flag=flag, queue_id=f["queue_id"],
                         sys_flag=f["sys_flag"], born_timestamp=f["born_ts"], born_host=BORN,
                         reconsume_times=f["reconsume"])
        try:
            entries.append(path._prepare(msg))
        except put._Refused:
            return None
        uniq = props.get(PROPERTY_UNIQ_KEY)
        asks.append(uniq if props.get(PROPERTY_DEDUP) == "true" and uniq else None)
    return entries, asks if any(a is not None for a in asks) else None, sum(len(b) for b, _p, _f in decoded)


@settings(max_examples=400, deadline=None)
@given(items, fields)
def test_the_one_pass_stores_what_the_general_path_stores_and_takes_exactly_the_plain_batches(its, f):
    data = b"".join(_item(b, p, fl) for b, p, fl in its)
    general = _general(data, f)
    fast = _run(put.batch_records_py, data, f)
    assert (fast is None) == (general is None or not all(_simple(p) for _b, p, _f in its))
    if fast is not None:
        assert fast == general


@needs_native
@settings(max_examples=400, deadline=None)
@given(items, fields, st.data())
def test_the_kernel_equals_its_pure_twin_on_any_body(its, f, data):
    body = b"".join(_item(b, p, fl) for b, p, fl in its)
    if body and data.draw(st.booleans()):  # damaged: cut short, or a byte overwritten
        at = data.draw(st.integers(0, len(body) - 1))
        if data.draw(st.booleans()):
            body = body[:at]
        else:
            body = body[:at] + bytes([data.draw(st.integers(0, 255))]) + body[at + 1:]
    assert native is not None
    for view in (body, bytearray(body), memoryview(body)):
        assert _run(native.batch_records, view, f) == _run(put.batch_records_py, view, f)


def test_the_sinks_batches_are_taken_in_one_pass():
    """What the Spark sink sends (encode_rows: KEYS, TAGS, user properties, de-duplication) never falls
    back to the general path."""
    from chronomq.client import encode_rows

    f = {"queue_id": 1, "sys_flag": 0, "born_ts": 1_700_000_000_000, "reconsume": 0, "max_body": 1 << 22,
         "max_record": 1 << 30}
    data = encode_rows([b"x" * 1024, b"y"], ["U1", "U2"], keys=["a b", None], tags=["t", None],
                       properties=[[("p", "1"), ("q", None)], None], dedup=True)
    for kernel in filter(None, (put.batch_records_py, native and native.batch_records)):
        got = _run(kernel, data, f)
        assert got is not None and got == _general(data, f)
        entries, asks, bodies = got
        assert asks == ["U1", "U2"] and bodies == 1025
        assert [(e.keys, e.uniq_key, e.tags_hash) for e in entries] == [(["a", "b"], "U1", tags_code("t")),
                                                                      (None, "U2", 0)]


def test_a_store_whose_put_messages_is_replaced_is_not_given_encoded_batches(tmp_path):
    from chronomq.clock import VirtualClock
    from chronomq.config import BrokerConfig
    from chronomq.store import MessageStore

    config, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp_path)})
    store = MessageStore(config, VirtualClock())
    assert send.takes_encoded(store)
    store.put_messages = lambda msgs: None  # type: ignore[method-assign]
    assert not send.takes_encoded(store)
    assert not send.takes_encoded(object())
