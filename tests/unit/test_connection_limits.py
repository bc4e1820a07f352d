"""The remoting server's limits against hostile connections: a slow frame or a silent connection is
closed, an idle one too unless a request is held, a flood beyond the connection limits is accepted and
closed while others are still served, an oversized frame costs no memory, unfinished frames share one
byte budget, and a peer that does not read cannot make the server buffer without bound. Times run on a
virtual clock, so nothing here waits for a limit in real time."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.conftest import async_wait_for, free_port
from tests.integration.rawclient import AsyncRawClient, pull_ext

from chronomq.clock import SystemClock, VirtualClock
from chronomq.config import BrokerConfig
from chronomq.remoting.codec import FrameDecoder, RemotingCommand, encode
from chronomq.remoting.codes import RequestCode, ResponseCode
from chronomq.remoting.server import Connection, ConnectionLimits, RemotingServer, UnsupportedCode

pytestmark = pytest.mark.timeout(60)

ECHO, HOLD, BIG = 1000, 1001, 1002


class App:
    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def handle(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        if req.code == HOLD:  # like a long-polled pull: answered when released
            await self.release.wait()
            return req.response(ext_fields={"held": "done"})
        raise UnsupportedCode(req.code)

    def handle_sync(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        if req.code == ECHO:
            return req.response(ext_fields={"echo": req.ext_str("v", "")})
        if req.code == BIG:  # a small request with a large answer, answered inline
            return req.response(body=b"z" * 65536)
        return None


async def _server(limits: ConnectionLimits, clock: VirtualClock | None = None) -> RemotingServer:
    app = App()
    srv = RemotingServer(app.handle, "127.0.0.1", 0, name="test", sync_handler=app.handle_sync,
                         limits=limits, clock=clock)
    srv.app = app  # type: ignore[attr-defined]
    await srv.start()
    return srv


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
async def stopper() -> AsyncIterator[list[RemotingServer]]:
    servers: list[RemotingServer] = []
    yield servers
    for s in servers:
        s.app.release.set()  # type: ignore[attr-defined]
        await s.stop()


async def _open(srv: RemotingServer, source: str = "127.0.0.1"
                ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(srv.host, srv.port, local_addr=(source, 0))


async def _closed_by_server(reader: asyncio.StreamReader, timeout: float = 10.0) -> bool:
    """True once the server has closed the connection (EOF or reset); False if it is still open."""
    try:
        while True:
            data = await asyncio.wait_for(reader.read(1 << 16), timeout)
            if not data:
                return True
    except (ConnectionError, OSError):
        return True
    except TimeoutError:
        return False


async def _still_open(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 0.05) != b""
    except TimeoutError:
        return True
    except (ConnectionError, OSError):
        return False


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, v: str) -> str:
    writer.write(encode(RemotingCommand(code=ECHO, opaque=7, ext_fields={"v": v})))
    dec = FrameDecoder()
    while True:
        data = await asyncio.wait_for(reader.read(1 << 16), 10)
        assert data, "closed instead of answering"
        for cmd in dec.feed(data):
            assert isinstance(cmd, RemotingCommand)
            return str(cmd.ext_fields["echo"])


# --- slow and silent connections ----------------------------------------------------------------------
async def test_a_frame_sent_a_byte_at_a_time_is_cut_off(clock: VirtualClock, stopper: list) -> None:
    srv = await _server(ConnectionLimits(frame_read_timeout=0.5, max_idle=0), clock)
    stopper.append(srv)
    reader, writer = await _open(srv)
    assert await _echo(reader, writer, "a") == "a"  # a whole frame at once is fine
    frame = encode(RemotingCommand(code=ECHO, opaque=8, ext_fields={"v": "slow"}))
    for i in range(4):  # slow-loris: a byte every 0.1 s (virtual), still within 0.5 s
        writer.write(frame[i : i + 1])
        await async_wait_for(lambda n=i: srv.connections()[0]._decoder.buffered == n + 1, message="byte read")
        await clock.advance(100)
    assert srv.connections() and await _still_open(reader)
    writer.write(frame[4:5])
    await clock.advance(1000)  # well past 0.5 s since the frame started
    assert await _closed_by_server(reader)
    assert srv.closed_overdue == 1 and srv.connections() == [] and srv._buffered_total == 0


async def test_a_connection_that_sends_nothing_is_closed(clock: VirtualClock, stopper: list) -> None:
    srv = await _server(ConnectionLimits(frame_read_timeout=0.5, max_idle=0), clock)
    stopper.append(srv)
    reader, _writer = await _open(srv)
    await async_wait_for(lambda: srv.connections(), message="accepted")
    await clock.advance(1000)
    assert await _closed_by_server(reader)


async def test_an_idle_connection_is_closed_but_not_one_with_a_request_held(
    clock: VirtualClock, stopper: list
) -> None:
    srv = await _server(ConnectionLimits(frame_read_timeout=0, max_idle=0.5), clock)
    stopper.append(srv)
    idle_r, idle_w = await _open(srv)
    held = await AsyncRawClient.connect(srv.address)
    assert await _echo(idle_r, idle_w, "x") == "x"
    pull = held.start(HOLD)  # a long poll, held far longer than the idle limit
    await async_wait_for(lambda: any(c._tasks for c in srv.connections()), message="held")
    for _ in range(10):
        await clock.advance(300)
    assert await _closed_by_server(idle_r)
    assert not held.closed.is_set() and len(srv.connections()) == 1
    srv.app.release.set()  # type: ignore[attr-defined]
    assert (await asyncio.wait_for(pull, 10)).ext_fields == {"held": "done"}
    await clock.advance(1000)  # nothing held any more, and silent: closed
    await asyncio.wait_for(held.closed.wait(), 10)


async def test_default_limits_never_cut_a_heartbeating_client(clock: VirtualClock, stopper: list) -> None:
    srv = await _server(ConnectionLimits(), clock)
    stopper.append(srv)
    reader, writer = await _open(srv)
    for i in range(20):  # ten minutes of a client that only heartbeats, every 30 s
        assert await _echo(reader, writer, str(i)) == str(i)
        await clock.advance(30_000)
    assert srv.closed_overdue == 0 and len(srv.connections()) == 1
    await clock.advance(121_000)  # and one that has fallen silent is let go
    assert await _closed_by_server(reader)


# --- floods ---------------------------------------------------------------------------------------------
async def _flood(srv: RemotingServer, n: int, source: str = "127.0.0.1"
                 ) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    out = []
    for i in range(0, n, 100):
        out += await asyncio.gather(*(_open(srv, source) for _ in range(min(100, n - i))))
    return out


async def test_a_flood_beyond_the_per_address_limit_is_refused_while_others_are_served(
    clock: VirtualClock, stopper: list, caplog: pytest.LogCaptureFixture
) -> None:
    srv = await _server(ConnectionLimits(max_connections=1000, max_connections_per_ip=50), clock)
    stopper.append(srv)
    with caplog.at_level(logging.WARNING, logger="chronomq.remoting"):
        flood = await _flood(srv, 600)
        await async_wait_for(lambda: srv.refused == 550, message="550 refused")
    assert len(srv.connections()) == 50
    # one line for the lot (the clock has not moved 10 s), naming the limit
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "serverMaxConnectionsPerIp=50" in lines[0], lines
    # another address still gets in while the flood holds its slots (all of 127/8 is loopback)
    reader, writer = await _open(srv, "127.0.0.2")
    assert await _echo(reader, writer, "during") == "during"
    # the flooder's next connection is refused; once the flood is gone, it gets in again
    r2, _w2 = await _open(srv)
    assert await _closed_by_server(r2)
    for _r, w in flood:
        w.close()
    await async_wait_for(lambda: len(srv.connections()) == 1, message="flood gone")
    r3, w3 = await _open(srv)
    assert await _echo(r3, w3, "after") == "after"


async def test_a_flood_beyond_the_server_limit_is_refused(clock: VirtualClock, stopper: list) -> None:
    srv = await _server(ConnectionLimits(max_connections=80, max_connections_per_ip=50), clock)
    stopper.append(srv)
    flood = await _flood(srv, 100, "127.0.0.1") + await _flood(srv, 100, "127.0.0.3")
    await async_wait_for(lambda: srv.refused == 120, message="120 refused")
    assert len(srv.connections()) == 80
    reader, _writer = await _open(srv, "127.0.0.2")
    assert await _closed_by_server(reader)
    assert srv._per_ip == {"127.0.0.1": 50, "127.0.0.3": 30} and len(flood) == 200


async def test_refusals_are_logged_once_then_summed_every_ten_seconds(
    clock: VirtualClock, stopper: list, caplog: pytest.LogCaptureFixture
) -> None:
    srv = await _server(ConnectionLimits(max_connections_per_ip=5), clock)
    stopper.append(srv)
    with caplog.at_level(logging.WARNING, logger="chronomq.remoting"):
        flood = await _flood(srv, 30)
        await async_wait_for(lambda: srv.refused == 25, message="25 refused")
        await clock.advance(10_000)  # no refusal since: the sweep still reports the 24 not logged yet
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "refused 1 connection" in lines[0] and "refused 24 connection(s) in 10 s" in lines[1]
    assert len(flood) == 30

# --- frames too large, and too many unfinished bytes ----------------------------------------------------
def test_the_decoder_holds_what_arrived_not_what_was_announced() -> None:
    dec = FrameDecoder(1 << 30)
    dec.feed(struct.pack(">i", (1 << 30) - 1) + b"x" * 100)
    assert dec.buffered == 104 and sys.getsizeof(dec._buf) < 4096


async def test_an_oversized_frame_is_refused_without_buffering_it(stopper: list) -> None:
    srv = await _server(ConnectionLimits(frame_max_length=1 << 20))
    stopper.append(srv)
    other = await AsyncRawClient.connect(srv.address)
    tracemalloc.start()
    try:
        reader, writer = await _open(srv)
        writer.write(struct.pack(">i", (1 << 20) + 1))
        try:
            for _ in range(64):  # the announced frame's bytes keep coming: 4 MiB of them
                writer.write(b"\0" * 65536)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        assert await _closed_by_server(reader)
        _size, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # less than the frame limit, a quarter of what was sent
    assert srv._buffered_total == 0
    assert (await other.request(ECHO, {"v": "up"})).ext_fields["echo"] == "up"
    await other.close()


async def test_unfinished_frames_beyond_the_budget_close_the_largest_holder(stopper: list) -> None:
    srv = await _server(ConnectionLimits(frame_max_length=4 << 20, max_buffered_frame_bytes=1 << 20))
    stopper.append(srv)
    big_r, big_w = await _open(srv)
    big_w.write(struct.pack(">i", 3 << 20) + b"\0" * (900 << 10))  # 900 KiB of a 3 MiB frame
    await async_wait_for(lambda: srv._buffered_total >= 900 << 10, message="900 KiB buffered")
    small_r, small_w = await _open(srv)
    frame = encode(RemotingCommand(code=ECHO, opaque=9, ext_fields={"v": "x" * 200}, body=b"b" * (300 << 10)))
    small_w.write(frame[: 300 << 10])  # 300 KiB more: over the 1 MiB budget
    assert await _closed_by_server(big_r)
    assert srv.closed_shed == 1 and len(srv.connections()) == 1
    small_w.write(frame[300 << 10 :])
    dec = FrameDecoder()
    got: list = []
    while not got:
        got = dec.feed(await asyncio.wait_for(small_r.read(1 << 16), 10))
    assert got[0].ext_fields["echo"] == "x" * 200
    assert srv._buffered_total == 0


# --- a peer that does not read ----------------------------------------------------------------------------
async def test_a_peer_that_does_not_read_cannot_pile_up_inline_answers(clock: VirtualClock, stopper: list
                                                                       ) -> None:
    srv = await _server(ConnectionLimits(max_idle=5, frame_read_timeout=0), clock)
    stopper.append(srv)
    sock = socket.create_connection((srv.host, srv.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    # 2,000 small requests, one packet's worth, each answered inline with 64 KiB: 125 MiB of answers
    req = b"".join(encode(RemotingCommand(code=BIG, opaque=i)) for i in range(2000))
    sock.sendall(req)
    await async_wait_for(lambda: srv.connections() and srv.connections()[0]._paused, message="paused")
    conn = srv.connections()[0]
    assert conn.transport is not None
    for _ in range(5):  # the answers wait with the requests, not in the write buffer
        await asyncio.sleep(0.05)
        assert conn.transport.get_write_buffer_size() < 1 << 20, conn.transport.get_write_buffer_size()
    assert conn._backlog
    # reading again brings every answer
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    dec = FrameDecoder(1 << 20)
    got = 0
    while got < 2000:
        got += len(dec.feed(await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10)))
    assert not conn._backlog and not conn.closed
    # and a peer that stops reading for good is let go once nothing moves for max_idle
    sock.sendall(req)
    await async_wait_for(lambda: conn._paused, message="paused again")
    await clock.advance(6_000)
    await async_wait_for(lambda: conn.closed, message="closed")
    assert conn.transport.get_write_buffer_size() < 1 << 20
    sock.close()


# --- the broker, limits from its configuration ------------------------------------------------------------
async def test_a_broker_keeps_a_held_pull_longer_than_its_idle_limit(tmp_path: Path) -> None:
    from chronomq.broker.controller import BrokerController
    from chronomq.namesrv.routeinfo import RouteInfoManager

    config, _ = BrokerConfig.load(None, {
        "storePathRootDir": str(tmp_path), "listenPort": str(free_port()), "metricsPort": "-1",
        "serverChannelMaxIdleTimeSeconds": "1", "serverMaxConnectionsPerIp": "64"})
    broker = BrokerController(config, SystemClock(), local_register=RouteInfoManager().register_broker)
    await broker.start()
    try:
        lim = broker.server.limits
        assert (lim.max_idle, lim.max_connections_per_ip, lim.frame_read_timeout) == (1, 64, 30.0)
        c = await AsyncRawClient.connect(broker.server.address)
        assert (await c.send_message("HeldT", b"one")).code == ResponseCode.SUCCESS
        # dispatched (a pull before it would be told its offset moved, as RocketMQ's would)
        await async_wait_for(lambda: broker.store.get_max_offset_in_queue("HeldT", 0) == 1,
                             message="dispatch")
        # a long poll at the queue's end, held 2.5 s: more than the 1 s idle limit, and not cut
        pull = pull_ext("G", "HeldT", 0, 1, suspend_ms=2500)
        resp = await c.request(RequestCode.PULL_MESSAGE, pull, timeout=20)
        assert resp.code == ResponseCode.PULL_NOT_FOUND and not c.closed.is_set()
        # then silent: closed once idle
        await asyncio.wait_for(c.closed.wait(), 15)
        assert broker.server.closed_overdue == 1
        await c.close()
    finally:
        await broker.shutdown()

