"""HEART_BEAT (34) and UNREGISTER_CLIENT (35): producers and consumers coming and going (RocketMQ's
ClientManageProcessor).

Rules: a heartbeat registers each consumer group (creating its retry topic when clustering) and each
producer group; a change in a group's consumers is told through ``services.notify_consumer_ids_changed``.
"""

from __future__ import annotations

import logging

from chronomq.message import RETRY_GROUP_TOPIC_PREFIX
from chronomq.remoting.codec import HeaderError, RemotingCommand
from chronomq.remoting.codes import RequestCode
from chronomq.remoting.server import Connection

from ..clients import ClientInfo, message_model_is_clustering
from .base import Handler, ProcessorBase, parse_json_body

log = logging.getLogger("chronomq.broker")


class ClientManageProcessor(ProcessorBase):
    """Client registration from heartbeats and unregistration."""

    def _init_client_manage(self) -> dict[int, Handler]:
        return {
            RequestCode.HEART_BEAT: self.heart_beat,
            RequestCode.UNREGISTER_CLIENT: self.unregister_client,
        }

    def heart_beat(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
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
            if message_model_is_clustering(cd.get("messageModel", 1)):
                self.topics.create_system(RETRY_GROUP_TOPIC_PREFIX + group, 1)
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

    def unregister_client(self, req: RemotingCommand, conn: Connection) -> RemotingCommand:
        client_id = req.require_str("clientID")
        pg = req.ext_str("producerGroup", "") or ""
        cg = req.ext_str("consumerGroup", "") or ""
        if pg:
            self.services.producers.unregister(pg, client_id)
        if cg and self.services.consumers.unregister(cg, client_id):
            log.info("consumer %s left group %s", client_id, cg)
            self.services.notify_consumer_ids_changed(cg)
        return req.response()
