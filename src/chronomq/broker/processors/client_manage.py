"""HEART_BEAT (34), UNREGISTER_CLIENT (35) and CHECK_CLIENT_CONFIG (46): producers and consumers coming
and going, and whether this broker can serve a consumer's subscription (RocketMQ's ClientManageProcessor).

Rules: a heartbeat registers each consumer group (creating its subscription group when
autoCreateSubscriptionGroup is on, and its retry topic when clustering) and each producer group; a
change in a group's consumers is told through ``services.notify_consumer_ids_changed``.
CHECK_CLIENT_CONFIG answers as RocketMQ's broker: SUCCESS for a TAG subscription (or none); for any
other expression type, SYSTEM_ERROR with enablePropertyFilter=false, else SUCCESS for a SQL92 expression
that compiles and SUBSCRIPTION_PARSE_FAILED (the compiler's words: where, and what was expected) for
one that does not.
"""

from __future__ import annotations

import logging

from chronomq.message import RETRY_GROUP_TOPIC_PREFIX
from chronomq.remoting.codec import HeaderError, RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode

from ..clients import ClientInfo, message_model_is_clustering
from .base import Handler, ProcessorBase, RequestConnection, is_tag_type, no_filter_remark, parse_json_body

log = logging.getLogger("chronomq.broker")


class ClientManageProcessor(ProcessorBase):
    """Client registration from heartbeats and unregistration."""

    def handlers(self) -> dict[int, Handler]:
        return {
            RequestCode.HEART_BEAT: self.heart_beat,
            RequestCode.UNREGISTER_CLIENT: self.unregister_client,
            RequestCode.CHECK_CLIENT_CONFIG: self.check_client_config,
        }

    def heart_beat(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        hb = parse_json_body(req, "HEART_BEAT")
        if not isinstance(hb, dict):
            raise HeaderError("HEART_BEAT body is not a JSON object")
        client_id = str(hb.get("clientID") or "")
        if not client_id:
            raise HeaderError("HEART_BEAT body lacks clientID")
        now = self.clock.now_ms()
        for cd in hb.get("consumerDataSet") or []:
            if not isinstance(cd, dict) or not cd.get("groupName"):
                continue
            group = str(cd["groupName"])
            sub_group = self.services.subgroups.find(group)
            if message_model_is_clustering(cd.get("messageModel", 1)):
                retry_queues = sub_group.retryQueueNums if sub_group is not None else 1
                self.topics.create_system(RETRY_GROUP_TOPIC_PREFIX + group, max(1, retry_queues))
            info = ClientInfo(client_id, conn, now, req.language, req.version)
            if self.services.consumers.register(group, info, cd):
                log.info("consumer %s joined group %s", client_id, group)
                self.services.notify_consumer_ids_changed(group)
        for pd in hb.get("producerDataSet") or []:
            if isinstance(pd, dict) and pd.get("groupName"):
                self.services.producers.register(
                    str(pd["groupName"]), ClientInfo(client_id, conn, now, req.language, req.version)
                )
        return req.response()

    def unregister_client(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        client_id = req.require_str("clientID")
        pg = req.ext_str("producerGroup", "") or ""
        cg = req.ext_str("consumerGroup", "") or ""
        if pg:
            self.services.producers.unregister(pg, client_id)
        if cg and self.services.consumers.unregister(cg, client_id):
            log.info("consumer %s left group %s", client_id, cg)
            self.services.notify_consumer_ids_changed(cg)
        return req.response()

    def check_client_config(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        """CheckClientRequestBody {clientId, group, subscriptionData}: the Java push and lite-pull
        consumers send it at start for each subscription that is not by TAG, and fail to start unless
        the answer is SUCCESS."""
        body = parse_json_body(req, "CHECK_CLIENT_CONFIG")
        if not isinstance(body, dict):
            raise HeaderError("CHECK_CLIENT_CONFIG body is not a JSON object")
        sub = body.get("subscriptionData")
        if sub is None:
            return req.response()
        if not isinstance(sub, dict):
            raise HeaderError("CHECK_CLIENT_CONFIG subscriptionData is not a JSON object")
        expression_type = sub.get("expressionType")
        if expression_type is not None and not isinstance(expression_type, str):
            raise HeaderError("CHECK_CLIENT_CONFIG subscriptionData.expressionType is not a string")
        if is_tag_type(expression_type):
            return req.response()
        if self.config.enablePropertyFilter:
            if expression_type != "SQL92":
                return req.response(ResponseCode.SUBSCRIPTION_PARSE_FAILED,
                                    remark=f"the broker cannot filter message by {expression_type}")
            # the filter engine loads with the first SQL92 subscription
            from chronomq.filter.sql92 import FilterSyntaxError, compile_sql92

            try:
                compile_sql92(str(sub.get("subString") or ""))
            except FilterSyntaxError as e:
                log.info("consumer %s of group %s subscribes to %s by SQL92 that does not compile: %s",
                         body.get("clientId"), body.get("group"), sub.get("topic"), e)
                return req.response(ResponseCode.SUBSCRIPTION_PARSE_FAILED, remark=str(e))
            return req.response()
        log.info("consumer %s of group %s subscribes to %s by %s, which this broker cannot filter",
                 body.get("clientId"), body.get("group"), sub.get("topic"), expression_type)
        return req.response(ResponseCode.SYSTEM_ERROR, remark=no_filter_remark(str(expression_type)))
