"""SEND_REPLY_MESSAGE (324) and SEND_REPLY_MESSAGE_V2 (325): request-reply, as RocketMQ's
ReplyMessageProcessor (4.9 and 5.x) answers them.

A requester (``DefaultMQProducer.request``) sends an ordinary message carrying CORRELATION_ID,
REPLY_TO_CLIENT (its client id) and TTL; the broker stamps CLUSTER on it like on every send. The replier
builds the reply to ``<CLUSTER>_REPLY_TOPIC`` (the broker creates that topic at start: 1 queue, perm 6)
and sends it with code 324/325. The broker pushes it at once with PUSH_REPLY_MESSAGE_TO_CLIENT (326) to
the connection of the producer whose client id is REPLY_TO_CLIENT (the producer manager's table, the one
transaction check-backs use), adding PUSH_REPLY_TIME, and waits for that client's answer; with
``storeReplyMessageEnable`` (the default) it also stores the reply under the reply topic.

The answer: SUCCESS when the push succeeded (msgId "0", queue offset 0, or the stored message's id and
offset); SYSTEM_ERROR with RocketMQ's remark when REPLY_TO_CLIENT is missing, the requester has no
connection here, or the push failed (the reply is stored all the same). Like a send, a reply gets
MSG_REGION and TRACE_ON in its properties and its answer's header, but no CLUSTER.

Built on the send processor it is given (RocketMQ's processor extends AbstractSendMessageProcessor): the
topic checks, the stamps and the V2 header are the send path's own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from chronomq.message import (
    PROPERTY_CLUSTER,
    PROPERTY_MESSAGE_REPLY_TO_CLIENT,
    PROPERTY_PUSH_REPLY_TIME,
    encode_properties,
)
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode
from chronomq.remoting.server import DEFERRED
from chronomq.store.types import PutStatus

from .base import Handler, ProcessorBase, RequestConnection
from .send import SLAVE_REFUSES, SendProcessor, SendTarget, with_v1_fields

if TYPE_CHECKING:
    from ..services import BrokerServices

log = logging.getLogger("chronomq.broker")

PUSH_TIMEOUT_S = 10.0  # RocketMQ's Broker2Client.callClient
_STORED = (PutStatus.PUT_OK, PutStatus.FLUSH_DISK_TIMEOUT)


class ReplyProcessor(ProcessorBase):
    """Replies: checked as a send (``send``'s target), pushed to the requester, stored."""

    def __init__(self, services: BrokerServices, send: SendProcessor) -> None:
        super().__init__(services)
        self.send = send
        self._reply_tasks: set[asyncio.Future[None]] = set()
        self._reply_stamps = {k: v for k, v in send.stamps.items() if k != PROPERTY_CLUSTER}

    def handlers(self) -> dict[int, Handler]:
        return {
            RequestCode.SEND_REPLY_MESSAGE: self.send_reply_message,
            RequestCode.SEND_REPLY_MESSAGE_V2: self.send_reply_message,
        }

    def send_reply_message(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand | None:
        if self.config.is_slave:
            return req.response(ResponseCode.SERVICE_NOT_AVAILABLE, remark=SLAVE_REFUSES)
        if req.code == RequestCode.SEND_REPLY_MESSAGE_V2:
            req = with_v1_fields(req)
        target = self.send.send_target(req, False, self._reply_stamps)
        if isinstance(target, RemotingCommand):
            return target
        task = asyncio.ensure_future(self._reply(req, conn, target))
        self._reply_tasks.add(task)
        task.add_done_callback(self._reply_tasks.discard)
        return DEFERRED

    async def _reply(self, req: RemotingCommand, conn: RequestConnection, target: SendTarget) -> None:
        ext = {"msgId": "0", "queueId": str(target.queue_id), "queueOffset": "0",
               "MSG_REGION": self.send.region, "TRACE_ON": self.send.trace_on}
        try:
            ok, remark = await self._push_reply(req, conn, target)
            code = ResponseCode.SUCCESS if ok else ResponseCode.SYSTEM_ERROR
            if self.config.storeReplyMessageEnable:
                msg = target.message(conn, self.services.store_host, dict(target.properties), req.body,
                                     target.flag, target.sys_flag)
                result = self.store.put_message(msg)
                self.services.put_stats.record(result)
                if result.status in _STORED and result.append is not None:
                    a = result.append
                    ext["msgId"], ext["queueOffset"] = a.msg_id, str(a.queue_offset)
                else:
                    log.warning("reply to %s: not stored (%s)", target.topic,
                                result.error or result.status.value)
            conn.reply(req, req.response(code, remark=None if ok else remark, ext_fields=ext))
        except Exception as e:  # answered, never a traceback on the wire
            log.exception("reply message failed")
            conn.reply(req, req.response(ResponseCode.SYSTEM_ERROR,
                                         remark=f"reply failed: {type(e).__name__}"))

    async def _push_reply(self, req: RemotingCommand, conn: RequestConnection, target: SendTarget
                          ) -> tuple[bool, str]:
        """PUSH_REPLY_MESSAGE_TO_CLIENT to the requester: (pushed, the remark when not)."""
        props = target.properties
        sender = props.get(PROPERTY_MESSAGE_REPLY_TO_CLIENT)
        if sender is None:
            log.warning("%s is null, can not reply message", PROPERTY_MESSAGE_REPLY_TO_CLIENT)
            return False, f"reply message properties[{PROPERTY_MESSAGE_REPLY_TO_CLIENT}] is null"
        channel = self.services.producers.find_connection(sender)
        if channel is None:
            remark = f"push reply message fail, channel of <{sender}> not found."
            log.warning(remark)
            return False, remark
        host, port = self.services.store_host
        f = req.ext_fields
        header = {
            "bornHost": f"{conn.remote[0]}:{conn.remote[1]}",
            "storeHost": f"{host}:{port}",
            "storeTimestamp": str(self.clock.now_ms()),
            "producerGroup": f.get("producerGroup", ""),
            "topic": target.topic,
            "defaultTopic": f.get("defaultTopic", ""),
            "defaultTopicQueueNums": f.get("defaultTopicQueueNums", "0"),
            "queueId": f.get("queueId", str(target.queue_id)),
            "sysFlag": str(target.sys_flag),
            "bornTimestamp": str(target.born_timestamp),
            "flag": str(target.flag),
            "properties": encode_properties({**props, PROPERTY_PUSH_REPLY_TIME: str(self.clock.now_ms())}),
            "reconsumeTimes": str(target.reconsume_times),
            "unitMode": f.get("unitMode", "false"),
        }
        push = RemotingCommand.request(RequestCode.PUSH_REPLY_MESSAGE_TO_CLIENT, header, req.body)
        push.language = "JAVA"
        try:
            answer = await channel.invoke(push, PUSH_TIMEOUT_S)
        except (TimeoutError, ConnectionError) as e:
            log.warning("push reply message to <%s> fail: %s", sender, e or type(e).__name__)
            return False, f"push reply message to {sender}fail."
        if answer.code != ResponseCode.SUCCESS:
            log.warning("push reply message to <%s> return fail, response remark: %s", sender, answer.remark)
            return False, f"push reply message to {sender}fail."
        return True, ""
