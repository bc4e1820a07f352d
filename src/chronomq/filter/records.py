"""A compiled selector applied to stored records: RocketMQ's ExpressionMessageFilter.isMatchedByCommitLog,
which decodes a record's properties and evaluates the subscription's expression over them.

Only the properties the expression names are read: each is found in the record's properties bytes
(``name\\x01value\\x02``; the last occurrence wins, as in a decoded map), so a record's other properties
cost nothing."""

from __future__ import annotations

import struct
from collections.abc import Callable

from chronomq.message import POS_BODY, MessageFormatError, record_topic_and_properties

from .sql92 import Selector

_I32 = struct.Struct(">i")
_H16 = struct.Struct(">H")


def record_properties(rec: bytes) -> dict[str, str] | None:
    """All the properties of a stored V1 record, or None when it does not decode."""
    try:
        (body_len,) = _I32.unpack_from(rec, POS_BODY - 4)
        return record_topic_and_properties(rec, 0, len(rec), body_len)[1]
    except (MessageFormatError, struct.error, IndexError):
        return None


def properties_span(rec: bytes) -> tuple[int, int] | None:
    """(start, end) of a stored V1 record's properties bytes, or None when its lengths do not add up."""
    try:
        (body_len,) = _I32.unpack_from(rec, POS_BODY - 4)
        if body_len < 0:
            return None
        p = POS_BODY + body_len
        p += 1 + rec[p]  # the topic
        (props_len,) = _H16.unpack_from(rec, p)
    except (struct.error, IndexError):
        return None
    start = p + 2
    return (start, start + props_len) if start + props_len == len(rec) else None


def named_properties(rec: bytes, start: int, end: int,
                     names: list[tuple[str, bytes, bytes]]) -> dict[str, str] | None:
    """The properties ``names`` ((name, b"name\\x01", b"\\x02name\\x01") each) of the properties bytes
    ``rec[start:end]``; None when a value is not UTF-8."""
    out: dict[str, str] = {}
    for name, head, inner in names:
        i = rec.rfind(inner, start, end)
        if i >= 0:
            v = i + len(inner)
        elif rec.startswith(head, start, end):
            v = start + len(head)
        else:
            continue
        stop = rec.find(b"\x02", v, end)
        try:
            out[name] = rec[v:stop if stop >= 0 else end].decode()
        except UnicodeDecodeError:
            return None
    return out


def record_filter(selector: Selector) -> Callable[[bytes], bool]:
    """``record -> matches``: TRUE matches; FALSE, unknown, an evaluation error or a record that does not
    decode do not."""
    matches = selector.matches
    names = [(n, n.encode() + b"\x01", b"\x02" + n.encode() + b"\x01") for n in sorted(selector.names)]

    def match(rec: bytes) -> bool:
        span = properties_span(rec)
        if span is None:
            return False
        props = named_properties(rec, span[0], span[1], names)
        return props is not None and matches(props)
    return match
