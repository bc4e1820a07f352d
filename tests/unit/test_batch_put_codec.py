"""The remoting codec's shortcuts for a batch put's answer and request header: a long plain text (the
message ids) is written as encode_basestring_ascii writes it, the extFields names as before, and a header
read by the JSON scanner alone is what JSONDecoder.decode reads, errors included."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from chronomq.remoting.codec import (
    FrameDecoder,
    RemotingCommand,
    _json_object,
    _jstr,
    _jtext,
    encode,
)

ids_text = st.lists(st.from_regex(r"[0-9A-F]{32}", fullmatch=True), min_size=1, max_size=70).map(",".join)
texts = st.one_of(st.text(), st.text(alphabet=st.characters(max_codepoint=0x80), min_size=60, max_size=200),
                  ids_text)


@settings(max_examples=500, deadline=None)
@given(texts)
def test_a_text_is_written_as_encode_basestring_ascii_writes_it(s: str) -> None:
    assert _jtext(s) == _jstr(s)


def _decoded(text: str) -> tuple[str, Any]:
    try:
        return "ok", _json_object(text)
    except ValueError as e:
        return "error", type(e)


def _reference(text: str) -> tuple[str, Any]:
    try:
        return "ok", json.JSONDecoder().decode(text)
    except ValueError as e:
        return "error", type(e)


jsons = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                 max_size=3), max_leaves=8)
spaces = st.sampled_from(["", " ", "\n", "\t ", "x", "}", "{}", ","])


@settings(max_examples=500, deadline=None)
@given(jsons, spaces, spaces, st.text(max_size=6))
def test_a_header_is_read_as_decode_reads_it(value: Any, before: str, after: str, junk: str) -> None:
    text = json.dumps(value, separators=(",", ":"))
    for t in (text, before + text, text + after, before + text + after, junk, text[:-1], junk + text):
        assert _decoded(t) == _reference(t)


@settings(max_examples=100, deadline=None)
@given(ids_text, st.integers(0, 7), st.integers(0, 1 << 40))
def test_a_batch_answer_goes_through_the_codec_unchanged(msg_ids: str, queue_id: int, offset: int) -> None:
    req = RemotingCommand.request(320, {"b": "T"}, b"x")
    ext = {"msgId": msg_ids, "queueId": str(queue_id), "queueOffset": str(offset),
           "MSG_REGION": "DefaultRegion", "TRACE_ON": "true", "n": 1, "flag": True}
    frame = encode(req.response(0, ext_fields=ext))
    assert json.loads(frame[8:]) == {"code": 0, "flag": 1, "language": "JAVA", "opaque": req.opaque,
                                     "serializeTypeCurrentRPC": "JSON", "version": req.version,
                                     "extFields": {**ext, "n": "1", "flag": "true"}}
    (back,) = FrameDecoder().feed(frame)
    assert isinstance(back, RemotingCommand) and back.ext_fields["msgId"] == msg_ids
