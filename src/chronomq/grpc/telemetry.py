"""One 5.x client's Telemetry stream as the broker sees a client connection: answers to its commands and
the server's own commands (a transaction check, as RecoverOrphanedTransactionCommand) go out through it.
A 5.x producer is registered in the broker's ProducerManager under each topic it publishes (5.x
producers have no group; the topic is the group, as in RocketMQ's proxy), with this channel as its
connection, so the 4.x transaction check reaches it unchanged (docs/grpc.md, Transactions).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from chronomq.broker.clients import ClientInfo, ProducerManager
from chronomq.message import MessageFormatError, decode_record
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode

from . import convert
from ._proto import rocketmq_v2_pb2 as pb

log = logging.getLogger("chronomq.grpc")

MAX_PENDING = 1_000  # commands queued for a client that reads none are dropped past this
MAX_TOPICS = 1_000  # topics one producer is registered under


class TelemetryChannel:
    """Outgoing commands of one stream (``put``, read by ``outgoing``); ``send_oneway`` is what the
    broker's services call on a client connection."""

    def __init__(self, client_id: str, peer: str) -> None:
        self.client_id = client_id
        self.remote_addr = self.addr = peer
        self.closed = False
        self.topics: set[str] = set()
        self._queue: asyncio.Queue[pb.TelemetryCommand | None] = asyncio.Queue(MAX_PENDING)

    def put(self, cmd: pb.TelemetryCommand) -> bool:
        if self.closed:
            return False
        try:
            self._queue.put_nowait(cmd)
        except asyncio.QueueFull:
            log.warning("telemetry: client %s reads no commands; one dropped", self.client_id)
            return False
        return True

    def close(self) -> None:
        """No more commands: ``outgoing`` ends after the queued ones."""
        if not self.closed:
            self.closed = True
            if self._queue.full():  # the client reads nothing: its last command goes
                self._queue.get_nowait()
            self._queue.put_nowait(None)

    async def outgoing(self) -> AsyncIterator[pb.TelemetryCommand]:
        while True:  # ends at close()'s None
            cmd = await self._queue.get()
            if cmd is None:
                return
            yield cmd

    def send_oneway(self, cmd: RemotingCommand) -> None:
        """A 4.x server-to-client command: CHECK_TRANSACTION_STATE becomes RecoverOrphanedTransaction-
        Command (the transaction id names the half message put again for this check); others have no
        5.x form and are dropped."""
        if cmd.code != RequestCode.CHECK_TRANSACTION_STATE:
            return
        ext = cmd.ext_fields or {}
        try:
            m = decode_record(cmd.body or b"")
        except MessageFormatError as e:
            log.error("telemetry: a transaction check for %s is unreadable: %s", self.client_id, e)
            return
        tx_id = f"{ext.get('offsetMsgId', '')}.{ext.get('tranStateTableOffset', '')}"
        msg = convert.to_v2(m, "", 1, 0)
        self.put(pb.TelemetryCommand(
            recover_orphaned_transaction_command=pb.RecoverOrphanedTransactionCommand(
                message=msg, transaction_id=tx_id)))

    async def invoke(self, cmd: RemotingCommand, timeout: float = 3.0) -> RemotingCommand:
        """A 4.x server-to-client request: a 5.x client answers none."""
        raise ConnectionError(f"{self.client_id} is a 5.x client: it answers no 4.x request")

    # --- the producer's registration ----------------------------------------------------------------------
    def register(self, producers: ProducerManager, topics: list[str], now_ms: int) -> None:
        """Under each published topic as producer group (again on every settings command)."""
        for t in list(topics)[:MAX_TOPICS]:
            self.topics.add(t)
        self.refresh(producers, now_ms)

    def refresh(self, producers: ProducerManager, now_ms: int) -> None:
        """A heartbeat: registered again (after an expiry too) with a new last-seen time."""
        for t in self.topics:
            producers.register(t, ClientInfo(self.client_id, self, now_ms, "PYTHON"))

    def unregister(self, producers: ProducerManager) -> None:
        for t in self.topics:
            g = producers.groups.get(t) or {}
            if (c := g.get(self.client_id)) is not None and c.conn is self:
                producers.unregister(t, self.client_id)
