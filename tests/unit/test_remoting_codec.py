from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chronomq.message import MessageFormatError
from chronomq.remoting import codec
from chronomq.remoting.codec import FrameDecoder, FrameError, RemotingCommand


def _frame(header: bytes, body: bytes = b"", stype: int = 0) -> bytes:
    return struct.pack(">iI", 4 + len(header) + len(body), (stype << 24) | len(header)) + header + body


def test_cpp_client_request_decodes() -> None:
    # the first request of the C++ producer as captured on the wire (numbers and strings mixed, trailing \n)
    header = (b'{"code":105,"extFields":{"AccessKey":"","OnsChannel":"ALIYUN","Signature":"x",'
              b'"topic":"TopicTest","queueId":3,"bornTimestamp":"17"},"flag":0,"language":"CPP",'
              b'"opaque":0,"remark":"","version":63}\n')
    [cmd] = FrameDecoder().feed(_frame(header))
    assert isinstance(cmd, RemotingCommand)
    assert cmd.code == 105 and cmd.language == "CPP" and cmd.version == 63
    assert cmd.ext_str("topic") == "TopicTest"
    assert cmd.ext_int("queueId") == 3 and cmd.ext_int("bornTimestamp") == 17


def test_response_rules() -> None:
    req = RemotingCommand.request(10, {"topic": "T"})
    resp = req.response(0, {"queueOffset": 17, "msgId": "AB"})
    raw = codec.encode(resp)
    total, word = struct.unpack_from(">iI", raw)
    assert total == len(raw) - 4
    assert word >> 24 == 0  # serialize type 0, high byte zero
    header = json.loads(raw[8 : 8 + word])
    assert header["flag"] & 1 and header["opaque"] == req.opaque
    assert header["extFields"] == {"queueOffset": "17", "msgId": "AB"}  # strings, always
    assert isinstance(header["code"], int)


@given(st.integers(0, 400),
       st.dictionaries(st.text(min_size=1, max_size=10), st.text(max_size=30), max_size=6),
       st.binary(max_size=300), st.sampled_from([0, 1]), st.integers(1, 50))
def test_round_trip_any_chunking(code: int, ext: dict, body: bytes, stype: int, chunk: int) -> None:
    cmd = RemotingCommand(code=code, ext_fields=ext, body=body, opaque=42, flag=1, remark="r",
                          serialize_type=stype)
    raw = codec.encode(cmd) * 3
    dec = FrameDecoder()
    out = []
    for i in range(0, len(raw), chunk):
        out += dec.feed(raw[i : i + chunk])
    assert len(out) == 3
    for o in out:
        assert isinstance(o, RemotingCommand)
        assert (o.code, o.body, o.opaque, o.flag, o.remark) == (code, body, 42, 1, "r")
        assert {k: str(v) for k, v in o.ext_fields.items()} == ext
    assert dec.buffered == 0


def test_oversized_frame_is_fatal() -> None:
    with pytest.raises(FrameError, match="exceeds"):
        FrameDecoder(max_frame_size=1024).feed(struct.pack(">i", 2048) + b"x" * 10)


def test_too_small_length_is_fatal() -> None:
    with pytest.raises(FrameError):
        FrameDecoder().feed(struct.pack(">i", 2))


def test_invalid_json_is_reported_and_stream_continues() -> None:
    good = codec.encode(RemotingCommand.request(34))
    out = FrameDecoder().feed(_frame(b"{not json") + good)
    assert isinstance(out[0], FrameError) and not out[0].fatal
    assert isinstance(out[1], RemotingCommand) and out[1].code == 34


def test_missing_code_keeps_opaque_for_the_error_reply() -> None:
    [err] = FrameDecoder().feed(_frame(b'{"opaque":9,"flag":0}'))
    assert isinstance(err, FrameError) and err.opaque == 9


def test_header_longer_than_frame_is_fatal() -> None:
    raw = struct.pack(">iI", 8, 1000) + b"abcd"
    with pytest.raises(FrameError):
        FrameDecoder().feed(raw)


def test_unknown_serialize_type_is_fatal() -> None:
    with pytest.raises(FrameError, match="serialize type"):
        FrameDecoder().feed(_frame(b"{}", stype=7))


def test_ext_int_errors() -> None:
    cmd = RemotingCommand(code=1, ext_fields={"a": "x"})
    with pytest.raises(codec.HeaderError, match="not an integer"):
        cmd.ext_int("a")
    with pytest.raises(codec.HeaderError, match="lacks"):
        cmd.ext_int("b")
    assert cmd.ext_int("b", 5) == 5


@given(st.binary(max_size=200))
def test_fuzz_never_crashes_unexpectedly(data: bytes) -> None:
    dec = FrameDecoder(max_frame_size=4096)
    try:
        for item in dec.feed(data):
            assert isinstance(item, RemotingCommand | FrameError)
    except FrameError:
        pass


def test_batch_body_round_trip_and_errors() -> None:
    items = [codec.BatchItem(b"a" * 5, {"UNIQ_KEY": "1", "TAGS": "t"}), codec.BatchItem(b"", {}, flag=3)]
    raw = codec.encode_batch_body(items)
    assert codec.decode_batch_body(raw) == items
    with pytest.raises(MessageFormatError):
        codec.decode_batch_body(raw[:-1])
    with pytest.raises(MessageFormatError):
        codec.decode_batch_body(b"\x00\x00\x00\x05" + b"\x00" * 20)


def test_text_that_is_not_unicode_still_makes_a_readable_header() -> None:
    # found by tests/integration/test_protocol_fuzz.py: a lone surrogate in a header field was written as
    # bytes that are not UTF-8, and the reader had to close the connection instead of answering
    ext = {"properties": "a\ud800b", "名": "値"}
    cmd = RemotingCommand(code=10, opaque=77, ext_fields=ext, remark="\udfff")
    frame = codec.encode(cmd)
    frame[8:].decode("ascii")  # header (and this empty body): plain ASCII
    got = FrameDecoder().feed(frame)[0]
    assert isinstance(got, RemotingCommand)
    assert got.opaque == 77 and got.ext_fields == ext and got.remark == "\udfff"


@given(st.lists(st.tuples(st.integers(0, 400), st.binary(max_size=300), st.booleans()),
                min_size=1, max_size=6), st.lists(st.integers(1, 700), max_size=12))
def test_frames_decode_the_same_however_the_bytes_arrive(cmds, cuts) -> None:
    """Whole frames in one read, a frame cut anywhere (in its length word too), many frames in one read,
    reads as bytes or bytearray: the same commands, and nothing left over after the last frame; a frame
    whose header is not JSON comes back as a FrameError in its place without losing the ones after it."""
    frames = [codec.encode(RemotingCommand.request(code, {"k": str(code)}, body=body)) if ok
              else _frame(b"{not json", body) for code, body, ok in cmds]
    wire = b"".join(frames)
    chunks, at = [], 0
    for cut in cuts:
        if at >= len(wire):
            break
        chunks.append(wire[at:at + cut])
        at += cut
    chunks.append(wire[at:])
    decoder = FrameDecoder()
    got: list[RemotingCommand | FrameError] = []
    for i, chunk in enumerate(chunks):
        got += decoder.feed(bytearray(chunk) if i % 2 else chunk)
    assert decoder.buffered == 0
    assert len(got) == len(cmds)
    for (code, body, ok), cmd in zip(cmds, got, strict=True):
        if ok:
            assert isinstance(cmd, RemotingCommand) and (cmd.code, cmd.body, cmd.ext_fields) == (
                code, body, {"k": str(code)})
            assert type(cmd.body) is bytes
        else:
            assert isinstance(cmd, FrameError)


def test_a_broken_length_word_raises_and_keeps_the_stream_from_resuming() -> None:
    decoder = FrameDecoder(max_frame_size=1000)
    good = codec.encode(RemotingCommand.request(10, {}))
    with pytest.raises(FrameError, match="exceeds the 1000 byte limit"):
        decoder.feed(good + struct.pack(">i", 5000) + b"x" * 10)
    with pytest.raises(FrameError, match="too small"):
        FrameDecoder().feed(struct.pack(">i", 2) + b"xx")
    half = FrameDecoder()
    assert half.feed(good[:3]) == [] and half.buffered == 3  # a length word not yet whole is kept
    [cmd] = half.feed(good[3:])
    assert isinstance(cmd, RemotingCommand) and cmd.code == 10 and half.buffered == 0
