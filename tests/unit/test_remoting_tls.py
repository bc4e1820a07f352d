"""TLS on the remoting ports (docs/tls.md): the sans-IO TLS layer driven by a client ``SSLObject`` in
memory; a real RemotingServer on a free loopback port in each mode, with our client over TLS and in
plaintext, raw sockets that go away mid-handshake or send junk after 0x16, mutual TLS, and certificate
files replaced while the server runs; the settings shared with the gRPC endpoint."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.conftest import async_wait_for

from chronomq.config import BrokerConfig
from chronomq.remoting import selfsigned
from chronomq.remoting.client import RemotingClient, RemotingConnectError
from chronomq.remoting.codec import FrameDecoder, RemotingCommand, encode
from chronomq.remoting.server import Connection, RemotingServer, UnsupportedCode
from chronomq.remoting.tls import (
    DISABLED,
    ENFORCING,
    PERMISSIVE,
    ServerTls,
    TlsOption,
    TlsSession,
    TlsSettings,
    client_context,
    load,
)

pytestmark = pytest.mark.timeout(60)

ECHO = 1000


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A server pair, a second server pair, and two client pairs (self-signed, each its own root)."""
    d = tmp_path_factory.mktemp("pki")
    out = {}
    for name, client in (("server", False), ("server2", False), ("client", True), ("stranger", True)):
        cert, key = selfsigned.generate(f"chronomq {name}", ["localhost", "127.0.0.1"], client=client)
        (d / f"{name}.crt").write_bytes(cert)
        (d / f"{name}.key").write_bytes(key)
        out[name] = d / f"{name}.crt"
        out[name + "_key"] = d / f"{name}.key"
    return out


def _settings(pki: dict[str, Path], mode: str, trust: Path | None = None) -> TlsSettings:
    if mode == DISABLED:
        return TlsSettings(mode)
    return TlsSettings(mode, cert_path=pki["server"], key_path=pki["server_key"], trust_path=trust)


# --- the sans-IO layer -------------------------------------------------------------------------------------
class _Peer:
    """A TLS client in memory facing a TlsSession."""

    def __init__(self, session: TlsSession, ctx: ssl.SSLContext | None = None) -> None:
        self.session = session
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = (ctx or client_context(True)).wrap_bio(self.incoming, self.outgoing)  # type: ignore[union-attr]
        self.plain = bytearray()  # what the server's layer gave back as plaintext

    def pump(self, chunk: int = 1 << 20) -> None:
        """Move bytes both ways until neither side has any to send; the client's to the server in pieces
        of ``chunk`` bytes."""
        for _ in range(100):
            moved = False
            data = self.outgoing.read()
            for i in range(0, len(data), chunk):
                self.plain += self.session.receive(data[i:i + chunk])
                moved = True
            back = self.session.take()
            if back:
                self.incoming.write(back)
                moved = True
            if not moved:
                return

    def handshake(self) -> None:
        for _ in range(10):
            try:
                self.obj.do_handshake()
                self.pump()
                return
            except ssl.SSLWantReadError:
                self.pump()
        raise AssertionError("the handshake did not finish")

    def read_all(self) -> bytes:
        out = bytearray()
        while True:
            try:
                chunk = self.obj.read(1 << 20)
            except ssl.SSLWantReadError:
                return bytes(out)
            if not chunk:
                return bytes(out)
            out += chunk


@pytest.fixture
def session(pki: dict[str, Path]) -> TlsSession:
    return TlsSession(ServerTls(_settings(pki, PERMISSIVE)).context())


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_the_handshake_completes_and_the_server_shows_its_certificate(
        session: TlsSession, pki: dict[str, Path], version: ssl.TLSVersion) -> None:
    # as RocketMQ's Java client connects (Netty, JDK provider): TLS 1.3 or 1.2, no SNI, no ALPN
    ctx = client_context(True)
    assert ctx is not None
    ctx.maximum_version = version
    peer = _Peer(session, ctx)
    assert not session.handshaken
    peer.handshake()
    assert session.handshaken
    assert peer.obj.version() == ("TLSv1.2" if version == ssl.TLSVersion.TLSv1_2 else "TLSv1.3")
    assert session.ssl_object.selected_alpn_protocol() is None
    der = peer.obj.getpeercert(binary_form=True)
    assert der == ssl.PEM_cert_to_DER_cert(pki["server"].read_text())


def test_a_large_frame_split_across_records_and_reads_decodes_whole(session: TlsSession) -> None:
    peer = _Peer(session)
    peer.handshake()
    body = os.urandom(200_000)  # > 12 TLS records of 16 KiB
    frame = encode(RemotingCommand.request(ECHO, {"v": "big"}, body))
    peer.obj.write(frame)
    peer.pump(chunk=1000)  # the records reach the server 1000 bytes at a time
    assert bytes(peer.plain) == frame
    items = FrameDecoder().feed(bytes(peer.plain))
    assert len(items) == 1 and isinstance(items[0], RemotingCommand) and items[0].body == body


def test_many_frames_in_one_record_come_out_together(session: TlsSession) -> None:
    peer = _Peer(session)
    peer.handshake()
    frames = [encode(RemotingCommand.request(ECHO, {"v": str(i)})) for i in range(50)]
    joined = b"".join(frames)
    assert len(joined) < 16 * 1024  # one record
    peer.obj.write(joined)
    records = peer.outgoing.read()
    assert session.receive(records) == joined
    cmds = FrameDecoder().feed(joined)
    assert [c.ext_str("v") for c in cmds if isinstance(c, RemotingCommand)] == [str(i) for i in range(50)]


def test_what_the_server_sends_the_client_reads_and_close_notify_ends_it(session: TlsSession) -> None:
    peer = _Peer(session)
    peer.handshake()
    peer.read_all()  # TLS 1.3 session tickets
    frame = encode(RemotingCommand(code=0, opaque=7, flag=1, body=b"x" * 70_000))
    peer.incoming.write(session.send(frame))
    assert peer.read_all() == frame
    assert not session.eof
    with pytest.raises(ssl.SSLWantReadError):
        peer.obj.unwrap()  # sends close_notify, waits for the server's
    session.receive(peer.outgoing.read())
    assert session.eof
    peer.incoming.write(session.close_notify())
    peer.obj.unwrap()  # the server's close_notify arrived: done both ways


def test_a_partial_hello_waits_and_junk_after_0x16_fails(pki: dict[str, Path]) -> None:
    tls = ServerTls(_settings(pki, PERMISSIVE))
    waiting = TlsSession(tls.context())
    peer = _Peer(waiting)
    with pytest.raises(ssl.SSLWantReadError):
        peer.obj.do_handshake()
    hello = peer.outgoing.read()
    assert hello[0] == 0x16
    assert waiting.receive(hello[:20]) == b"" and not waiting.handshaken  # more to come
    junk = TlsSession(tls.context())
    with pytest.raises(ssl.SSLError):
        junk.receive(b"\x16" + b"not a handshake at all, just bytes" * 3)


# --- a real server ----------------------------------------------------------------------------------------
class App:
    def handle_sync(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        if req.code == ECHO:
            peer = conn.transport.get_extra_info("peercert") if conn.transport is not None else None
            subject = dict(x[0] for x in peer["subject"])["commonName"] if peer else ""
            return req.response(ext_fields={"echo": req.ext_str("v", ""), "client": subject},
                                body=req.body)
        return None

    async def handle(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        raise UnsupportedCode(req.code)


async def _start(tls: ServerTls | None) -> RemotingServer:
    app = App()
    srv = RemotingServer(app.handle, "127.0.0.1", 0, name="test", sync_handler=app.handle_sync, tls=tls)
    await srv.start()
    return srv


@pytest.fixture
async def servers(pki: dict[str, Path]) -> AsyncIterator[dict[str, RemotingServer]]:
    out = {mode: await _start(ServerTls(_settings(pki, mode))) for mode in (DISABLED, PERMISSIVE, ENFORCING)}
    out["none"] = await _start(None)
    try:
        yield out
    finally:
        for s in out.values():
            await s.stop()


async def _echo(srv: RemotingServer, tls: TlsOption, body: bytes = b"") -> RemotingCommand:
    client = RemotingClient(ssl_context=client_context(tls), connect_timeout=5.0)
    try:
        return await client.invoke(srv.address, RemotingCommand.request(ECHO, {"v": "hi"}, body), timeout=5.0)
    finally:
        await client.close()


@pytest.mark.parametrize(("mode", "tls", "served"), [
    (PERMISSIVE, True, True), (PERMISSIVE, False, True),
    (ENFORCING, True, True), (ENFORCING, False, False),
    (DISABLED, True, False), (DISABLED, False, True),
    ("none", False, True), ("none", True, False),
])
async def test_each_mode_serves_or_refuses_each_kind_of_client(
        servers: dict[str, RemotingServer], mode: str, tls: bool, served: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    srv = servers[mode]
    caplog.set_level(logging.DEBUG, logger="chronomq.remoting")
    if served:
        body = os.urandom(300_000)  # both ways, many records each
        resp = await _echo(srv, tls, body)
        assert resp.ext_str("echo") == "hi" and resp.body == body
        assert srv.tls_connections == (1 if tls else 0)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        return
    with pytest.raises(RemotingConnectError):
        await _echo(srv, tls)
    if mode == "none":  # no TLS settings: 0x16... is read as a frame length, as before
        return
    await async_wait_for(lambda: srv.refused_by_tls_mode == 1, message="the refusal counted")
    what = "TLS refused" if tls else "plaintext refused"
    lines = [r for r in caplog.records if what in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and not lines[0].exc_info
    assert srv.tls_failures == 0 and srv.connections() == []


async def test_after_the_first_read_a_plaintext_connection_takes_the_plaintext_path(
        servers: dict[str, RemotingServer]) -> None:
    # the first-byte check is the connection's reader until the first read, which leaves None (plaintext)
    # or the TLS layer; data_received itself is never rebound (uvloop keeps the method it took first)
    for mode, tls in ((PERMISSIVE, False), ("none", False), (PERMISSIVE, True)):
        srv = servers[mode]
        client = RemotingClient(ssl_context=client_context(tls))
        try:
            await client.invoke(srv.address, RemotingCommand.request(ECHO, {"v": "x"}), timeout=5.0)
            [conn] = srv.connections()
            assert "data_received" not in conn.__dict__
            if tls:
                assert conn._reader is not None and conn._reader.__func__ is Connection._tls_received
            else:
                assert conn._reader is None
        finally:
            await client.close()


async def test_refusals_by_mode_are_logged_like_the_limits_refusals(
        servers: dict[str, RemotingServer], caplog: pytest.LogCaptureFixture) -> None:
    srv = servers[ENFORCING]
    caplog.set_level(logging.INFO, logger="chronomq.remoting")
    for _ in range(5):
        with pytest.raises(RemotingConnectError):
            await _echo(srv, False)
    await async_wait_for(lambda: srv.refused_by_tls_mode == 5, message="five refusals")
    assert len([r for r in caplog.records if "plaintext refused" in r.getMessage()]) == 1  # at most 1 / 10 s
    resp = await _echo(srv, True)  # TLS still served
    assert resp.ext_str("echo") == "hi"


def _client_hello() -> bytes:
    obj = client_context(True).wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO())  # type: ignore[union-attr]
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


async def _raw(srv: RemotingServer, data: bytes, close: bool) -> bytes:
    """Send ``data`` on a raw socket; close at once (``close``) or read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    writer.write(data)
    await writer.drain()
    got = b""
    if not close:
        got = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return got


async def test_a_client_gone_mid_handshake_and_junk_after_0x16_close_quietly(
        servers: dict[str, RemotingServer], caplog: pytest.LogCaptureFixture) -> None:
    srv = servers[PERMISSIVE]
    caplog.set_level(logging.DEBUG, logger="chronomq.remoting")
    await _raw(srv, _client_hello()[:30], close=True)
    await async_wait_for(lambda: any("during the TLS handshake" in r.getMessage() for r in caplog.records),
                         message="the mid-handshake close logged")
    await async_wait_for(lambda: srv.connections() == [], message="the half-open connection released")
    answer = await _raw(srv, b"\x16\x03\x01\x00\x10" + b"junk" * 40, close=False)  # then EOF from the server
    assert answer == b"" or answer[0] == 0x15  # nothing, or a TLS alert record
    await async_wait_for(lambda: srv.tls_failures == 1, message="the broken handshake counted")
    failed = [r for r in caplog.records if "TLS handshake with" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert srv.connections() == []
    assert (await _echo(srv, True)).ext_str("echo") == "hi"  # and it goes on serving


# --- mutual TLS -------------------------------------------------------------------------------------------
def _with_cert(pki: dict[str, Path], name: str) -> ssl.SSLContext:
    ctx = client_context(True)
    assert ctx is not None
    ctx.load_cert_chain(pki[name], pki[name + "_key"])
    return ctx


async def test_mutual_tls_admits_a_trusted_client_certificate_only(
        pki: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="chronomq.remoting")
    srv = await _start(ServerTls(_settings(pki, ENFORCING, trust=pki["client"])))
    try:
        resp = await _echo(srv, _with_cert(pki, "client"))
        assert resp.ext_str("echo") == "hi" and resp.ext_str("client") == "chronomq client"
        for tls in (True, _with_cert(pki, "stranger")):  # no certificate; one the trust file does not hold
            with pytest.raises(RemotingConnectError):
                await _echo(srv, tls)
        await async_wait_for(lambda: srv.tls_failures == 2, message="two refused client certificates")
        reasons = [r.getMessage() for r in caplog.records if "TLS handshake with" in r.getMessage()]
        assert len(reasons) == 2 and "certificate" in reasons[0] and "certificate" in reasons[1]
    finally:
        await srv.stop()


# --- certificate files replaced while serving -------------------------------------------------------------
async def _served_cert(srv: RemotingServer) -> bytes:
    _, writer = await asyncio.open_connection("127.0.0.1", srv.port, ssl=client_context(True))
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return bytes(der)


def _der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def _replace(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.write_bytes(src.read_bytes())
    os.replace(tmp, dst)


async def test_replaced_certificate_files_are_served_to_the_next_tls_connection(
        pki: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _replace(pki["server"], cert)
    _replace(pki["server_key"], key)
    tls = ServerTls(TlsSettings(PERMISSIVE, cert_path=cert, key_path=key))
    srv = await _start(tls)
    caplog.set_level(logging.INFO, logger="chronomq.remoting")
    try:
        assert await _served_cert(srv) == _der(pki["server"])
        _replace(pki["server2"], cert)  # the certificate renewed, its key not yet: unusable together
        assert await _served_cert(srv) == _der(pki["server"])
        assert any("cannot be used" in r.getMessage() for r in caplog.records) and tls.reloads == 0
        _replace(pki["server2_key"], key)
        assert await _served_cert(srv) == _der(pki["server2"])
        assert tls.reloads == 1
        assert await _served_cert(srv) == _der(pki["server2"])  # no change, no reload
        assert tls.reloads == 1
    finally:
        await srv.stop()


# --- the settings ----------------------------------------------------------------------------------------
def _config(tmp_path: Path, **keys: str) -> BrokerConfig:
    cfg, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp_path / "data"), **keys})
    return cfg


def test_the_self_signed_certificate_is_one_file_for_both_ports_and_made_at_first_use(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    from chronomq.grpc import tls as grpc_tls

    cfg = _config(tmp_path)
    remoting = ServerTls.from_config(cfg, "broker")
    assert not (tmp_path / "data" / "tls").exists()  # no TLS client yet: nothing made
    remoting.context()
    grpc_settings = grpc_tls.load(cfg)
    made = tmp_path / "data" / "tls" / "selfsigned.crt"
    assert remoting.settings.cert_path == grpc_settings.cert_path == made
    assert remoting.settings.cert_pem == grpc_settings.cert_pem and grpc_settings.self_signed
    assert grpc_settings.server_credentials() is not None
    namesrv = ServerTls.from_config(cfg, "namesrv")
    namesrv.context()
    assert namesrv.settings.cert_pem == remoting.settings.cert_pem  # reused, not made again


def test_configured_files_are_checked_at_once_and_disabled_reads_nothing(
        tmp_path: Path, pki: dict[str, Path]) -> None:
    with pytest.raises(OSError, match="cannot be used together"):
        ServerTls.from_config(_config(tmp_path, tlsCertPath=str(pki["server"]),
                                      tlsKeyPath=str(pki["server2_key"])))
    with pytest.raises(OSError, match="cannot read the certificate"):
        ServerTls.from_config(_config(tmp_path, tlsCertPath=str(tmp_path / "none.crt"),
                                      tlsKeyPath=str(pki["server_key"])))
    ok = ServerTls.from_config(_config(tmp_path, tlsCertPath=str(pki["server"]),
                                       tlsKeyPath=str(pki["server_key"]), tlsServerMode="enforcing",
                                       tlsServerNeedClientAuth="require",
                                       tlsServerTrustCertPath=str(pki["client"])))
    assert ok.context().verify_mode == ssl.CERT_REQUIRED and not ok.serves_plaintext
    off = ServerTls.from_config(_config(tmp_path, tlsServerMode="disabled"))
    assert not off.serves_tls and off.serves_plaintext and load(_config(tmp_path, tlsServerMode="disabled")
                                                              ).cert_pem is None


def test_client_context_options(pki: dict[str, Path], tmp_path: Path) -> None:
    assert client_context(None) is None and client_context(False) is None
    insecure = client_context(True)
    assert insecure is not None and insecure.verify_mode == ssl.CERT_NONE and not insecure.check_hostname
    verifying = client_context(str(pki["server"]))
    assert verifying is not None and verifying.verify_mode == ssl.CERT_REQUIRED
    own = ssl.create_default_context()
    assert client_context(own) is own
    with pytest.raises(ValueError, match="cannot use"):
        client_context(tmp_path / "missing.pem")


async def test_a_verifying_client_accepts_the_trusted_server_and_refuses_another(
        servers: dict[str, RemotingServer], pki: dict[str, Path]) -> None:
    srv = servers[ENFORCING]
    assert (await _echo(srv, str(pki["server"]))).ext_str("echo") == "hi"
    with pytest.raises(RemotingConnectError, match="TLS handshake"):
        await _echo(srv, str(pki["server2"]))


