"""Master-slave replication in process: a master and a slave BrokerController sharing one route table on
the test's loop, over loopback. The slave learns its master's HA address from the registration answer,
holds a byte-identical commit log, serves pulls and refuses sends; a SYNC_MASTER answers SEND_OK only
for what the slave holds; a slave whose log is ahead of its master's is refused."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from tests.conftest import async_wait_for, free_port
from tests.integration.rawclient import AsyncRawClient, pull_ext

from chronomq.broker.controller import BrokerController
from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.ha.codec import HAProtocolError, ReportDecoder, TransferDecoder, encode_report, encode_transfer
from chronomq.message import decode_records
from chronomq.namesrv import RouteInfoManager
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C


def broker(tmp_path: Path, routes: RouteInfoManager, name: str, **over: str) -> BrokerController:
    values = {"storePathRootDir": str(tmp_path / name), "listenPort": str(free_port()),
              "haListenPort": str(free_port()), "messageDelayLevel": "1s 5s", "syncFlushTimeout": "1500",
              "mappedFileSizeCommitLog": str(64 * 1024)}
    values.update(over)
    config, _ = BrokerConfig.load(None, values)
    return BrokerController(config, VirtualClock(), local_register=routes.register_broker)


def log_bytes(b: BrokerController) -> bytes:
    cl = b.store._cl
    return b"".join(bytes(s.mm[: min(s.file_size, cl.wrote - s.start)]) for s in cl.segments)


async def test_a_sync_master_answers_only_what_its_slave_holds_and_the_slave_serves_reads(tmp_path):
    routes = RouteInfoManager()
    master = broker(tmp_path, routes, "m", brokerRole="SYNC_MASTER")
    await master.start()
    c = await AsyncRawClient.connect(master.server.address)
    slave = None
    try:
        r = await c.send_message("HA", b"before the slave", 0)
        assert r.code == C.SLAVE_NOT_AVAILABLE  # stored, but no slave holds it: never SEND_OK

        slave = broker(tmp_path, routes, "s", brokerRole="SLAVE", brokerId="1")
        await slave.start()  # learns the master's HA address from the registration answer
        await async_wait_for(lambda: master.ha is not None and master.ha.links, 10)
        bodies = [f"m{i}".encode() * 200 for i in range(60)]  # several 64 KiB segments
        codes = await asyncio.gather(*(c.send_message("HA", b, i % 2) for i, b in enumerate(bodies)))
        assert {x.code for x in codes} == {C.SUCCESS}
        assert slave.store.max_phy_offset == master.store.max_phy_offset
        assert log_bytes(slave) == log_bytes(master)

        s = await AsyncRawClient.connect(slave.server.address)
        try:
            await asyncio.to_thread(slave.store.wait_dispatched, slave.store.max_phy_offset, 5)
            ext = pull_ext("G", "HA", 1, 0, max_msgs=64)
            ext["sysFlag"] = 0
            got = await s.request(R.PULL_MESSAGE, ext)
            assert got.code == C.SUCCESS
            assert [m.body for m in decode_records(got.body)] == bodies[1::2]
            refused = await s.send_message("HA", b"to the slave", 0)
            assert refused.code == C.SERVICE_NOT_AVAILABLE and "slave" in refused.remark
        finally:
            await s.close()

        await slave.shutdown()  # the link drops: no slave holds new messages
        slave = None
        await async_wait_for(lambda: not master.ha.links, 10)
        r = await c.send_message("HA", b"after the slave left", 0)
        assert r.code in (C.SLAVE_NOT_AVAILABLE, C.FLUSH_SLAVE_TIMEOUT)
    finally:
        await c.close()
        if slave is not None:
            await slave.shutdown()
        await master.shutdown()


async def test_an_async_master_answers_at_once_and_a_restarted_slave_resumes(tmp_path):
    routes = RouteInfoManager()
    master = broker(tmp_path, routes, "m")
    await master.start()
    c = await AsyncRawClient.connect(master.server.address)
    try:
        assert (await c.send_message("HA2", b"no slave yet", 0)).code == C.SUCCESS
        slave = broker(tmp_path, routes, "s", brokerRole="SLAVE", brokerId="1")
        await slave.start()
        await async_wait_for(lambda: slave.store.max_phy_offset == master.store.max_phy_offset, 10)
        await slave.shutdown()
        for i in range(20):
            assert (await c.send_message("HA2", f"while away {i}".encode(), 0)).code == C.SUCCESS
        slave = broker(tmp_path, routes, "s", brokerRole="SLAVE", brokerId="1")
        await slave.start()
        await async_wait_for(lambda: slave.store.max_phy_offset == master.store.max_phy_offset, 10)
        assert log_bytes(slave) == log_bytes(master)
        await slave.shutdown()
    finally:
        await c.close()
        await master.shutdown()


async def test_a_slave_ahead_of_its_master_is_refused_with_a_reason(tmp_path, caplog):
    routes = RouteInfoManager()
    first = broker(tmp_path, routes, "m")
    await first.start()
    c = await AsyncRawClient.connect(first.server.address)
    for i in range(5):
        await c.send_message("HA3", f"x{i}".encode(), 0)
    await c.close()
    slave = broker(tmp_path, routes, "s", brokerRole="SLAVE", brokerId="1")
    await slave.start()
    await async_wait_for(lambda: slave.store.max_phy_offset == first.store.max_phy_offset > 0, 10)
    await slave.shutdown()
    await first.shutdown()
    routes2 = RouteInfoManager()
    empty = broker(tmp_path, routes2, "m-new")  # a master that lost its data
    await empty.start()
    slave = broker(tmp_path, routes2, "s", brokerRole="SLAVE", brokerId="1")
    try:
        with caplog.at_level(logging.ERROR, logger="chronomq.ha"):
            await slave.start()
            await async_wait_for(lambda: "ahead of this master" in caplog.text, 10)
        assert slave.store.max_phy_offset > empty.store.max_phy_offset == 0
    finally:
        await slave.shutdown()
        await empty.shutdown()


def test_the_frames_round_trip_and_hostile_headers_are_refused():
    dec = TransferDecoder(1024)
    wire = encode_transfer(7, b"abc") + encode_transfer(10) + encode_transfer(10, b"x" * 5)
    frames = [f for i in range(len(wire)) for f in dec.feed(wire[i : i + 1])]  # byte by byte
    assert frames == [(7, b"abc"), (10, b""), (10, b"xxxxx")]
    with pytest.raises(HAProtocolError):
        TransferDecoder(1024).feed(encode_transfer(0, b"y" * 2048))
    with pytest.raises(HAProtocolError):
        TransferDecoder(1024).feed(b"\xff" * 12)
    rep = ReportDecoder()
    assert rep.feed(encode_report(5)[:3]) == []
    assert rep.feed(encode_report(5)[3:] + encode_report(9)) == [5, 9]
    with pytest.raises(HAProtocolError):
        ReportDecoder().feed(b"\xff" * 8)


def test_roles_and_ids_are_checked():
    from chronomq.config import ConfigError

    with pytest.raises(ConfigError, match="brokerRole"):
        BrokerConfig.load(None, {"brokerRole": "PRIMARY"})
    with pytest.raises(ConfigError, match="brokerId"):
        BrokerConfig.load(None, {"brokerRole": "SLAVE"})
    with pytest.raises(ConfigError, match="brokerId"):
        BrokerConfig.load(None, {"brokerId": "1"})
    cfg, _ = BrokerConfig.load(None, {"listenPort": "20000"})
    assert cfg.ha_port == 20001
