"""HAService: a master's end of the commit-log link, and the SYNC_MASTER wait (GroupTransferService).

Each slave connection reads the slave's offset reports and streams the log from the first one, in
chunks of ``haTransferBatchSize`` that never cross a segment, woken by ``wake()`` after every append
(no polling); an idle link gets a heartbeat every ``haSendHeartbeatInterval``. A slave that reports an
offset ahead of this log's end is refused with a log line and disconnected: its extra tail may hold
acknowledged messages this master lost, so only an operator may throw it away. An empty slave of a master
whose oldest segments were cleaned gets the log from its oldest offset; a slave below that offset (its log
would have a gap) is refused the same way. A slave silent for
``haHousekeepingInterval`` is dropped. ``wait_slave(offset)`` resolves when a slave has acked it; the
waits are kept in offset order, so one ack releases every send below it. ``lag()`` says how far the best
slave is behind, in bytes and in milliseconds: the log's end is noted at each ``wake()`` while a slave is
connected (at most ``MAX_MARKS`` notes; past that the newest note is moved forward, which can only make the
reported lag larger), and an ack drops the notes it covers. With ``accept`` (the broker passes the port's TLS,
``remoting.tls.StreamAcceptor``) each connection is first handed to it: TLS or plaintext by its first byte,
as the broker's ``tlsServerMode`` allows (docs/tls.md).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from chronomq.clock import Clock
from chronomq.config import BrokerConfig
from chronomq.ha.codec import HAProtocolError, ReportDecoder, encode_transfer
from chronomq.store.message_store import MessageStore
from chronomq.store.replica import ReplicaError

log = logging.getLogger("chronomq.ha")

MAX_MARKS = 65_536  # notes of (log end, time) kept for the lag in ms


class StreamOut(Protocol):
    """What a slave connection is written through: an asyncio.StreamWriter, or a TLS layer's writer."""

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any: ...


# a new connection -> (the reader and writer to serve it with, the bytes already read from it), or None when
# it is not to be served (refused or failed: closed and logged by the callable)
Accept = Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                  Awaitable[tuple[asyncio.StreamReader, StreamOut, bytes] | None]]


class SlaveWait:
    """What a SYNC_MASTER send waited for: OK, TIMEOUT (no ack in time), NO_SLAVE (none in sync)."""

    OK = "ok"
    TIMEOUT = "timeout"
    NO_SLAVE = "no_slave"


@dataclass
class SlaveLink:
    addr: str
    acked: int = -1  # the slave's last reported max offset
    last_report_ms: int = 0


class HAService:
    def __init__(self, config: BrokerConfig, store: MessageStore, clock: Clock,
                 accept: Accept | None = None) -> None:
        self.config = config
        self.accept = accept
        self.store = store
        self.clock = clock
        self.links: dict[int, SlaveLink] = {}
        self.push_to_slave_max = 0  # the highest offset any slave has acked
        self._ids = itertools.count(1)
        self._server: asyncio.Server | None = None
        self._wakers: set[asyncio.Event] = set()
        self._waits: list[tuple[int, int, asyncio.Future[bool]]] = []  # (offset, seq, future) heap
        self._seq = itertools.count()
        self._prune_at = 1024  # prune the heap of given-up waits when it grows past this
        self._tasks: set[asyncio.Task[None]] = set()
        self._marks: deque[tuple[int, int]] = deque()  # (log end, when it was reached), oldest first
        self.replication_ms: deque[int] = deque(maxlen=4096)  # recent times from append to a slave's ack

    # --- lifecycle ------------------------------------------------------------------------------------
    async def start(self, host: str) -> None:
        self._server = await asyncio.start_server(self._serve, host, self.config.ha_port)
        log.info("HA service listening on %s:%d", host, self.config.ha_port)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        for _, _, fut in self._waits:
            if not fut.done():
                fut.set_result(False)
        self._waits.clear()

    # --- the append side -----------------------------------------------------------------------------
    def wake(self) -> None:
        """New bytes in the log: every link's writer sends them now. Call on the loop thread."""
        if self.links:
            end = self.store.max_phy_offset
            marks = self._marks
            if end > self.push_to_slave_max and (not marks or end > marks[-1][0]):
                if len(marks) < MAX_MARKS:
                    marks.append((end, self.clock.now_ms()))
                else:
                    marks[-1] = (end, marks[-1][1])
        for ev in self._wakers:
            ev.set()

    def lag(self) -> tuple[int, int]:
        """(bytes, ms) the most advanced slave is behind this log's end; (-1, -1) with no slave connected.
        The ms are how long ago the oldest byte it lacks was appended (0 when it holds everything)."""
        if not self.links:
            return -1, -1
        behind = max(0, self.store.max_phy_offset - self.push_to_slave_max)
        if behind == 0 or not self._marks:
            return behind, 0
        return behind, max(0, self.clock.now_ms() - self._marks[0][1])

    def slave_ok(self) -> bool:
        """A slave is connected and at most ``haSlaveFallbehindMax`` behind (RocketMQ's isSlaveOK)."""
        if not self.links:
            return False
        return self.store.max_phy_offset - self.push_to_slave_max < self.config.haSlaveFallbehindMax

    async def wait_slave(self, offset: int, timeout_ms: int) -> str:
        """Until a slave holds the log up to ``offset``: SlaveWait.OK, TIMEOUT or NO_SLAVE."""
        if self.push_to_slave_max >= offset:
            return SlaveWait.OK
        if not self.slave_ok():
            return SlaveWait.NO_SLAVE
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if len(self._waits) >= self._prune_at:
            self._prune()
        heapq.heappush(self._waits, (offset, next(self._seq), fut))
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                ok = await asyncio.shield(fut)
        except TimeoutError:
            fut.cancel()  # given up: pruned later, or popped when an ack passes it
            return SlaveWait.TIMEOUT
        return SlaveWait.OK if ok else SlaveWait.TIMEOUT

    def _acked(self, offset: int) -> None:
        if offset > self.push_to_slave_max:
            self.push_to_slave_max = offset
            marks = self._marks
            if marks and marks[0][0] <= offset:
                now = self.clock.now_ms()
                while marks and marks[0][0] <= offset:
                    self.replication_ms.append(now - marks.popleft()[1])
        waits = self._waits
        while waits and waits[0][0] <= self.push_to_slave_max:
            _, _, fut = heapq.heappop(waits)
            if not fut.done():
                fut.set_result(True)

    def _prune(self) -> None:
        """Drop the waits whose sender gave up, so a slave that stops acking cannot grow the heap without
        bound; amortised by doubling the threshold to what is left."""
        self._waits = [w for w in self._waits if not w[2].done()]
        heapq.heapify(self._waits)
        self._prune_at = max(1024, 2 * len(self._waits))

    # --- one slave connection ------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, raw: asyncio.StreamWriter) -> None:
        peer = raw.get_extra_info("peername")
        addr = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            accepted = await self._accepted(reader, raw, addr)
            if accepted is not None:
                await self._serve_link(*accepted, addr)
        finally:
            self._tasks.discard(task)

    async def _accepted(self, reader: asyncio.StreamReader, raw: asyncio.StreamWriter, addr: str
                        ) -> tuple[asyncio.StreamReader, StreamOut, bytes] | None:
        """The connection to serve (through ``accept`` when there is one), or None: refused or failed."""
        if self.accept is None:
            return reader, raw, b""
        wait_ms = self.config.haHousekeepingInterval
        try:
            async with asyncio.timeout(wait_ms / 1000):
                return await self.accept(reader, raw)
        except (TimeoutError, ConnectionError, OSError) as e:
            log.info("HA: connection from %s closed: %s", addr,
                     f"nothing received within {wait_ms} ms" if isinstance(e, TimeoutError) else e)
            raw.close()
            return None

    async def _serve_link(self, reader: asyncio.StreamReader, writer: StreamOut, head: bytes,
                          addr: str) -> None:
        cid = next(self._ids)
        link = SlaveLink(addr, last_report_ms=self.clock.now_ms())
        wake = asyncio.Event()
        first = asyncio.get_running_loop().create_future()
        reading = asyncio.ensure_future(self._read_reports(reader, link, first, head))
        try:
            async with asyncio.timeout(self.config.haHousekeepingInterval / 1000):
                start = await asyncio.shield(first)
            oldest = self.store.min_phy_offset
            if start == 0 and oldest > 0:
                log.info("HA: slave %s is empty and this master's log starts at %d (older segments were "
                         "cleaned): it gets the log from there", addr, oldest)
                start = oldest
            elif start < oldest:
                log.error("HA: slave %s reports offset %d, below this master's oldest offset %d (cleaned): "
                          "its log would have a gap; refusing it. Move its data aside and restart it empty "
                          "to copy this master's log from %d", addr, start, oldest, oldest)
                return
            if start > self.store.max_phy_offset:
                log.error("HA: slave %s reports offset %d, ahead of this master's log end %d; refusing it. "
                          "Its extra tail may hold messages this master lost: keep that slave's data, or "
                          "move it aside and restart the slave empty to copy this master again",
                          addr, start, self.store.max_phy_offset)
                return
            log.info("HA: slave %s connected, streaming from offset %d", addr, start)
            if not self.config.timer_journal:
                log.warning("HA: timed messages (deliver times) are not replicated to slave %s: set "
                            "timerReplication=true so that a promoted slave can deliver them", addr)
            self.links[cid] = link
            self._wakers.add(wake)
            self._acked(start)
            await self._stream(writer, link, start, wake, reading)
        except (TimeoutError, ConnectionError, HAProtocolError, ReplicaError, OSError) as e:
            log.warning("HA: slave %s disconnected: %s", addr, e or type(e).__name__)
        finally:
            self.links.pop(cid, None)
            if not self.links:
                self._marks.clear()  # no slave: no lag to measure (lag() says -1)
            self._wakers.discard(wake)
            reading.cancel()
            writer.close()

    async def _read_reports(self, reader: asyncio.StreamReader, link: SlaveLink,
                            first: asyncio.Future[int], head: bytes = b"") -> None:
        dec = ReportDecoder()
        data = head
        while True:
            if not data:
                data = await reader.read(4096)
            if not data:
                raise ConnectionError("the slave closed the connection")
            offsets = dec.feed(data)
            if offsets:
                link.acked = offsets[-1]
                link.last_report_ms = self.clock.now_ms()
                if not first.done():
                    first.set_result(offsets[0])
                else:
                    self._acked(link.acked)
            data = b""

    async def _stream(self, writer: StreamOut, link: SlaveLink, start: int, wake: asyncio.Event,
                      reading: asyncio.Future[None]) -> None:
        cfg = self.config
        nxt = start
        heartbeat_s = cfg.haSendHeartbeatInterval / 1000
        while True:
            if reading.done():
                reading.result()  # raises why the read side ended
            if self.clock.now_ms() - link.last_report_ms > cfg.haHousekeepingInterval:
                raise ConnectionError(f"no report for {cfg.haHousekeepingInterval} ms")
            wake.clear()
            chunk = self.store.replication_chunk(nxt, cfg.haTransferBatchSize)
            if chunk:
                writer.write(encode_transfer(nxt, chunk))
                nxt += len(chunk)
                await writer.drain()
                continue
            # new bytes, the slave's side ending (a closed connection is seen at once), or a heartbeat
            waiter = asyncio.ensure_future(wake.wait())
            try:
                watched: set[asyncio.Future[Any]] = {waiter, reading}
                done, _ = await asyncio.wait(watched, timeout=heartbeat_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            if not done:
                writer.write(encode_transfer(nxt))  # heartbeat: the offset this slave should be at
                await writer.drain()
