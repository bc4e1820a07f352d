"""TLS on the 5.x gRPC endpoint: the self-signed certificate, the keys, and a broker in process whose
endpoint (on a free loopback port) is driven by the real grpcio client over TLS and plaintext in each
mode, by raw sockets that send junk or go away early, and with client certificates (mutual TLS)."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import shutil
import socket
import ssl
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio and protobuf (chronomq dependencies) are not installed")

from tests.conftest import async_wait_for, free_port  # noqa: E402

from chronomq.clock import SystemClock  # noqa: E402
from chronomq.config import BrokerConfig, ConfigError  # noqa: E402
from chronomq.grpc import convert, selfsigned, tls  # noqa: E402
from chronomq.grpc._proto import rocketmq_v2_pb2 as pb  # noqa: E402
from chronomq.grpc.front import PREFACE, Greeting, PortFront, classify, grpc_peer  # noqa: E402
from chronomq.namesrv import RouteInfoManager  # noqa: E402

SERVICE = "/apache.rocketmq.v2.MessagingService/"
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="the openssl command is not installed")


# --- the certificate and the keys ---------------------------------------------------------------------------
def test_the_self_signed_certificate_loads_verifies_and_is_kept_until_it_nears_its_end(
        tmp_path: Path) -> None:
    cert, key, made = selfsigned.ensure(tmp_path / "tls", "chronomq t", ["localhost", "127.0.0.1", "::1"])
    assert made and key.stat().st_mode & 0o777 == 0o600
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)  # the key matches the certificate
    client = ssl.create_default_context(cafile=str(cert))  # and it is its own root
    assert client.get_ca_certs()[0]["subject"] == ((("commonName", "chronomq t"),),)
    end = selfsigned.not_after(cert.read_bytes())
    assert dt.timedelta(days=3640) < end - dt.datetime.now(dt.UTC) < dt.timedelta(days=3660)
    first = cert.read_bytes()
    assert selfsigned.ensure(tmp_path / "tls", "chronomq t", ["localhost"])[2] is False
    assert cert.read_bytes() == first
    later = end - dt.timedelta(days=10)  # within 30 days of its end: made anew
    assert selfsigned.ensure(tmp_path / "tls", "chronomq t", ["localhost"], now=later)[2] is True
    assert cert.read_bytes() != first
    key.write_bytes(b"junk")
    assert selfsigned.ensure(tmp_path / "tls", "chronomq t", ["localhost"])[2] is True


def test_a_self_signed_pair_that_does_not_match_is_made_anew_at_start(tmp_path: Path) -> None:
    # a crash between the two renames: the new key beside the old certificate
    cert, key, _ = selfsigned.ensure(tmp_path / "tls", "chronomq b", ["localhost"])
    _, other_key, _ = selfsigned.ensure(tmp_path / "other", "chronomq b", ["localhost"])
    old_cert = cert.read_bytes()
    key.write_bytes(other_key.read_bytes())
    settings = tls.load(_tls_config(tmp_path))  # what the broker's start reads
    assert settings.self_signed and settings.cert_pem == cert.read_bytes() != old_cert
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)


@needs_openssl
def test_openssl_reads_the_self_signed_certificate_and_its_signature_verifies(tmp_path: Path) -> None:
    cert, key, _ = selfsigned.ensure(tmp_path, "chronomq", ["localhost", "127.0.0.1", "10.1.2.3"])
    ok = subprocess.run(["openssl", "verify", "-CAfile", str(cert), str(cert)], capture_output=True,
                        text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    text = subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-text"], capture_output=True,
                          text=True, timeout=30, check=True).stdout
    assert "DNS:localhost, IP Address:127.0.0.1, IP Address:10.1.2.3" in text and "prime256v1" in text
    subprocess.run(["openssl", "pkey", "-in", str(key), "-noout", "-check"], capture_output=True, timeout=30,
                   check=True)


def test_rocketmq_tls_key_names_are_read_and_bad_values_refused() -> None:
    cfg, warnings = BrokerConfig.load(None, {"tls.server.mode": "enforcing", "tls.server.certPath": "/c.pem",
                                             "tls.server.keyPath": "/k.pem", "tls.test.mode.enable": "false",
                                             "tls.server.need.client.auth": "require",
                                             "tls.server.trustCertPath": "/ca.pem"})
    assert warnings == []
    assert (cfg.tlsServerMode, cfg.tlsCertPath, cfg.tlsKeyPath, cfg.tlsTestModeEnable) == \
        ("enforcing", "/c.pem", "/k.pem", False)
    assert (cfg.tlsServerNeedClientAuth, cfg.tlsServerTrustCertPath) == ("require", "/ca.pem")
    assert BrokerConfig().tlsServerMode == "permissive" and BrokerConfig().tlsTestModeEnable
    for bad, match in [({"tls.server.mode": "strict"}, "tls.server.mode"),
                       ({"tlsServerNeedClientAuth": "optional"}, "optional"),
                       ({"tlsServerNeedClientAuth": "require"}, "tlsServerTrustCertPath"),
                       ({"tlsServerNeedClientAuth": "require", "tlsServerTrustCertPath": "/ca.pem"},
                        "needs tlsServerMode=enforcing"),
                       ({"tlsServerNeedClientAuth": "require", "tlsServerTrustCertPath": "/ca.pem",
                         "tlsServerMode": "disabled"}, "needs tlsServerMode=enforcing"),
                       ({"tlsCertPath": "/c.pem"}, "both or neither"),
                       ({"tlsTestModeEnable": "false"}, "self-signed")]:
        with pytest.raises(ConfigError, match=match):
            BrokerConfig.load(None, bad)
    BrokerConfig.load(None, {"tlsTestModeEnable": "false", "tlsServerMode": "disabled"})  # no TLS, no cert


def _tls_config(tmp_path: Path, **kw: str) -> Any:
    base = {"tlsServerMode": "permissive", "tlsCertPath": "", "tlsKeyPath": "", "brokerIP1": "127.0.0.1",
            "brokerName": "b", "storePathRootDir": str(tmp_path), "tlsServerNeedClientAuth": "none",
            "tlsServerTrustCertPath": ""}
    return SimpleNamespace(**{**base, **kw})


def test_unusable_certificate_files_are_clear_errors(tmp_path: Path) -> None:
    cert_a, key_a, _ = selfsigned.ensure(tmp_path / "a", "a", ["localhost"])
    _, key_b, _ = selfsigned.ensure(tmp_path / "b", "b", ["localhost"])
    with pytest.raises(OSError, match="cannot be used together"):
        tls.load(_tls_config(tmp_path, tlsCertPath=str(cert_a), tlsKeyPath=str(key_b)))
    with pytest.raises(OSError, match="cannot read the certificate"):
        tls.load(_tls_config(tmp_path, tlsCertPath=str(tmp_path / "none.pem"), tlsKeyPath=str(key_a)))
    encrypted = tmp_path / "enc.key"
    encrypted.write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n")
    with pytest.raises(OSError, match="encrypted"):
        tls.load(_tls_config(tmp_path, tlsCertPath=str(cert_a), tlsKeyPath=str(encrypted)))
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(OSError, match="no usable PEM certificate"):
        tls.load(_tls_config(tmp_path, tlsServerNeedClientAuth="require", tlsServerTrustCertPath=str(junk)))
    ok = tls.load(_tls_config(tmp_path, tlsCertPath=str(cert_a), tlsKeyPath=str(key_a)))
    assert ok.cert_pem == cert_a.read_bytes() and not ok.self_signed and ok.trust_pem is None
    assert tls.load(_tls_config(tmp_path, tlsServerMode="disabled")).cert_pem is None


def test_first_bytes_tell_tls_from_http2_from_junk() -> None:
    hello = b"\x16\x03\x01\x02\x00\x01"
    assert [classify(hello[:n]) for n in (0, 1, 2, 3)] == [None, None, None, "tls"]
    assert [classify(PREFACE[:n]) for n in (1, 10, 23)] == [None, None, None]
    assert classify(PREFACE) == classify(PREFACE + b"\x00\x00") == "plaintext"
    assert classify(b"GET / HTTP/1.1\r\n") == classify(b"\x16\x02\x00") == classify(b"PRX") == "junk"
    assert classify(hello) is Greeting.TLS and classify(PREFACE) is Greeting.PLAINTEXT
    assert classify(b"PRX") is Greeting.JUNK
    assert grpc_peer(("10.0.0.1", 5)) == "ipv4:10.0.0.1:5" and grpc_peer(("::1", 6, 0, 0)) == "ipv6:[::1]:6"


# --- the endpoint, in process -------------------------------------------------------------------------------
class Broker:
    def __init__(self, tmp_path: Path, **overrides: str) -> None:
        from chronomq.broker.controller import BrokerController

        values = {"storePathRootDir": str(tmp_path / "store"), "listenPort": str(free_port()),
                  "haListenPort": str(free_port()), "metricsPort": "-1", "grpcListenPort": "0", **overrides}
        self.config, _ = BrokerConfig.load(None, values)
        self.broker = BrokerController(self.config, SystemClock(),
                                       local_register=RouteInfoManager().register_broker)
        self.channels: list[Any] = []

    async def __aenter__(self) -> Broker:
        await self.broker.start()
        assert self.broker.grpc is not None, "the endpoint did not start"
        self.broker.topics.create_in_send("TT", None, 0)  # what _route asks for
        return self

    async def __aexit__(self, *exc: object) -> None:
        for ch in self.channels:
            await ch.close()
        await self.broker.shutdown()

    @property
    def front(self) -> Any:
        return self.broker.grpc.front

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.broker.grpc.port}"

    @property
    def cert(self) -> bytes:
        return (Path(self.config.storePathRootDir) / "tls" / "selfsigned.crt").read_bytes()

    def plaintext(self) -> Any:
        self.channels.append(grpc.aio.insecure_channel(self.target))
        return self.channels[-1]

    def tls(self, root: bytes | None = None, key: bytes | None = None, chain: bytes | None = None) -> Any:
        creds = grpc.ssl_channel_credentials(root_certificates=root or self.cert, private_key=key,
                                             certificate_chain=chain)
        self.channels.append(grpc.aio.secure_channel(self.target, creds))
        return self.channels[-1]


async def _route(channel: Any, topic: str = "TT", timeout: float = 10) -> pb.QueryRouteResponse:
    fn = channel.unary_unary(SERVICE + "QueryRoute",
                             request_serializer=pb.QueryRouteRequest.SerializeToString,
                             response_deserializer=pb.QueryRouteResponse.FromString)
    return await fn(pb.QueryRouteRequest(topic=pb.Resource(name=topic)), timeout=timeout)


async def _refused(channel: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _route(channel, timeout=5)
    return e.value.code()


async def test_permissive_serves_tls_and_plaintext_on_one_port_and_sees_the_clients_address(
        tmp_path: Path) -> None:
    async with Broker(tmp_path) as b:  # the default mode
        assert b.broker.grpc.tls.mode == "permissive" and b.broker.grpc.tls.self_signed
        assert (await _route(b.tls())).status.code == pb.OK
        assert (await _route(b.plaintext())).status.code == pb.OK
        assert (b.front.stats.tls, b.front.stats.plaintext) == (1, 1)
        # what the endpoint records about a client is the client's address, not the relay's
        hb = b.tls().unary_unary(SERVICE + "Heartbeat",
                                 request_serializer=pb.HeartbeatRequest.SerializeToString,
                                 response_deserializer=pb.HeartbeatResponse.FromString)
        r = await hb(pb.HeartbeatRequest(client_type=pb.PRODUCER), metadata=(("x-mq-client-id", "c1"),),
                     timeout=10)
        assert r.status.code == pb.OK
        clients = {grpc_peer(c.peer) for c in b.front._conns}
        assert b.broker.grpc.svc.clients["c1"].peer in clients
        internal = {f"ipv4:127.0.0.1:{c.internal_port}" for c in b.front._conns}
        assert not internal & clients


async def test_a_large_message_crosses_the_relay_both_ways_over_tls(tmp_path: Path) -> None:
    async with Broker(tmp_path) as b:
        ch = b.tls()
        body = bytes(range(256)) * (3 * 1024 * 4)  # 3 MiB: many records, the relay's write buffers fill
        m = pb.Message(topic=pb.Resource(name="TB"), body=body)
        m.system_properties.message_id = "01BIG"
        m.system_properties.body_encoding = pb.IDENTITY
        m.system_properties.message_type = pb.NORMAL
        send = ch.unary_unary(SERVICE + "SendMessage",
                              request_serializer=pb.SendMessageRequest.SerializeToString,
                              response_deserializer=pb.SendMessageResponse.FromString)
        assert (await send(pb.SendMessageRequest(messages=[m]), timeout=30)).status.code == pb.OK
        store = b.broker.store
        assert await asyncio.to_thread(store.wait_dispatched, store.max_phy_offset, 10)
        req = pb.ReceiveMessageRequest(group=pb.Resource(name="G"), batch_size=1,
                                       message_queue=pb.MessageQueue(topic=pb.Resource(name="TB"), id=-1),
                                       filter_expression=pb.FilterExpression(type=pb.TAG, expression="*"),
                                       invisible_duration=convert.duration(30_000),
                                       long_polling_timeout=convert.duration(5_000))
        recv = ch.unary_stream(SERVICE + "ReceiveMessage",
                               request_serializer=pb.ReceiveMessageRequest.SerializeToString,
                               response_deserializer=pb.ReceiveMessageResponse.FromString)
        got = [r.message.body async for r in recv(req, timeout=30) if r.WhichOneof("content") == "message"]
        assert got == [body]


async def test_enforcing_refuses_plaintext_and_disabled_refuses_tls_each_logged_once_at_debug(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="chronomq.grpc")
    async with Broker(tmp_path / "e", tlsServerMode="enforcing") as b:
        assert await _refused(b.plaintext()) == grpc.StatusCode.UNAVAILABLE
        assert (await _route(b.tls())).status.code == pb.OK
        assert b.front.stats.refused_mode >= 1 and b.front.plaintext_port is None
        refused = [r for r in caplog.records if "plaintext refused" in r.getMessage()]
        assert len(refused) == b.front.stats.refused_mode  # one line per connection
        assert all(r.levelno == logging.DEBUG and r.exc_info is None for r in refused)
    caplog.clear()
    async with Broker(tmp_path / "d", tlsServerMode="disabled") as b:
        any_root = selfsigned.ensure(tmp_path / "any", "x", ["127.0.0.1"])[0].read_bytes()  # none served
        assert await _refused(b.tls(root=any_root)) == grpc.StatusCode.UNAVAILABLE
        assert (await _route(b.plaintext())).status.code == pb.OK
        assert b.front.stats.refused_mode >= 1 and b.front.tls_port is None
        assert not (Path(b.config.storePathRootDir) / "tls").exists()  # no certificate made for nothing
        refused = [r for r in caplog.records if "TLS refused" in r.getMessage()]
        assert len(refused) == b.front.stats.refused_mode
        assert all(r.levelno == logging.DEBUG and r.exc_info is None for r in refused)


def _raw(port: int, send: bytes = b"", shut: bool = False, close_now: bool = False) -> bytes:
    """Connect, send ``send``, optionally half-close or close at once; what the server sent until it closed
    (or reset) the connection. The socket times out after 10 s: a server that never closes fails the test,
    it does not hang it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        if send:
            s.sendall(send)
        if close_now:
            return b""
        if shut:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return out
            if not chunk:
                return out
            out += chunk


async def test_junk_silence_and_early_closes_are_closed_and_leave_nothing_open(tmp_path: Path) -> None:
    async with Broker(tmp_path, serverFrameReadTimeoutMillis="500") as b:
        port = b.broker.grpc.port
        assert await asyncio.to_thread(_raw, port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == b""
        assert await asyncio.to_thread(_raw, port, b"\x16\x07\x00garbage") == b""
        assert await asyncio.to_thread(_raw, port) == b""  # silent: closed after 0.5 s
        assert await asyncio.to_thread(_raw, port, PREFACE[:5], shut=True) == b""  # EOF mid-preface
        await asyncio.to_thread(_raw, port, b"", close_now=True)
        await asyncio.to_thread(_raw, port, PREFACE[:3], close_now=True)
        # a whole preface, then EOF: relayed, grpc answers (its SETTINGS) and closes, both sides go
        assert (await asyncio.to_thread(_raw, port, PREFACE, shut=True)).startswith(b"\x00")
        # a TLS hello that stops half-way: grpc's handshake fails, both sides go
        assert await asyncio.to_thread(_raw, port, b"\x16\x03\x01\x00\x10abc", shut=True) == b""
        await async_wait_for(lambda: b.front.open_connections == 0 and not b.front._clients,
                             message="every connection closed and forgotten")
        assert b.front.stats.junk == 6 and (b.front.stats.tls, b.front.stats.plaintext) == (1, 1)
        assert (await _route(b.plaintext())).status.code == pb.OK  # still serving


async def test_connection_limits_hold_on_the_grpc_port(tmp_path: Path) -> None:
    async with Broker(tmp_path, serverMaxConnectionsPerIp="2") as b:
        port = b.broker.grpc.port
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        try:
            await async_wait_for(lambda: b.front.open_connections == 2, message="two connections admitted")
            assert await asyncio.to_thread(_raw, port, PREFACE) == b""  # the third is closed at once
            assert b.front.stats.refused_limit == 1
        finally:
            for s in held:
                s.close()
        await async_wait_for(lambda: b.front.open_connections == 0, message="the held connections closed")
        assert (await _route(b.plaintext())).status.code == pb.OK


async def test_a_relayed_connection_takes_three_descriptors_of_the_process_budget() -> None:
    """The front and the remoting servers share one open-file budget; a relayed client holds its socket,
    the front's connection to grpc's internal port and grpc's end of it."""
    from chronomq import netbudget
    from chronomq.clock import VirtualClock
    from chronomq.remoting.server import RemotingServer

    async def no_answer(req: Any, conn: Any) -> None:
        return None

    clock = VirtualClock()
    front = PortFront("127.0.0.1", 0, "permissive", plaintext_port=None, tls_port=None, clock=clock)
    remoting = RemotingServer(no_answer, "127.0.0.1", 0)
    await front.start()
    await remoting.start()
    held: list[socket.socket] = []
    try:
        base = netbudget.held()
        front.budget = remoting._budget = base + 4
        held.append(socket.create_connection(("127.0.0.1", front.port), timeout=10))
        await async_wait_for(lambda: front.open_connections == 1, message="the relayed client admitted")
        assert netbudget.held() == base + 3
        assert await asyncio.to_thread(_raw, front.port, PREFACE) == b""  # 3 more do not fit
        assert front.stats.refused_limit == 1 and front._limit_logged_at == clock.monotonic()
        held.append(socket.create_connection(("127.0.0.1", remoting.port), timeout=10))  # 1 more does
        await async_wait_for(lambda: len(remoting.connections()) == 1, message="the remoting client admitted")
        assert await asyncio.to_thread(_raw, remoting.port, b"") == b""
        assert remoting.refused == 1
        for s in held:
            s.close()
        await async_wait_for(lambda: netbudget.held() == base, message="the descriptors given back")
    finally:
        for s in held:
            s.close()
        await front.stop()
        await remoting.stop()


async def test_stopping_the_broker_closes_relayed_connections(tmp_path: Path) -> None:
    b = Broker(tmp_path)
    await b.__aenter__()
    front = b.front
    assert (await _route(b.tls())).status.code == pb.OK
    assert front.open_connections == 1
    await b.broker.shutdown()
    assert front.open_connections == 0 or await async_wait_for(lambda: front.open_connections == 0)
    for ch in b.channels:
        await ch.close()


# --- mutual TLS ---------------------------------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, timeout=60, check=True)


def _client_pki(d: Path, name: str) -> tuple[Path, bytes, bytes]:
    """A CA (``name``-ca.crt) and a client certificate and key it signed, made with the openssl command."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-subj", f"/CN={name} CA", "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.crt", cwd=d)
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-subj", f"/CN={name} client", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    (d / "ext.cnf").write_text("extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{name}-ca.crt", "-CAkey", f"{name}-ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", f"{name}.crt", cwd=d)
    return d / f"{name}-ca.crt", (d / f"{name}.key").read_bytes(), (d / f"{name}.crt").read_bytes()


@needs_openssl
async def test_mutual_tls_admits_a_client_certificate_of_the_trusted_ca_only(tmp_path: Path) -> None:
    ca, key, chain = _client_pki(tmp_path / "pki", "good")
    _, other_key, other_chain = _client_pki(tmp_path / "pki", "other")
    async with Broker(tmp_path, tlsServerMode="enforcing", tlsServerNeedClientAuth="require",
                      tlsServerTrustCertPath=str(ca)) as b:
        assert (await _route(b.tls(key=key, chain=chain))).status.code == pb.OK
        assert await _refused(b.tls()) == grpc.StatusCode.UNAVAILABLE  # no client certificate
        assert await _refused(b.tls(key=other_key, chain=other_chain)) == grpc.StatusCode.UNAVAILABLE
        assert await _refused(b.plaintext()) == grpc.StatusCode.UNAVAILABLE
