from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chronomq import message as m

_key = st.text(alphabet=st.characters(blacklist_characters="\x00\x01\x02", blacklist_categories=("Cs",)),
               min_size=1, max_size=20)
_val = st.text(alphabet=st.characters(blacklist_characters="\x01\x02", blacklist_categories=("Cs",)),
               max_size=40)
_topic = st.from_regex(r"[%|a-zA-Z0-9_-]{1,127}", fullmatch=True)


@st.composite
def messages(draw) -> m.MessageExt:
    return m.MessageExt(
        topic=draw(_topic),
        body=draw(st.binary(max_size=2048)),
        properties=draw(st.dictionaries(_key, _val, max_size=8)),
        flag=draw(st.integers(-(2**31), 2**31 - 1)),
        queue_id=draw(st.integers(0, 1023)),
        sys_flag=draw(st.integers(0, 15)),
        born_timestamp=draw(st.integers(0, 2**62)),
        born_host=(draw(st.sampled_from(["127.0.0.1", "10.1.2.3"])), draw(st.integers(0, 65535))),
        store_timestamp=draw(st.integers(0, 2**62)),
        store_host=("127.0.0.1", draw(st.integers(0, 65535))),
        reconsume_times=draw(st.integers(0, 100)),
        queue_offset=draw(st.integers(0, 2**62)),
        commit_log_offset=draw(st.integers(0, 2**62)),
    )


@given(messages())
def test_record_round_trip(msg: m.MessageExt) -> None:
    buf = m.encode_record(msg)
    assert m.record_size_at(buf) == len(buf)
    props_len = len(m.encode_properties(msg.properties).encode())
    assert len(buf) == m.RECORD_FIXED_SIZE + len(msg.body) + len(msg.topic.encode()) + props_len
    out = m.decode_record(buf, check_crc=True)
    assert out.topic == msg.topic and out.body == msg.body and out.properties == msg.properties
    for f in ("flag", "queue_id", "sys_flag", "born_timestamp", "born_host", "store_timestamp",
              "store_host", "reconsume_times", "queue_offset", "commit_log_offset"):
        assert getattr(out, f) == getattr(msg, f), f
    assert out.store_size == len(buf)


def test_known_size_matches_java_example() -> None:
    # docs/protocol.md#stored-record: 7-byte body, topic TopicTest, 90 bytes of properties -> 197 bytes
    props = "x" * 88
    msg = m.MessageExt(topic="TopicTest", body=b"1234567", properties={"k": props[:87]})
    assert len(m.encode_properties(msg.properties)) == 90
    assert len(m.encode_record(msg)) == 197


def test_patch_record_sets_offsets_and_store_time() -> None:
    buf = m.encode_record(m.MessageExt(topic="T", body=b"x"))
    m.patch_record(buf, 7, 1234, 99)
    out = m.decode_record(buf)
    assert (out.queue_offset, out.commit_log_offset, out.store_timestamp) == (7, 1234, 99)


@pytest.mark.parametrize("cut", [0, 10, 50, 90, 95])
def test_truncated_record_is_rejected(cut: int) -> None:
    buf = m.encode_record(m.MessageExt(topic="TopicA", body=b"hello", properties={"a": "b"}))
    with pytest.raises(m.MessageFormatError):
        m.decode_record(bytes(buf[:cut]))


def test_crc_mismatch_detected() -> None:
    buf = m.encode_record(m.MessageExt(topic="TopicA", body=b"hello"))
    buf[m.POS_BODY] ^= 0xFF
    m.decode_record(buf)  # without the check it decodes
    with pytest.raises(m.MessageFormatError, match="CRC"):
        m.decode_record(buf, check_crc=True)


def test_bad_magic_rejected() -> None:
    buf = m.encode_record(m.MessageExt(topic="TopicA", body=b"hello"))
    buf[m.POS_MAGIC] = 0
    with pytest.raises(m.MessageFormatError, match="magic"):
        m.decode_record(buf)


def test_offset_msg_id_round_trip() -> None:
    mid = m.create_offset_msg_id(("127.0.0.1", 10911), 197)
    assert mid == "7F00000100002A9F00000000000000C5"  # docs/protocol.md#message-ids
    assert m.decode_offset_msg_id(mid) == (("127.0.0.1", 10911), 197)
    with pytest.raises(ValueError):
        m.decode_offset_msg_id("nope")


def test_properties_codec() -> None:
    props = {"KEYS": "k1 k2", "TAGS": "TagA", "x": ""}
    text = m.encode_properties(props)
    assert text.endswith("\x02")
    assert m.decode_properties(text) == props
    assert m.decode_properties("") == {}
    assert m.decode_properties("a\x01b\x02\x02junk\x02") == {"a": "b"}


def test_java_string_hash() -> None:
    assert m.java_string_hash("") == 0
    assert m.java_string_hash("TagA") == 2598919
    assert m.java_string_hash("hello world") == 1794106052  # Java "hello world".hashCode()
    assert m.java_string_hash("é") == 233


@pytest.mark.parametrize("topic,ok", [("TopicTest", True), ("%RETRY%g", True), ("a|b_c-1", True),
                                      ("", False), ("bad topic", False), ("x" * 128, False), ("ü", False)])
def test_validate_topic(topic: str, ok: bool) -> None:
    assert (m.validate_topic(topic) is None) == ok

