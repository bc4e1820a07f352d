"""The official Java client's 4.x API (rocketmq-client 4.9.x) over TLS against ``chronomq start``
(docs/tls.md): the driver's ``"tls": true`` is ``setUseTLS(true)`` on the producer and the consumer, which
puts their name-server and broker connections on TLS (not verifying the server, the client's default).
In permissive mode a TLS producer and consumer send and receive, a delayed message included, and a
plaintext producer is served too; in enforcing mode TLS still works and the plaintext producer's send fails.
One broker for the module, restarted when a test needs the other mode."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.compat.harness import ChronomqProcess, CompatUnavailable, run_driver
from tests.compat.observe import b64, text, uniq

pytestmark = [pytest.mark.compat, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], ChronomqProcess]]:
    """``server(mode)``: the module's broker in that tlsServerMode (restarted on its data when it changes)."""
    from tests.compat.jvm import java_driver

    try:
        java_driver("java4")
    except CompatUnavailable as e:
        pytest.skip(str(e))
    proc = ChronomqProcess(tmp_path_factory.mktemp("tls_compat") / "data")

    def in_mode(mode: str) -> ChronomqProcess:
        if proc.running and proc.overrides.get("tlsServerMode") == mode:
            return proc
        proc.stop(timeout=30)
        proc.overrides["tlsServerMode"] = mode
        return proc.start()

    try:
        yield in_mode
    finally:
        proc.stop(timeout=30)


def produce(broker: ChronomqProcess, topic: str, tls: bool, delayed: bool = True,
            **kw: Any) -> list[dict[str, Any]]:
    """A normal message and (``delayed``) one of delay level 1 (1 s), sent by a producer of its own."""
    msgs = [{"topic": topic, "body": b64(f"now-{tls}"), "keys": "NOW"}]
    if delayed:
        msgs.append({"topic": topic, "body": b64(f"later-{tls}"), "keys": "LATER", "delayLevel": 1})
    args = {"namesrv": broker.namesrv_addr, "group": uniq("PG"), "mode": "sync", "messages": msgs,
            "tls": tls, **kw}
    return list(run_driver("java4:produce", args, timeout=90)["results"])


def consume(broker: ChronomqProcess, tmp_path: Path, topic: str, expect: int) -> list[dict[str, Any]]:
    out = tmp_path / f"{uniq('deliveries')}.jsonl"
    result = run_driver("java4:push_consume", {
        "namesrv": broker.namesrv_addr, "group": uniq("CG"), "topic": topic, "expect": expect,
        "out": str(out), "maxSeconds": 40, "tls": True}, timeout=120)
    assert result["started"], result
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def check_delivered(records: list[dict[str, Any]], bodies: set[str]) -> None:
    assert {text(r) for r in records} == bodies, records
    for r in records:
        waited = r["storeTimestamp"] - r["bornTimestamp"]  # a delayed message is stored when it is due
        assert (waited >= 900) == (r["keys"] == "LATER"), (r["keys"], waited)


def test_permissive_serves_the_java_client_over_tls_and_in_plaintext(
        server: Callable[[str], ChronomqProcess], tmp_path: Path) -> None:
    broker = server("permissive")
    topic = uniq("JTls")
    cert = broker.data_dir / "tls" / "selfsigned.crt"
    plain = produce(broker, topic, tls=False)
    assert [r["ok"] for r in plain] == [True, True], plain
    assert not cert.exists()  # no TLS connection so far: the certificate is made at the first one
    sent = produce(broker, topic, tls=True)
    assert [(r["ok"], r["status"]) for r in sent] == [(True, "SEND_OK")] * 2, sent
    assert cert.exists()  # the TLS producer's connections were TLS
    records = consume(broker, tmp_path, topic, expect=4)
    check_delivered(records, {"now-False", "later-False", "now-True", "later-True"})


def test_enforcing_serves_the_java_client_over_tls_and_refuses_plaintext(
        server: Callable[[str], ChronomqProcess], tmp_path: Path) -> None:
    broker = server("enforcing")
    topic = uniq("JTlsOnly")
    sent = produce(broker, topic, tls=True)
    assert [(r["ok"], r["status"]) for r in sent] == [(True, "SEND_OK")] * 2, sent
    records = consume(broker, tmp_path, topic, expect=2)
    check_delivered(records, {"now-True", "later-True"})
    refused = produce(broker, topic, tls=False, delayed=False, timeoutMs=3000, retries=0)
    assert [r["ok"] for r in refused] == [False], refused
    # the client asks the name server for the route, which closes the connection at once; the 4.9 client
    # waits for an answer on it until the send's timeout
    assert refused[0]["error"]["type"] in ("RemotingTimeoutException", "RemotingConnectException",
                                           "RemotingSendRequestException", "MQClientException"), refused
    assert "plaintext refused: tlsServerMode is enforcing" in broker.log_tail(100_000)
