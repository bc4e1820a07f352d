"""The trace body decoder (chronomq.client.trace) against bodies built as RocketMQ's
TraceDataEncoder.encoderFromContextBean builds them; the helpers here build them for other tests too."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chronomq.client.trace import TraceDecodeError, TraceRecord, TraceType, decode_trace_body

C, F = "\x01", "\x02"  # TraceConstants.CONTENT_SPLITOR, FIELD_SPLITOR


def _java(v: object) -> str:
    """A value as StringBuilder.append writes it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _context(*fields: object) -> str:
    return C.join(_java(v) for v in fields) + F


def pub_context(msg_id: str, *, timestamp: int = 1_700_000_000_123, region: str = "DefaultRegion",
                group: str = "PG", topic: str = "T", tags: str | None = "TagA", keys: str | None = "K1",
                store_host: str = "127.0.0.1:10911", body_length: int = 5, cost_ms: int = 3,
                msg_type: int = 0, offset_msg_id: str = "7F00000100002A9F0000000000000000",
                success: bool = True) -> str:
    return _context("Pub", timestamp, region, group, topic, msg_id, tags, keys, store_host, body_length,
                    cost_ms, msg_type, offset_msg_id, success)


def sub_before_context(msg_id: str, *, timestamp: int = 1_700_000_000_200, region: str = "DefaultRegion",
                       group: str = "CG", request_id: str = "req-1", retry_times: int = 0,
                       keys: str | None = "K1") -> str:
    return _context("SubBefore", timestamp, region, group, request_id, msg_id, retry_times, keys)


def sub_after_context(msg_id: str, *, request_id: str = "req-1", cost_ms: int = 7, success: bool = True,
                      keys: str | None = "K1", context_code: int = 0, timestamp: int = 1_700_000_000_207,
                      group: str | None = "CG") -> str:
    """The 4.9.3+ form; ``group=None`` leaves out the group (as a CLOUD access channel does)."""
    tail: tuple[object, ...] = (timestamp, group) if group is not None else (timestamp,)
    return _context("SubAfter", request_id, msg_id, cost_ms, success, keys, context_code, *tail)


def end_transaction_context(msg_id: str, *, timestamp: int = 1_700_000_000_300, region: str = "DefaultRegion",
                            group: str = "TPG", topic: str = "T", tags: str | None = None,
                            keys: str | None = "K1", store_host: str = "127.0.0.1:10911", msg_type: int = 1,
                            transaction_id: str = "tx-1", state: str = "COMMIT_MESSAGE",
                            from_check: bool = False) -> str:
    return _context("EndTransaction", timestamp, region, group, topic, msg_id, tags, keys, store_host,
                    msg_type, transaction_id, state, from_check)


def test_pub_reads_every_field() -> None:
    [r] = decode_trace_body(pub_context("MSG1", msg_type=3, success=False).encode())
    assert r == TraceRecord(TraceType.PUB, "MSG1", timestamp=1_700_000_000_123, region="DefaultRegion",
                            group="PG", topic="T", tags="TagA", keys="K1", store_host="127.0.0.1:10911",
                            body_length=5, cost_ms=3, msg_type=3,
                            offset_msg_id="7F00000100002A9F0000000000000000", success=False)
    assert r.msg_type_name == "Delay_Msg"
    assert r.time is not None and r.time.isoformat() == "2023-11-14T22:13:20.123000+00:00"


def test_pub_older_and_longer_forms() -> None:
    base = ["Pub", "1", "R", "PG", "T", "M", "null", "null", "h:1", "0", "2", "0"]
    [r12] = decode_trace_body(C.join(base))  # no success: not said
    assert (r12.success, r12.offset_msg_id) == (None, None)
    [r13] = decode_trace_body(C.join([*base, "true"]))  # success without an offset msg id
    assert (r13.success, r13.offset_msg_id) == (True, None)
    [r15] = decode_trace_body(C.join([*base, "OFF", "TRUE", "10.0.0.9"]))  # an old form with the client host
    assert (r15.offset_msg_id, r15.success, r15.client_host) == ("OFF", True, "10.0.0.9")
    assert r12.tags == "null"  # what the client wrote for none, as RocketMQ's decoder keeps it


def test_sub_before_and_sub_after() -> None:
    body = (sub_before_context("MSG1", retry_times=2)
            + sub_after_context("MSG1", context_code=4, success=False))
    before, after = decode_trace_body(body.encode())
    assert before == TraceRecord(TraceType.SUB_BEFORE, "MSG1", timestamp=1_700_000_000_200,
                                 region="DefaultRegion", group="CG", request_id="req-1", retry_times=2,
                                 keys="K1")
    assert after == TraceRecord(TraceType.SUB_AFTER, "MSG1", timestamp=1_700_000_000_207, group="CG",
                                request_id="req-1", cost_ms=7, success=False, keys="K1", context_code=4)
    assert after.consume_return == "FAILED"


def test_sub_after_older_forms() -> None:
    [no_group] = decode_trace_body(sub_after_context("M", group=None))
    assert (no_group.timestamp, no_group.group) == (1_700_000_000_207, None)
    [oldest] = decode_trace_body(C.join(["SubAfter", "req", "M", "4", "true", "K"]) + F)
    assert (oldest.context_code, oldest.timestamp, oldest.success, oldest.cost_ms) == (None, None, True, 4)


def test_end_transaction() -> None:
    [r] = decode_trace_body(end_transaction_context("MSG2", state="ROLLBACK_MESSAGE", from_check=True))
    assert (r.type, r.msg_id, r.group, r.topic, r.tags, r.msg_type_name) == (
        TraceType.END_TRANSACTION, "MSG2", "TPG", "T", "null", "Trans_Msg_Half")
    assert (r.transaction_id, r.transaction_state, r.from_transaction_check) == (
        "tx-1", "ROLLBACK_MESSAGE", True)


def test_several_contexts_in_one_body_keep_their_order() -> None:
    body = (pub_context("A") + sub_before_context("B") + sub_after_context("B")
            + end_transaction_context("C") + pub_context("D"))
    assert [(r.type, r.msg_id) for r in decode_trace_body(body.encode())] == [
        (TraceType.PUB, "A"), (TraceType.SUB_BEFORE, "B"), (TraceType.SUB_AFTER, "B"),
        (TraceType.END_TRANSACTION, "C"), (TraceType.PUB, "D")]


def test_empty_unknown_and_empty_trailing_fields() -> None:
    assert decode_trace_body(b"") == []
    assert decode_trace_body("PullAfter" + C + "x" + F + F) == []  # a type it does not know is skipped
    [r] = decode_trace_body(sub_before_context("M", keys=""))  # keys written empty: Java's split drops it
    assert r.keys == ""


@pytest.mark.parametrize("body, where", [
    (b"\xff\xfe", "UTF-8"),
    (pub_context("M").replace("1700000000123", "notanumber"), "field 1 (timestamp) is 'notanumber'"),
    (C.join(["Pub", "1", "R", "G", "T", "M"]), "(Pub) is cut short: 6 fields, it has at least 12"),
    (pub_context("M").replace(C + "5" + C, C + "5x" + C), "body length"),
    (pub_context("M", msg_type=0).replace(C + "0" + C + "7F", C + "-1" + C + "7F"), "message type"),
    (sub_before_context("M").replace("1700000000200", "99999999999999999999"), "timestamp"),
    (end_transaction_context("M", state="MAYBE"), "transaction state"),
    (pub_context("M") + "SubBefore" + C + "1", "trace context 1 (SubBefore) is cut short"),
])
def test_garbage_is_refused_with_a_reason(body: bytes | str, where: str) -> None:
    with pytest.raises(TraceDecodeError, match=where.replace("(", r"\(").replace(")", r"\)")):
        decode_trace_body(body)


_TOKENS = st.sampled_from(["Pub", "SubBefore", "SubAfter", "EndTransaction", "Recall", C, F, "1", "-1",
                           "true", "x", "", "COMMIT_MESSAGE", "99999999999999999999"])


@given(st.one_of(st.binary(max_size=300),
                 st.lists(_TOKENS, max_size=40).map(lambda xs: "".join(xs).encode())))
def test_random_bodies_raise_only_the_decoders_error(body: bytes) -> None:
    try:
        records = decode_trace_body(body)
    except TraceDecodeError:
        return
    assert all(isinstance(r, TraceRecord) for r in records)
