"""The console over HTTPS and its connections over TLS: a console with a certificate serves its pages over
HTTPS only (the session cookie Secure); against a cluster whose ports are enforcing it works with broker
TLS on (unverified, and verified against the broker's selfsigned.crt) and shows an error page that says
what to do without it; settings it cannot use stop it with a message; ``chronomq start --dashboard`` on an
enforcing cluster connects its console over TLS by itself."""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the web extra is not installed")

from chronomq.remoting import selfsigned
from chronomq.web import ConsoleConfig, ConsoleServer
from tests.compat.harness import ChronomqProcess, CliProcess
from tests.conftest import free_port
from tests.web.conftest import LoopThread

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def enforcing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChronomqProcess]:
    proc = ChronomqProcess(tmp_path_factory.mktemp("console_tls") / "data", {"tlsServerMode": "enforcing"})
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("console_pem")
    cert, key = selfsigned.generate("console test", ["127.0.0.1", "localhost"])
    other_cert, _ = selfsigned.generate("another", ["127.0.0.1"])
    out = {"cert": d / "console.crt", "key": d / "console.key", "other": d / "other.crt",
           "encrypted": d / "encrypted.key", "junk": d / "junk.pem"}
    out["cert"].write_bytes(cert)
    out["key"].write_bytes(key)
    out["other"].write_bytes(other_cert)
    out["encrypted"].write_bytes(b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n"
                                 b"-----END ENCRYPTED PRIVATE KEY-----\n")
    out["junk"].write_text("not a certificate\n")
    return out


def get(url: str, context: ssl.SSLContext | None = None) -> tuple[int, Any, str]:
    try:
        with urllib.request.urlopen(url, timeout=30, context=context) as resp:
            return resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def serve(web_loop: LoopThread, cfg: ConsoleConfig) -> ConsoleServer:
    server = ConsoleServer(cfg)
    web_loop.run(server.start())
    return server


def test_https_console_against_an_enforcing_cluster_with_broker_tls(
        web_loop: LoopThread, enforcing: ChronomqProcess, pem: dict[str, Path]) -> None:
    server = serve(web_loop, ConsoleConfig(namesrv=enforcing.namesrv_addr, port=free_port(),
                                           tls_cert=str(pem["cert"]), tls_key=str(pem["key"]),
                                           broker_tls=True))
    try:
        assert server.url.startswith("https://127.0.0.1:")
        verified = ssl.create_default_context(cafile=pem["cert"])
        status, headers, html = get(server.url, verified)
        assert status == 200, html
        assert "broker-a" in text(html) and "ASYNC_MASTER" in text(html)
        cookie = headers["set-cookie"].lower()
        assert "secure" in cookie and "httponly" in cookie and "samesite=strict" in cookie
        # the HTTPS port serves nothing over plain HTTP: the connection ends in the failed handshake
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            get(server.url.replace("https://", "http://"))
        # a client that does not trust the console's certificate is refused by its own check
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            get(server.url, ssl.create_default_context(cafile=pem["other"]))
    finally:
        web_loop.run(server.stop())


def test_console_verifies_the_brokers_against_their_certificate(
        web_loop: LoopThread, enforcing: ChronomqProcess, tmp_path: Path) -> None:
    crt = enforcing.data_dir / "tls" / "selfsigned.crt"
    if not crt.exists():  # made at the cluster's first TLS connection
        unverified = ConsoleServer(ConsoleConfig(namesrv=enforcing.namesrv_addr, port=free_port(),
                                                 broker_tls=True))
        web_loop.run(unverified.start())
        try:
            assert get(unverified.url)[0] == 200
        finally:
            web_loop.run(unverified.stop())
    server = serve(web_loop, ConsoleConfig(namesrv=enforcing.namesrv_addr, port=free_port(),
                                           broker_tls=str(crt)))
    try:
        assert server.url.startswith("http://")  # HTTP to the browser, TLS to the cluster
        status, _, html = get(server.url + "topics")
        assert status == 200, html
    finally:
        web_loop.run(server.stop())
    other, _ = selfsigned.generate("not the broker", ["127.0.0.1"])
    (tmp_path / "other.crt").write_bytes(other)
    server = serve(web_loop, ConsoleConfig(namesrv=enforcing.namesrv_addr, port=free_port(),
                                           broker_tls=str(tmp_path / "other.crt")))
    try:
        status, _, html = get(server.url)
        assert status == 502 and "CERTIFICATE_VERIFY_FAILED" in html and "Traceback" not in html
        assert "--broker-tls" not in html  # TLS is on: no hint to turn it on
    finally:
        web_loop.run(server.stop())


def test_without_broker_tls_the_console_shows_an_error_not_a_traceback(
        web_loop: LoopThread, enforcing: ChronomqProcess, capfd: pytest.CaptureFixture[str]) -> None:
    server = serve(web_loop, ConsoleConfig(namesrv=enforcing.namesrv_addr, port=free_port()))
    try:
        for path in ("", "topics", "groups", "delayed"):
            status, _, html = get(server.url + path)
            assert status == 502, (path, html)
            assert "start the console with --broker-tls" in text(html), html
            assert "Traceback" not in html
    finally:
        web_loop.run(server.stop())
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("settings,why", [
    ({"tls_cert": "cert"}, "--tls-cert and --tls-key go together"),
    ({"tls_key": "key"}, "--tls-cert and --tls-key go together"),
    ({"tls_cert": "other", "tls_key": "key"}, "cannot be used together"),
    ({"tls_cert": "cert", "tls_key": "encrypted"}, "is encrypted"),
    ({"tls_cert": "cert", "tls_key": "missing"}, "cannot read"),
    ({"broker_tls": "junk"}, "--broker-tls"),
    ({"broker_tls": "missing"}, "--broker-tls"),
])
def test_settings_it_cannot_use_are_refused_with_the_reason(
        pem: dict[str, Path], tmp_path: Path, settings: dict[str, str], why: str) -> None:
    files = {**pem, "missing": tmp_path / "missing.pem"}
    kwargs = {k: str(files[v]) for k, v in settings.items()}
    with pytest.raises(ValueError, match=re.escape(why)):
        ConsoleServer(ConsoleConfig(port=free_port(), **kwargs))


def test_dashboard_command_reports_bad_tls_settings_without_a_traceback(pem: dict[str, Path]) -> None:
    env_path = str(REPO / "src")
    out = subprocess.run([sys.executable, "-m", "chronomq.cli.main", "dashboard", "--port", str(free_port()),
                          "--tls-cert", str(pem["cert"]), "--tls-key", str(pem["encrypted"])],
                         capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": env_path})
    assert out.returncode == 2 and "configuration error: console:" in out.stderr, out.stderr
    assert "is encrypted" in out.stderr and "Traceback" not in out.stderr


def test_start_dashboard_on_an_enforcing_cluster_serves_https_and_connects_over_tls(
        tmp_path: Path, pem: dict[str, Path]) -> None:
    console_port = free_port()
    proc = CliProcess(tmp_path / "start.log", "start", "--data-dir", str(tmp_path / "data"),
                      "--namesrv-port", str(free_port()), "--broker-port", str(free_port()),
                      "--set", "tlsServerMode=enforcing", "--set", "metricsPort=-1",
                      "--set", "grpcListenPort=-1", "--set", f"haListenPort={free_port()}",
                      "--dashboard", "--dashboard-port", str(console_port),
                      "--dashboard-tls-cert", str(pem["cert"]), "--dashboard-tls-key", str(pem["key"]))
    proc.start()
    try:
        status, _, html = get(f"https://127.0.0.1:{console_port}/",
                              ssl.create_default_context(cafile=pem["cert"]))
        assert status == 200 and "broker-a" in text(html), html
    finally:
        proc.stop()
    log = proc.tail()
    assert "Traceback" not in log and "plaintext refused" not in log, log


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_k_reads_the_https_console(web_loop: LoopThread, enforcing: ChronomqProcess,
                                        pem: dict[str, Path]) -> None:
    server = serve(web_loop, ConsoleConfig(namesrv=enforcing.namesrv_addr, port=free_port(),
                                           tls_cert=str(pem["cert"]), tls_key=str(pem["key"]),
                                           broker_tls=True))
    try:
        out = subprocess.run(["curl", "-sS", "-k", "--max-time", "30", server.url], capture_output=True,
                             text=True, timeout=40)
        assert out.returncode == 0 and "broker-a" in out.stdout, out.stderr
    finally:
        web_loop.run(server.stop())
