"""Master and slave over TLS in separate processes, as deployed (``chronomq namesrv`` and two ``chronomq
broker``, on uvloop): the name server and the master serve TLS only (tlsServerMode=enforcing), both brokers
have tlsEnable, so each registers with the name server and the slave links to the master's HA port and
reads its metadata over TLS; the messages chronomq's client sends over TLS reach the slave's store. A
broker without tlsEnable is refused by the name server, which both processes log once."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chronomq.client import Message, Producer
from chronomq.remoting.client import RemotingClient
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode
from chronomq.remoting.tls import client_context
from tests.compat.harness import CliProcess, free_port
from tests.conftest import async_wait_for

pytestmark = pytest.mark.timeout(120)

ENFORCING = ["--set", "tlsServerMode=enforcing"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    ns_port, m_port, s_port = free_port(), free_port(), free_port()
    ns = f"127.0.0.1:{ns_port}"
    common = ["-n", ns, "--set", "brokerName=tls-ha", "--set", "metricsPort=-1", "--set", "grpcListenPort=-1",
              "--set", "tlsEnable=true"]
    procs = {
        "ns": CliProcess(tmp_path / "ns.log", "namesrv", "--port", str(ns_port), "--metrics-port", "-1",
                         "--set", f"storePathRootDir={tmp_path / 'ns'}", *ENFORCING),
        "master": CliProcess(tmp_path / "master.log", "broker", *common, "--data-dir", str(tmp_path / "m"),
                             "--broker-port", str(m_port), "--set", f"haListenPort={free_port()}",
                             *ENFORCING),
        "slave": CliProcess(tmp_path / "slave.log", "broker", *common, "--data-dir", str(tmp_path / "s"),
                            "--broker-port", str(s_port), "--set", "brokerRole=SLAVE", "--set", "brokerId=1",
                            "--set", f"haListenPort={free_port()}"),
    }
    started: list[CliProcess] = []
    try:
        for p in procs.values():
            p.start()
            started.append(p)
        yield {"ns": ns, "master": f"127.0.0.1:{m_port}", "slave": f"127.0.0.1:{s_port}", "procs": procs}
    finally:
        for p in reversed(started):
            p.stop()


async def runtime(client: RemotingClient, addr: str) -> dict[str, str]:
    resp = await client.invoke(addr, RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO))
    assert resp.code == 0, resp.remark
    table: dict[str, str] = json.loads(resp.body)["table"]
    return table


async def test_a_slave_replicates_over_tls_and_a_plaintext_broker_is_refused_registration(
        cluster: dict[str, Any], tmp_path: Path) -> None:
    client = RemotingClient(ssl_context=client_context(True))
    try:
        master, slave = cluster["master"], cluster["slave"]

        async def linked() -> bool:
            return (await runtime(client, master)).get("haSlaves") == "1"

        await async_wait_for(linked, 30, interval=0.2, message="the slave linked over TLS")
        async with Producer("PG_ha_tls", cluster["ns"], tls=True) as p:  # routed by the enforcing name server
            for i in range(30):
                await p.send(Message("HATlsProc", f"m{i}".encode() * 500))

        async def caught_up() -> bool:
            m, s = await runtime(client, master), await runtime(client, slave)
            return s["commitLogMaxOffset"] == m["commitLogMaxOffset"] != "0"

        await async_wait_for(caught_up, 30, interval=0.2, message="the slave holds the master's log")
        procs = cluster["procs"]
        assert re.search(r"HA: linked to master \S+ over TLS", procs["slave"].tail())
        for name in ("master", "slave"):
            assert "registered with name server" in procs[name].tail()
            assert "Traceback" not in procs[name].tail()
    finally:
        await client.close()

    # a broker without tlsEnable: the enforcing name server closes its connection, and both log it
    plain = CliProcess(tmp_path / "plain.log", "broker", "-n", cluster["ns"],
                       "--data-dir", str(tmp_path / "p"), "--broker-port", str(free_port()),
                       "--set", f"haListenPort={free_port()}",
                       "--set", "brokerName=plain", "--set", "metricsPort=-1", "--set", "grpcListenPort=-1")
    plain.start()  # ready after its first registration round
    try:
        text = plain.tail()
        assert text.count("cannot register with name server") == 1 and "set tlsEnable=true" in text, text
        assert "Traceback" not in text
        await async_wait_for(lambda: "plaintext refused" in cluster["procs"]["ns"].tail(), 10,
                             message="the name server logged the refusal")
    finally:
        plain.stop()
