"""HAClient: a slave's end of the commit-log link (RocketMQ's HAClient).

Connects to the master's HA address, reports its own max offset, writes every chunk it receives at the
same offset in its store (which dispatches it), and reports again after each read and every
``haSendHeartbeatInterval``. A chunk or heartbeat for another offset than the store's end means the two
logs disagree: the link is closed, logged, and retried after a pause. Reconnects resume from the
store's end. The master's address comes from ``haMasterAddress`` or from the name server's answer
(``set_master``). With an ``ssl_context`` (the broker's ``tlsEnable``) the link is TLS. A link that keeps
failing for the same reason is logged once (a WARNING, with a hint when TLS may be why), then once a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

from chronomq.clock import Clock
from chronomq.config import BrokerConfig
from chronomq.ha.codec import HAProtocolError, TransferDecoder, encode_report
from chronomq.store.message_store import MessageStore
from chronomq.store.replica import ReplicaError

log = logging.getLogger("chronomq.ha")

RETRY_S = 1.0  # pause before reconnecting
REPEAT_LOG_S = 60.0  # the same failure again is logged at most this often (DEBUG in between)
HANDSHAKE_TIMEOUT_S = 10.0
MAX_BODY = 64 * 1024 * 1024


class HAClient:
    def __init__(self, config: BrokerConfig, store: MessageStore, clock: Clock,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self.ssl_context = ssl_context
        self.master_addr = config.haMasterAddress
        self.connected = False
        self.master_offset = -1  # the master's next offset for us, from its last frame
        self.last_receive_ms = 0
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._opened = False  # the current link's connection is open (TLS: its handshake done)
        self._received = False  # and has received bytes from the master
        self._failure = ""  # the last failure logged, and how many times it recurred since
        self._failure_at = 0.0
        self._repeats = 0

    def set_master(self, addr: str) -> None:
        """The master's HA address as the name server reports it (kept if haMasterAddress is set)."""
        if addr and addr != self.master_addr and not self.config.haMasterAddress:
            log.info("HA: master address is now %s", addr)
            self.master_addr = addr
            self._changed.set()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """End the link and wait for it, without swallowing a cancel of the caller."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
            if not task.cancelled() and task.exception() is not None:
                log.warning("HA: replication from the master had stopped: %r", task.exception())

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
                self._ended(addr, e)
            finally:
                self.connected = False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RETRY_S):
                    await self._changed.wait()

    def _ended(self, addr: str, e: Exception) -> None:
        """Log why a link ended: a WARNING, but the same reason again only once a minute (with the count)."""
        why = str(e) or type(e).__name__
        # closed during the handshake (refused by the master's mode), or the handshake itself failed
        in_handshake = isinstance(e, ssl.SSLError | ConnectionResetError | ConnectionAbortedError)
        if self.ssl_context is not None and not self._opened and in_handshake:
            why = f"TLS handshake failed: {why} (a master whose tlsServerMode is disabled refuses TLS)"
        elif (self.ssl_context is None and self._opened and not self._received
              and isinstance(e, ConnectionError)):
            why += (" before it sent anything (a master whose tlsServerMode is enforcing closes plaintext "
                    "links: set tlsEnable=true on this slave)")
        now = self.clock.monotonic()
        if why != self._failure:
            self._failure, self._failure_at, self._repeats = why, now, 0
            log.warning("HA: link to master %s ended: %s", addr, why)
        elif now - self._failure_at >= REPEAT_LOG_S:
            log.warning("HA: link to master %s ended again (%d times in %.0f s): %s", addr, self._repeats + 1,
                        now - self._failure_at, why)
            self._failure_at, self._repeats = now, 0
        else:
            self._repeats += 1
            log.debug("HA: link to master %s ended: %s", addr, why)

    async def _link(self, addr: str) -> None:
        host, _, port = addr.rpartition(":")
        self._received = self._opened = False
        if self.ssl_context is None:
            reader, writer = await asyncio.open_connection(host, int(port))
        else:
            reader, writer = await asyncio.open_connection(host, int(port), ssl=self.ssl_context,
                                                           ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
        self._opened = True
        try:
            self.connected = True
            log.debug("HA: connected to master %s%s", addr, " over TLS" if self.ssl_context else "")
            writer.write(encode_report(self.store.max_phy_offset))
            await writer.drain()
            dec = TransferDecoder(MAX_BODY)
            heartbeat_s = self.config.haSendHeartbeatInterval / 1000
            while True:
                data = None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(heartbeat_s):
                        data = await reader.read(256 * 1024)
                if data == b"":
                    raise ConnectionError("the master closed the connection")
                if data:
                    if not self._received:  # the master serves this link
                        self._received = True
                        self._failure = ""  # a later failure is news again
                        log.info("HA: linked to master %s%s at offset %d", addr,
                                 " over TLS" if self.ssl_context else "", self.store.max_phy_offset)
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
