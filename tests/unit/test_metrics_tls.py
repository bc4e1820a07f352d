"""The /metrics endpoint over HTTPS: HTTP and HTTPS on one port by the first byte, following the broker's
tlsServerMode with its certificate (the self-signed one under <store>/tls/ here): permissive serves both,
enforcing answers plain HTTP 400 and logs the refusals once per 10 s, disabled (or no TLS) is plain HTTP as
before; a scrape verifies against selfsigned.crt, curl -k scrapes without verifying, mutual TLS asks for a
client certificate, and a bad handshake or a silent client is one quiet line, never a traceback."""

from __future__ import annotations

import logging
import shutil
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import wait_for

from chronomq.config import BrokerConfig
from chronomq.metrics import MetricsServer, namesrv_families
from chronomq.remoting import selfsigned
from chronomq.remoting.tls import ServerTls

FIGURES = {"brokers": [{"cluster": "C", "broker": "b", "id": 0, "addr": "127.0.0.1:1"}], "topics": 7,
           "requests": 3}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def config(tmp_path: Path, **values: str) -> BrokerConfig:
    cfg, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp_path / "store"), **values})
    return cfg


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    servers: list[MetricsServer] = []

    def start(mode: str | None, clock: Clock | None = None, **values: str) -> MetricsServer:
        tls = None if mode is None else ServerTls.from_config(config(tmp_path, tlsServerMode=mode, **values),
                                                              "metrics")
        server = MetricsServer(lambda: FIGURES, "127.0.0.1", 0, namesrv_families, tls=tls,
                               monotonic=(clock or Clock()).monotonic)
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


def unverified() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def scrape(url: str, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_permissive_serves_plain_http_and_https_on_one_port(serve: Any, tmp_path: Path) -> None:
    server = serve("permissive")
    assert server.scheme == "http+https" and server.url().startswith("http://")
    status, text = scrape(f"http://127.0.0.1:{server.port}/metrics")
    assert status == 200 and "chronomq_namesrv_topics 7.0" in text
    crt = tmp_path / "store" / "tls" / "selfsigned.crt"
    assert not crt.exists()  # made at the first TLS connection only
    status, text = scrape(f"https://127.0.0.1:{server.port}/metrics", unverified())
    assert status == 200 and "chronomq_namesrv_topics 7.0" in text
    assert crt.exists()
    # verified against the self-signed certificate, host name included (it names 127.0.0.1 and localhost)
    for host in ("127.0.0.1", "localhost"):
        status, text = scrape(f"https://{host}:{server.port}/metrics", ssl.create_default_context(cafile=crt))
        assert status == 200 and "chronomq_namesrv_requests_total 3.0" in text
    # and a certificate that is not the server's is refused by the client
    other, _ = selfsigned.generate("someone else", ["127.0.0.1"])
    (tmp_path / "other.crt").write_bytes(other)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        scrape(f"https://127.0.0.1:{server.port}/metrics",
               ssl.create_default_context(cafile=tmp_path / "other.crt"))
    wait_for(lambda: server.tls_failures == 1, message="the refused certificate's handshake counted")
    assert server.tls_connections == 3 and server.refused_by_tls_mode == 0
    status, _ = scrape(f"http://127.0.0.1:{server.port}/metrics")  # plain HTTP still served after TLS
    assert status == 200


def test_enforcing_refuses_plain_http_with_a_400_logged_once_per_10_s(
        serve: Any, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    server = serve("enforcing", clock)
    assert server.scheme == "https" and server.url().startswith("https://")
    caplog.set_level(logging.DEBUG, "chronomq.metrics")
    for _ in range(3):
        status, text = scrape(f"http://127.0.0.1:{server.port}/metrics")
        assert status == 400 and "HTTPS only" in text and "chronomq_" not in text
    assert server.refused_by_tls_mode == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "refused 1 connection(s), the last from 127.0.0.1:" in warnings[0]
    assert "plain HTTP refused: tlsServerMode is enforcing (HTTPS only)" in warnings[0]
    clock.now += 10
    scrape(f"http://127.0.0.1:{server.port}/metrics")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "refused 3 connection(s) in 10 s" in warnings[1]
    status, text = scrape(f"https://127.0.0.1:{server.port}/metrics", unverified())
    assert status == 200 and "chronomq_namesrv_topics 7.0" in text


@pytest.mark.parametrize("mode", [None, "disabled"])
def test_without_tls_or_disabled_it_is_plain_http_as_before(serve: Any, mode: str | None,
                                                            tmp_path: Path) -> None:
    server = serve(mode)
    assert server.scheme == "http" and server.tls is None
    status, text = scrape(f"http://127.0.0.1:{server.port}/metrics")
    assert status == 200 and "chronomq_namesrv_topics 7.0" in text
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        scrape(f"https://127.0.0.1:{server.port}/metrics", unverified())
    assert not (tmp_path / "store" / "tls").exists()


def test_configured_certificate_and_mutual_tls(serve: Any, tmp_path: Path) -> None:
    cert, key = selfsigned.generate("metrics test", ["127.0.0.1"])
    client_cert, client_key = selfsigned.generate("scraper", ["scraper"], client=True)
    for name, data in (("server.crt", cert), ("server.key", key), ("client.crt", client_cert),
                       ("client.key", client_key)):
        (tmp_path / name).write_bytes(data)
    server = serve("enforcing", tlsCertPath=str(tmp_path / "server.crt"),
                   tlsKeyPath=str(tmp_path / "server.key"), tlsServerNeedClientAuth="require",
                   tlsServerTrustCertPath=str(tmp_path / "client.crt"))
    url = f"https://127.0.0.1:{server.port}/metrics"
    ctx = ssl.create_default_context(cafile=tmp_path / "server.crt")
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        scrape(url, ctx)  # no client certificate: the handshake fails (TLS 1.3: right after it)
    wait_for(lambda: server.tls_failures == 1, message="the failed handshake counted")
    ctx.load_cert_chain(tmp_path / "client.crt", tmp_path / "client.key")
    status, text = scrape(url, ctx)
    assert status == 200 and "chronomq_namesrv_topics 7.0" in text
    assert not (tmp_path / "store" / "tls").exists()  # the configured pair, no self-signed one


def test_junk_after_0x16_and_silent_clients_are_one_quiet_line(
        serve: Any, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    server = serve("permissive")
    caplog.set_level(logging.DEBUG)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"\x16\x03\x01\x00\x05hello")  # a TLS record header, then no handshake
        assert s.recv(4096) is not None  # an alert, then the close
    wait_for(lambda: server.tls_failures == 1, message="the bad handshake counted")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10):
        pass  # connects and leaves without a byte
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"\x16\x03\x01")  # leaves mid-handshake
    status, _ = scrape(f"http://127.0.0.1:{server.port}/metrics")  # the server is still fine
    assert status == 200
    wait_for(lambda: sum("closed during the TLS handshake" in r.getMessage() for r in caplog.records),
             message="the client gone mid-handshake logged at DEBUG")
    infos = [r.getMessage() for r in caplog.records
             if r.levelno >= logging.INFO and r.name.startswith("chronomq")]
    assert len(infos) == 2, infos  # the failed handshake, and the self-signed certificate made
    assert "metrics: TLS handshake with 127.0.0.1:" in infos[1] and "failed" in infos[1]
    assert "metrics TLS: made the self-signed certificate" in infos[0]
    assert server.tls_failures == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_k_scrapes_the_self_signed_endpoint(serve: Any, tmp_path: Path) -> None:
    server = serve("enforcing")
    url = f"https://127.0.0.1:{server.port}/metrics"
    out = subprocess.run(["curl", "-sS", "-k", "--max-time", "20", url], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and "chronomq_namesrv_topics 7.0" in out.stdout, out.stderr
    crt = tmp_path / "store" / "tls" / "selfsigned.crt"
    out = subprocess.run(["curl", "-sS", "--cacert", str(crt), "--max-time", "20", url], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and "chronomq_namesrv_topics 7.0" in out.stdout, out.stderr
    out = subprocess.run(["curl", "-sS", "--max-time", "20", f"http://127.0.0.1:{server.port}/metrics"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "HTTPS only" in out.stdout, out.stderr
