"""The real ``chronomq start`` (uvloop) with /metrics on: the broker's and the embedded name server's
endpoints follow tlsServerMode. By default (permissive, no certificate configured) a plain-HTTP scraper is
served as before and HTTPS works too, verified against <store>/tls/selfsigned.crt; under enforcing plain
HTTP is answered 400 and HTTPS serves the figures."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.compat.harness import ChronomqProcess
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(120)


def scrape(url: str, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=20, context=context) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def start(tmp_path: Path, mode: str | None) -> tuple[ChronomqProcess, int, int]:
    broker_port, ns_port = free_port(), free_port()
    overrides = {"metricsPort": str(broker_port), "namesrvMetricsPort": str(ns_port)}
    if mode is not None:
        overrides["tlsServerMode"] = mode
    return ChronomqProcess(tmp_path / "data", overrides), broker_port, ns_port


def test_default_start_serves_plain_http_scrapers_and_https(tmp_path: Path) -> None:
    proc, broker_port, ns_port = start(tmp_path, None)
    with proc:
        for port, metric in ((broker_port, "chronomq_broker_role"), (ns_port, "chronomq_namesrv_topics")):
            status, text = scrape(f"http://127.0.0.1:{port}/metrics")
            assert status == 200 and metric in text
        crt = tmp_path / "data" / "tls" / "selfsigned.crt"
        assert not crt.exists()  # no TLS client yet: no certificate made
        unverified = ssl.create_default_context()
        unverified.check_hostname = False
        unverified.verify_mode = ssl.CERT_NONE
        status, text = scrape(f"https://127.0.0.1:{broker_port}/metrics", unverified)
        assert status == 200 and "chronomq_broker_role" in text
        verified = ssl.create_default_context(cafile=crt)
        for port, metric in ((broker_port, "chronomq_broker_role"), (ns_port, "chronomq_namesrv_topics")):
            status, text = scrape(f"https://127.0.0.1:{port}/metrics", verified)
            assert status == 200 and metric in text
        log = proc.log_tail(20_000)
        assert f"metrics on http://127.0.0.1:{broker_port}/metrics (http+https)" in log
        assert "Traceback" not in log


def test_enforcing_start_serves_metrics_over_https_only(tmp_path: Path) -> None:
    proc, broker_port, ns_port = start(tmp_path, "enforcing")
    with proc:
        for port in (broker_port, ns_port):
            status, text = scrape(f"http://127.0.0.1:{port}/metrics")
            assert status == 400 and "HTTPS only" in text
        unverified = ssl.create_default_context()
        unverified.check_hostname = False
        unverified.verify_mode = ssl.CERT_NONE
        status, text = scrape(f"https://127.0.0.1:{ns_port}/metrics", unverified)  # makes the certificate
        assert status == 200 and "chronomq_namesrv_topics" in text
        verified = ssl.create_default_context(cafile=tmp_path / "data" / "tls" / "selfsigned.crt")
        for port, metric in ((broker_port, "chronomq_broker_role"), (ns_port, "chronomq_namesrv_topics")):
            status, text = scrape(f"https://localhost:{port}/metrics", verified)
            assert status == 200 and metric in text
        log = proc.log_tail(20_000)
        assert "plain HTTP refused: tlsServerMode is enforcing (HTTPS only)" in log
        assert f"metrics on https://127.0.0.1:{broker_port}/metrics (https)" in log
        assert "Traceback" not in log
