"""HAClient: a slave's end of the commit-log link (RocketMQ's HAClient).

Connects to the master's HA address, reports its own max offset, writes every chunk it receives at the
same offset in its store (which dispatches it), and reports again after each read and every
``haSendHeartbeatInterval``. A chunk or heartbeat for another offset than the store's end means the two
logs disagree: the link is closed, logged, and retried after a pause. Reconnects resume from the
store's end. The master's address comes from ``haMasterAddress`` or from the name server's answer
(``set_master``).
"""

from __future__ import annotations

import asyncio
import logging

from chronomq.clock import Clock
from chronomq.config import BrokerConfig
from chronomq.ha.codec import HAProtocolError, TransferDecoder, encode_report
from chronomq.store.message_store import MessageStore
from chronomq.store.replica import ReplicaError

log = logging.getLogger("chronomq.ha")

RETRY_S = 1.0  # pause before reconnecting
MAX_BODY = 64 * 1024 * 1024


class HAClient:
    def __init__(self, config: BrokerConfig, store: MessageStore, clock: Clock) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.master_addr = config.haMasterAddress
        self.connected = False
        self.master_offset = -1  # the master's next offset for us, from its last frame
        self.last_receive_ms = 0
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    def set_master(self, addr: str) -> None:
        """The master's HA address as the name server reports it (kept if haMasterAddress is set)."""
        if addr and addr != self.master_addr and not self.config.haMasterAddress:
            log.info("HA: master address is now %s", addr)
            self.master_addr = addr
            self._changed.set()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        while True:
            addr = self.master_addr
            if not addr:
                self._changed.clear()
                await self._changed.wait()
                continue
            try:
                await self._link(addr)
            except asyncio.CancelledError:
                raise
            except (OSError, ConnectionError, HAProtocolError, ReplicaError, ValueError) as e:
                log.warning("HA: link to master %s ended: %s", addr, e or type(e).__name__)
            finally:
                self.connected = False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), RETRY_S)
            except TimeoutError:
                pass

    async def _link(self, addr: str) -> None:
        host, _, port = addr.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            self.connected = True
            log.info("HA: connected to master %s at offset %d", addr, self.store.max_phy_offset)
            writer.write(encode_report(self.store.max_phy_offset))
            await writer.drain()
            dec = TransferDecoder(MAX_BODY)
            heartbeat_s = self.config.haSendHeartbeatInterval / 1000
            while True:
                try:
                    data = await asyncio.wait_for(reader.read(256 * 1024), heartbeat_s)
                except TimeoutError:
                    data = None
                if data == b"":
                    raise ConnectionError("the master closed the connection")
                if data:
                    self.last_receive_ms = self.clock.now_ms()
                    for offset, body in dec.feed(data):
                        mine = self.store.max_phy_offset
                        if offset != mine and not (mine == 0 and body):  # an empty log may start later
                            raise ReplicaError(f"the master sends offset {offset}, this slave's log ends at "
                                               f"{mine}; the logs disagree")
                        if body:
                            self.store.append_replicated(offset, body)
                        self.master_offset = offset + len(body)
                writer.write(encode_report(self.store.max_phy_offset))
                await writer.drain()
        finally:
            writer.close()
