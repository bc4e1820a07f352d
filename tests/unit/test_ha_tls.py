"""The HA link over TLS, in process (docs/tls.md, docs/ha.md): the master's HA port follows its
tlsServerMode as the remoting port does (TLS and plaintext by the first byte), and a slave with tlsEnable
links to it, and reads its metadata, over TLS. A slave the mode refuses is closed and logged once on both
sides, however often it retries; the link's sans-IO TLS layer carries several segments' worth of log and
gives up on junk or a client gone mid-handshake with one line, no traceback."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import async_wait_for, free_port
from tests.integration.rawclient import send_ext

from chronomq.broker.controller import BrokerController
from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.namesrv import RouteInfoManager
from chronomq.remoting.client import RemotingClient
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode
from chronomq.remoting.codes import ResponseCode as C
from chronomq.remoting.tls import StreamAcceptor, TlsStreamWriter, client_context

pytestmark = pytest.mark.timeout(60)


def broker(tmp_path: Path, routes: RouteInfoManager, name: str, **over: str) -> BrokerController:
    values = {"storePathRootDir": str(tmp_path / name), "listenPort": str(free_port()),
              "haListenPort": str(free_port()), "messageDelayLevel": "1s 5s", "metricsPort": "-1",
              "mappedFileSizeCommitLog": str(64 * 1024)}
    values.update(over)
    config, _ = BrokerConfig.load(None, values)
    return BrokerController(config, VirtualClock(), local_register=routes.register_broker)


def acceptor(b: BrokerController) -> StreamAcceptor:
    assert b.ha is not None and isinstance(b.ha.accept, StreamAcceptor)
    return b.ha.accept


def messages(caplog: pytest.LogCaptureFixture, text: str, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage() and r.levelno >= level]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """A master in enforcing mode (HA port and remoting port alike), its slaves stopped at the end."""
    routes = RouteInfoManager()
    master = broker(tmp_path, routes, "m", tlsServerMode="enforcing")
    await master.start()
    made: list[BrokerController] = []
    try:
        yield {"routes": routes, "master": master, "slaves": made}
    finally:
        for s in made:
            await s.shutdown()
        await master.shutdown()


async def _send(master: BrokerController, count: int, tls: bool = True) -> None:
    """``count`` messages of 3 KB to the master's remoting port, over TLS unless ``tls`` is False."""
    client = RemotingClient(ssl_context=client_context(tls))
    try:
        for i in range(count):
            req = RemotingCommand.request(RequestCode.SEND_MESSAGE, send_ext("HATls", i % 2),
                                          f"{i:05d}".encode() * 600)
            r = await client.invoke(master.server.address, req)
            assert r.code == C.SUCCESS, r.remark
    finally:
        await client.close()


@pytest.mark.parametrize("mode", ["enforcing", "permissive"])
async def test_a_tls_slave_replicates_and_reads_the_masters_metadata_over_tls(
        tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    routes = RouteInfoManager()
    master = broker(tmp_path, routes, "m", tlsServerMode=mode)
    await master.start()
    slave = None
    try:
        await _send(master, 40)  # several 64 KiB segments before the slave comes
        slave = broker(tmp_path, routes, "s", brokerRole="SLAVE", brokerId="1", tlsEnable="true")
        await slave.start()
        await async_wait_for(lambda: slave.store.max_phy_offset == master.store.max_phy_offset, 15,
                             message="the slave holds the master's log")
        await _send(master, 20)  # and what comes while it is linked
        await async_wait_for(lambda: slave.store.max_phy_offset == master.store.max_phy_offset, 15,
                             message="the slave holds the new messages too")
        acc = acceptor(master)
        assert acc.tls_connections == 1 and acc.tls_failures == acc.refused_by_tls_mode == 0
        assert master.ha is not None and len(master.ha.links) == 1
        assert messages(caplog, "over TLS at offset", logging.INFO)  # the slave says how it linked
        # the slave's metadata reads go to the master's remoting port over TLS too
        assert slave.slave_sync is not None
        result = await slave.slave_sync.sync_all()
        assert result.errors == {} and "HATls" in slave.topics.snapshot()
        assert master.server.tls_failures == 0
    finally:
        if slave is not None:
            await slave.shutdown()
        await master.shutdown()


async def test_a_plaintext_slave_is_refused_by_an_enforcing_master_and_both_log_it_once(
        cluster: dict[str, Any], caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    caplog.set_level(logging.DEBUG)
    master = cluster["master"]
    await _send(master, 3)
    slave = broker(tmp_path, cluster["routes"], "s", brokerRole="SLAVE", brokerId="1")
    cluster["slaves"].append(slave)
    await slave.start()
    acc = acceptor(master)
    # the slave retries every second: three refusals, one line each side (the clocks do not move)
    await async_wait_for(lambda: acc.refused_by_tls_mode >= 3, 15, message="three refused links")
    assert slave.store.max_phy_offset == 0 and master.ha is not None and not master.ha.links
    refused = messages(caplog, "plaintext refused")
    assert len(refused) == 1
    assert refused[0].startswith("HA: refused 1 connection(s), the last from 127.0.0.1:")
    ended = messages(caplog, "HA: link to master")
    assert len(ended) == 1 and "set tlsEnable=true on this slave" in ended[0], ended
    assert not [r for r in caplog.records if r.exc_info]  # no traceback anywhere
    assert slave.slave_sync is not None
    result = await slave.slave_sync.sync_all()  # its metadata reads are refused as well
    assert set(result.errors) == {"topics", "consumer offsets", "delay offsets"}


async def test_a_tls_slave_is_refused_by_a_master_whose_tls_is_disabled(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    routes = RouteInfoManager()
    master = broker(tmp_path, routes, "m", tlsServerMode="disabled")
    await master.start()
    slave = broker(tmp_path, routes, "s", brokerRole="SLAVE", brokerId="1", tlsEnable="true")
    try:
        await _send(master, 1, tls=False)
        await slave.start()
        acc = acceptor(master)
        await async_wait_for(lambda: acc.refused_by_tls_mode >= 2, 15, message="two refused links")
        assert slave.store.max_phy_offset == 0
        assert len(messages(caplog, "TLS refused: tlsServerMode is disabled")) == 1
        ended = messages(caplog, "HA: link to master")
        assert len(ended) == 1 and "tlsServerMode is disabled refuses TLS" in ended[0], ended
        assert not (Path(master.config.storePathRootDir) / "tls").exists()  # no certificate made for it
    finally:
        await slave.shutdown()
        await master.shutdown()


# --- the acceptor alone, on a stream server ----------------------------------------------------------------
def _client_hello() -> bytes:
    obj = client_context(True).wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO())  # type: ignore[union-attr]
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


@pytest.fixture
async def echo(tmp_path: Path) -> AsyncIterator[tuple[StreamAcceptor, int]]:
    """A stream server that echoes, in upper case, what each accepted connection sends (head included)."""
    from chronomq.remoting.tls import ServerTls

    config, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp_path / "d")})
    acc = StreamAcceptor(ServerTls.from_config(config, "echo"), "echo", VirtualClock())

    async def serve(reader: asyncio.StreamReader, raw: asyncio.StreamWriter) -> None:
        accepted = await acc(reader, raw)
        if accepted is None:
            return
        r, w, head = accepted
        data = head
        try:
            while True:
                if data:
                    w.write(data.upper())
                    await w.drain()
                data = await r.read(65536)
                if not data:
                    break
        except ConnectionError:
            pass
        finally:
            w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield acc, server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_the_acceptor_carries_large_writes_both_ways_in_tls_and_plaintext(
        echo: tuple[StreamAcceptor, int]) -> None:
    acc, port = echo
    payload = bytes(range(97, 123)) * 20_000  # 520 KB, many records
    for tls in (client_context(True), None):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
        writer.write(payload)
        await writer.drain()
        got = await asyncio.wait_for(reader.readexactly(len(payload)), 20)
        assert got == payload.upper()
        if tls is not None:
            assert writer.get_extra_info("ssl_object").version() in ("TLSv1.3", "TLSv1.2")
        writer.close()
    assert acc.tls_connections == 1 and acc.tls_failures == 0


async def test_junk_after_0x16_and_a_client_gone_mid_handshake_end_with_one_line(
        echo: tuple[StreamAcceptor, int], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="chronomq.remoting")
    acc, port = echo
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"\x16" + b"junk" * 100)
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
    writer.close()
    await async_wait_for(lambda: acc.tls_failures == 1, message="the junk counted as a failed handshake")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_client_hello())
    await writer.drain()
    await asyncio.wait_for(reader.read(1), 10)  # the server's hello arrived: the handshake is under way
    writer.close()
    await async_wait_for(lambda: messages(caplog, "closed during the TLS handshake", logging.DEBUG),
                         message="the client gone mid-handshake logged")
    lines = [r for r in caplog.records if r.name == "chronomq.remoting"]
    assert len(messages(caplog, "TLS handshake with", logging.INFO)) == 1
    assert not [r for r in lines if r.exc_info] and acc.tls_connections == 0


def test_the_tls_writer_reports_a_failed_layer_as_a_closed_connection() -> None:
    class Session:
        def send(self, data: bytes) -> bytes:
            raise ssl.SSLError(1, "bad record mac")

    class Transport:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    class Raw:
        transport = Transport()

    w = TlsStreamWriter(Raw(), Session())  # type: ignore[arg-type]
    with pytest.raises(ConnectionError, match="TLS stream failed"):
        w.write(b"x")
    assert Raw.transport.aborted
