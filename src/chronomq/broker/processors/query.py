"""VIEW_MESSAGE_BY_ID (33) and QUERY_MESSAGE (12): looking stored messages up by offset message id or
by key (RocketMQ's QueryMessageProcessor).

Rules: the answer carries the stored records' bytes as they are in the commit log, less the level
service's internal delay-source property (delay/delivery.py hide_delay_source); nothing found is
SYSTEM_ERROR (view) or QUERY_NOT_FOUND (query) with RocketMQ's remarks.
"""

from __future__ import annotations

from chronomq.delay.delivery import hide_delay_source
from chronomq.message import decode_offset_msg_id
from chronomq.remoting.codec import HeaderError, RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode

from .base import Handler, ProcessorBase, RequestConnection


class QueryMessageProcessor(ProcessorBase):
    """Message lookups by id and by key."""

    def handlers(self) -> dict[int, Handler]:
        return {
            RequestCode.VIEW_MESSAGE_BY_ID: self.view_message_by_id,
            RequestCode.QUERY_MESSAGE: self.query_message,
        }

    # --- lookups -------------------------------------------------------------------------------------------
    def view_message_by_id(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        offset_s = req.ext_str("offset")
        if offset_s is None:
            msg_id = req.require_str("msgId")
            try:
                _, offset = decode_offset_msg_id(msg_id)
            except ValueError as e:
                raise HeaderError(str(e)) from None
        else:
            offset = req.ext_int("offset")
        raw = self.store.read_record(offset) if offset >= 0 else None
        if raw is None:
            return req.response(
                ResponseCode.SYSTEM_ERROR, remark=f"can not find message by the offset, {offset}"
            )
        return req.response(body=bytes(hide_delay_source(raw)))

    def query_message(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        topic = req.require_str("topic")
        key = req.require_str("key")
        max_num = max(1, min(req.ext_int("maxNum", 32), 64))
        begin = req.ext_int("beginTimestamp", 0)
        end = req.ext_int("endTimestamp", 2**62)
        msgs = self.store.query_message(topic, key, max_num, begin, end)
        parts = []
        for m in msgs:
            raw = self.store.read_record(m.commit_log_offset)
            if raw is not None:
                parts.append(bytes(hide_delay_source(raw)))
        ext = {
            "indexLastUpdateTimestamp": str(self.clock.now_ms()),
            "indexLastUpdatePhyoffset": str(self.store.max_phy_offset),
        }
        if not parts:
            return req.response(
                ResponseCode.QUERY_NOT_FOUND,
                ext_fields=ext,
                remark="can not find message, maybe time range not correct",
            )
        return req.response(ext_fields=ext, body=b"".join(parts))
