"""The 5.x gRPC endpoint, in process: the translation (convert.py) and the in-flight table (pop.py)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="the grpc extra (grpcio, protobuf) is not installed")


from chronomq.grpc import convert  # noqa: E402
from chronomq.grpc._proto import rocketmq_v2_pb2 as pb  # noqa: E402
from chronomq.grpc.pop import PopTable  # noqa: E402
from chronomq.message import MessageExt  # noqa: E402

SERVICE = "/apache.rocketmq.v2.MessagingService/"


# --- translation --------------------------------------------------------------------------------------------
def _v2(**sp: Any) -> pb.Message:
    m = pb.Message(topic=pb.Resource(name="T"), body=b"hi", user_properties={"a": "b"})
    m.system_properties.message_id = "01AB"
    m.system_properties.body_encoding = pb.IDENTITY
    for k, v in sp.items():
        if k == "delivery_ms":
            m.system_properties.delivery_timestamp.CopyFrom(convert.timestamp(v))
        elif k == "keys":
            m.system_properties.keys.extend(v)
        else:
            setattr(m.system_properties, k, v)
    return m


def test_a_sent_message_becomes_the_4x_message_a_4x_client_would_send() -> None:
    out = convert.from_v2(_v2(tag="t1", keys=["k1", "k2"], message_group="g", message_type=pb.FIFO), 1024)
    assert out.properties == {"a": "b", "TAGS": "t1", "KEYS": "k1 k2", "UNIQ_KEY": "01AB",
                              "__SHARDINGKEY": "g"}
    assert out.group == "g" and out.deliver_ms is None and not out.transactional
    out = convert.from_v2(_v2(delivery_ms=1_800_000_000_123, message_type=pb.DELAY), 1024)
    assert out.properties["TIMER_DELIVER_MS"] == "1800000000123"


def test_a_delivery_time_in_ms_in_the_seconds_field_is_read_as_ms() -> None:
    ts = convert.timestamp(0)
    ts.seconds = 1_800_000_000_123  # the 5.x Python client copies the user's number into seconds
    assert convert.delivery_ms(ts) == 1_800_000_000_123
    ts.seconds = 1_800_000_000
    assert convert.delivery_ms(ts) == 1_800_000_000_000


@pytest.mark.parametrize("change,code", [
    ({"body": b""}, pb.MESSAGE_BODY_EMPTY),
    ({"body": b"x" * 2000}, pb.MESSAGE_BODY_TOO_LARGE),
    ({"user_properties": {"TAGS": "x"}}, pb.ILLEGAL_MESSAGE_PROPERTY_KEY),
    ({"tag": "a|b"}, pb.ILLEGAL_MESSAGE_TAG),
    ({"message_type": pb.FIFO}, pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
    ({"message_type": pb.TRANSACTION, "message_group": "g"}, pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
])
def test_refused_messages_answer_their_v2_code(change: dict[str, Any], code: int) -> None:
    m = _v2()
    for k, v in change.items():
        if k == "body":
            m.body = v
        elif k == "user_properties":
            m.user_properties.update(v)
        else:
            setattr(m.system_properties, k, v)
    with pytest.raises(convert.BadMessage) as e:
        convert.from_v2(m, 1024)
    assert e.value.code == code


def test_a_stored_message_reads_back_as_5x_with_its_digest_and_handle() -> None:
    msg = MessageExt(topic="T", body=b"body", properties={"TAGS": "t", "KEYS": "a b", "UNIQ_KEY": "01X",
                                                         "__SHARDINGKEY": "g", "u": "v", "WAIT": "true"},
                     queue_id=2, queue_offset=7, born_timestamp=1000, store_timestamp=2000)
    m = convert.to_v2(msg, "2.7.9", 3, 30_000)
    sp = m.system_properties
    assert (sp.tag, list(sp.keys), sp.message_id, sp.message_group) == ("t", ["a", "b"], "01X", "g")
    assert (sp.receipt_handle, sp.delivery_attempt, sp.queue_id, sp.queue_offset) == ("2.7.9", 3, 2, 7)
    assert sp.message_type == pb.FIFO and sp.body_encoding == pb.IDENTITY
    assert sp.body_digest.checksum == f"{zlib.crc32(b'body'):08X}"
    assert dict(m.user_properties) == {"u": "v"}


def test_fifo_queue_is_javas_string_hash_of_the_group() -> None:
    assert convert.fifo_queue("g1", 4) == abs(convert.java_string_hash("g1")) % 4
    assert {convert.fifo_queue("order-42", 8) for _ in range(3)} == {convert.fifo_queue("order-42", 8)}


def test_receipt_handles_round_trip_and_junk_is_refused() -> None:
    r = convert.Receipt(3, 1234, 99)
    assert convert.parse_receipt(r.encode()) == r
    for junk in ("", "1.2", "a.b.c", "1.2.3.4", "-1.2.3"):
        assert convert.parse_receipt(junk) is None


# --- the in-flight table --------------------------------------------------------------------------------
async def test_in_flight_table_advances_over_contiguous_done_offsets_and_persists(tmp_path: Path) -> None:
    t = PopTable(tmp_path)
    st = t.state("G", "T", 0, 5)
    e5, e6, e7 = (t.deliver(st, o, 1000) for o in (5, 6, 7))
    assert st.next == 8 and st.settle() == 5
    assert t.ack(st, 6, e6.gen) == "ok" and st.settle() == 5  # 5 still in flight
    assert t.ack(st, 5, e5.gen + 100) == "stale"
    assert t.ack(st, 5, e5.gen) == "ok" and st.settle() == 7
    assert t.ack(st, 5, e5.gen) == "ok"  # again: already done
    assert t.ack(st, 9, 1) == "unknown"
    gen7 = e7.gen
    again = t.deliver(st, 7, 2000)  # a redelivery
    assert (again.attempt, again.gen > gen7) == (2, True)
    assert t.change(st, 7, gen7, 5000) is None  # the old handle
    changed = t.change(st, 7, again.gen, 5000)
    assert changed is not None and changed.until_ms == 5000
    await t.save()
    back = PopTable(tmp_path).get("G", "T", 0)
    assert back is not None
    assert (back.committed, back.next, back.inflight[7].until_ms, back.inflight[7].attempt) == (7, 8, 5000, 2)
    assert json.loads((tmp_path / "popInflight.json").read_text())["seq"] == t.seq
