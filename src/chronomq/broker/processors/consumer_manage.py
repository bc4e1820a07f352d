"""GET_CONSUMER_LIST_BY_GROUP (38), QUERY_CONSUMER_OFFSET (14), UPDATE_CONSUMER_OFFSET (15): what a
consumer asks about its group and its committed offsets (RocketMQ's ConsumerManageProcessor).

Rules: offsets live in ``services.offsets``; a group with no committed offset on a queue that still
starts at 0 is told 0, otherwise QUERY_NOT_FOUND.
"""

from __future__ import annotations

from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode

from .base import Handler, ProcessorBase, RequestConnection, dump_json


class ConsumerManageProcessor(ProcessorBase):
    """A group's consumer list and committed offsets."""

    def handlers(self) -> dict[int, Handler]:
        return {
            RequestCode.GET_CONSUMER_LIST_BY_GROUP: self.get_consumer_list,
            RequestCode.QUERY_CONSUMER_OFFSET: self.query_consumer_offset,
            RequestCode.UPDATE_CONSUMER_OFFSET: self.update_consumer_offset,
        }

    def get_consumer_list(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        group = req.require_str("consumerGroup")
        ids = self.services.consumers.client_ids(group)
        if not ids:
            return req.response(ResponseCode.SYSTEM_ERROR, remark=f"no consumer for this group, {group}")
        return req.response(body=dump_json({"consumerIdList": ids}))

    # --- offsets -------------------------------------------------------------------------------------------
    def query_consumer_offset(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        group = req.require_str("consumerGroup")
        topic = req.require_str("topic")
        qid = req.ext_int("queueId")
        off = self.services.offsets.query(group, topic, qid)
        if off >= 0:
            return req.response(ext_fields={"offset": str(off)})
        if self.store.get_min_offset_in_queue(topic, qid) <= 0:
            return req.response(ext_fields={"offset": "0"})
        return req.response(
            ResponseCode.QUERY_NOT_FOUND,
            remark="Not found, V3_0_6_SNAPSHOT maybe this group consumer boot first",
        )

    def update_consumer_offset(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        self.services.offsets.commit(
            req.require_str("consumerGroup"),
            req.require_str("topic"),
            req.ext_int("queueId"),
            req.ext_int("commitOffset"),
        )
        return req.response()
