"""A compiled selector applied to stored records: RocketMQ's ExpressionMessageFilter.isMatchedByCommitLog,
which decodes a record's properties and evaluates the subscription's expression over them."""

from __future__ import annotations

import struct
from collections.abc import Callable

from chronomq.message import POS_BODY, MessageFormatError, record_topic_and_properties

from .sql92 import Selector

_I32 = struct.Struct(">i")


def record_properties(rec: bytes) -> dict[str, str] | None:
    """The properties of a stored V1 record, or None when it does not decode."""
    try:
        (body_len,) = _I32.unpack_from(rec, POS_BODY - 4)
        return record_topic_and_properties(rec, 0, len(rec), body_len)[1]
    except (MessageFormatError, struct.error, IndexError):
        return None


def record_filter(selector: Selector) -> Callable[[bytes], bool]:
    """``record -> matches``: TRUE matches; FALSE, unknown, an evaluation error or a record that does not
    decode do not."""
    matches = selector.matches

    def match(rec: bytes) -> bool:
        props = record_properties(rec)
        return props is not None and matches(props)
    return match
