"""TLS on a broker's and its name server's ports in enforcing mode, in process (docs/tls.md): chronomq's
client produces, consumes and administers over TLS; a plaintext client, and a plaintext connection to the
broker's port, are refused."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tests.conftest import async_wait_for, free_port

from chronomq.broker.controller import BrokerController
from chronomq.client import Admin, ConnectFailed, Message, Producer, PushConsumer, ReceivedMessage
from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig
from chronomq.namesrv.server import NameServer
from chronomq.remoting.client import RemotingClient, RemotingConnectError
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode
from chronomq.remoting.tls import ENFORCING, ServerTls

pytestmark = pytest.mark.timeout(60)


async def test_our_client_produces_and_consumes_over_tls_and_plaintext_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="chronomq.remoting")
    ns_port, port = free_port(), free_port()
    config, _ = BrokerConfig.load(None, {
        "storePathRootDir": str(tmp_path / "data"), "listenPort": str(port), "haListenPort": str(free_port()),
        "namesrvAddr": f"127.0.0.1:{ns_port}", "metricsPort": "-1", "tlsServerMode": "enforcing"})
    clock = SystemClock()
    ns = NameServer("127.0.0.1", ns_port, clock, tls=ServerTls.from_config(config, "namesrv"))
    broker = BrokerController(config, clock, local_register=ns.routes.register_broker)
    await ns.start()
    await broker.start()
    try:
        assert broker.server.tls is not None and broker.server.tls.mode == ENFORCING
        async with Admin(ns.address, tls=True) as admin:
            await admin.create_topic("TlsTopic", 2)
        async with Producer("PG_tls", ns.address, tls=True) as p:
            sent = [await p.send(Message("TlsTopic", f"m{i}".encode() * 1000)) for i in range(20)]
        got: dict[str, bytes] = {}

        def listener(m: ReceivedMessage) -> None:
            got[m.id] = m.body

        consumer = PushConsumer("CG_tls", {"TlsTopic": "*"}, listener, ns.address, tls=True,
                                consume_from="first", rebalance_interval=0.5, long_poll_timeout=2.0)
        async with consumer:
            await async_wait_for(lambda: len(got) == 20, message="20 messages consumed over TLS")
        assert {s.msg_id for s in sent} == set(got)
        assert broker.server.tls_connections >= 2 and ns.server.tls_connections >= 3  # both ports on TLS
        assert broker.server.tls_failures == ns.server.tls_failures == 0
        refused_before = ns.server.refused_by_tls_mode
        async with Producer("PG_plain", ns.address, retries=0, send_timeout=2.0) as plain:
            with pytest.raises(ConnectFailed, match="connection closed by peer"):  # refused at once
                await plain.send(Message("TlsTopic", b"plaintext"))
        assert ns.server.refused_by_tls_mode > refused_before
        raw = RemotingClient()  # plaintext to the broker's port itself
        try:
            with pytest.raises(RemotingConnectError):
                await raw.invoke(broker.server.address,
                                 RemotingCommand.request(RequestCode.GET_BROKER_RUNTIME_INFO), timeout=5.0)
        finally:
            await raw.close()
        assert broker.server.refused_by_tls_mode == 1
        assert any("plaintext refused" in r.getMessage() for r in caplog.records)
        assert not [r for r in caplog.records if r.exc_info]
    finally:
        await broker.shutdown()
        await ns.stop()
