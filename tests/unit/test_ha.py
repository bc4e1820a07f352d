"""Master-slave replication in process: a master and a slave BrokerController sharing one route table on
the test's loop, over loopback. The slave learns its master's HA address from the registration answer,
holds a byte-identical commit log, serves pulls and refuses sends; a SYNC_MASTER answers SEND_OK only
for what the slave holds; a slave whose log is ahead of its master's is refused."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import async_wait_for, free_port, queue_messages
from tests.integration.rawclient import AsyncRawClient, pull_ext

from chronomq.broker.controller import BrokerController
from chronomq.broker.offsets import ConsumerOffsetManager
from chronomq.broker.slave_sync import SlaveSynchronize
from chronomq.broker.topics import TopicConfig, TopicConfigManager
from chronomq.client import Message, Producer, PushConsumer
from chronomq.clock import SystemClock, VirtualClock
from chronomq.config import BrokerConfig
from chronomq.delay.offsets import OffsetFile
from chronomq.delay.timer.journal import JOURNAL_TOPIC
from chronomq.ha import HAService
from chronomq.ha.codec import HAProtocolError, ReportDecoder, TransferDecoder, encode_report, encode_transfer
from chronomq.ha.service import SlaveLink
from chronomq.message import MessageExt, decode_record, decode_records
from chronomq.namesrv import RouteInfoManager
from chronomq.namesrv.server import NameServer
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C


def broker(tmp_path: Path, routes: RouteInfoManager | None, name: str, clock: Any = None,
           **over: str) -> BrokerController:
    """A broker registering with ``routes`` directly, or (None) with the name server of ``namesrvAddr``."""
    values = {"storePathRootDir": str(tmp_path / name), "listenPort": str(free_port()),
              "haListenPort": str(free_port()), "messageDelayLevel": "1s 5s", "syncFlushTimeout": "1500",
              "mappedFileSizeCommitLog": str(64 * 1024), "metricsPort": "-1"}
    values.update(over)
    config, _ = BrokerConfig.load(None, values)
    return BrokerController(config, clock or VirtualClock(),
                            local_register=routes.register_broker if routes is not None else None)


def log_bytes(b: BrokerController) -> bytes:
    cl = b.store._cl
    return b"".join(bytes(s.mm[: min(s.file_size, cl.wrote - s.start)]) for s in cl.segments)


async def test_a_sync_master_answers_only_what_its_slave_holds_and_the_slave_serves_reads(tmp_path):
    routes = RouteInfoManager()
    # 60 concurrent sends wait for the slave: a slow machine (the pure-Python pass) needs more than 1.5 s
    master = broker(tmp_path, routes, "m", brokerRole="SYNC_MASTER", syncFlushTimeout="10000")
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


async def test_a_slave_copies_its_masters_topics_offsets_and_delay_offsets(tmp_path):
    routes = RouteInfoManager()
    master = broker(tmp_path, routes, "m", brokerRole="ASYNC_MASTER")
    await master.start()
    slave = broker(tmp_path, routes, "s", brokerRole="SLAVE", brokerId="1")
    await slave.start()
    try:
        assert slave.slave_sync is not None and slave.slave_sync.master_addr == master.broker_addr
        master.topics.update(TopicConfig("Orders", 6, 6, 6))
        master.offsets.commit("G", "Orders", 3, 41)
        master.delay.schedule.states[2].offset = 7

        res = await slave.slave_sync.sync_all()
        assert res.errors == {} and res.topics_replaced and res.offsets_taken == 1 and res.delay_offsets_saved
        assert slave.topics.get("Orders") == master.topics.get("Orders")
        assert slave.topics.data_version == master.topics.data_version
        assert slave.offsets.query("G", "Orders", 3) == 41
        saved = OffsetFile(slave.root).load()
        assert saved is not None and saved.offsets[2] == 7
        # what the slave persisted is what a restart (or a promotion) reads
        assert json.loads((slave.root / "config" / "topics.json").read_text())["topicConfigTable"]["Orders"]
        assert ConsumerOffsetManager(slave.root / "config").query("G", "Orders", 3) == 41

        again = await slave.slave_sync.sync_all()  # nothing changed on the master
        assert not again.topics_replaced and again.offsets_taken == 0

        master.topics.delete("Orders")
        master.offsets.commit("G", "Orders", 3, 50)
        slave.offsets.commit("H", "Other", 0, 9)  # a key the master lacks stays, as RocketMQ's putAll
        res = await slave.slave_sync.sync_all()
        assert res.topics_replaced and slave.topics.get("Orders") is None
        assert slave.offsets.query("G", "Orders", 3) == 50 and slave.offsets.query("H", "Other", 0) == 9

        # role and replication as `chronomq admin cluster` and broker-status show them
        await async_wait_for(lambda: master.runtime_info()["haLagBytes"] == 0, 10)
        m_info, s_info = master.runtime_info(), slave.runtime_info()
        assert m_info["brokerRole"] == "ASYNC_MASTER" and m_info["haSlaves"] == 1 and m_info["haLagMs"] == 0
        assert m_info["haSlaveAckOffset"] == master.store.max_phy_offset
        assert s_info["brokerRole"] == "SLAVE" and s_info["haConnected"] is True
        assert s_info["masterAddr"] == master.broker_addr and s_info["slaveSyncRounds"] == 3
        assert s_info["slaveSyncErrors"] == ""
    finally:
        await slave.shutdown()
        await master.shutdown()
    # the slave's unstarted schedule service did not overwrite the copied delay offsets at shutdown
    assert OffsetFile(slave.root).load().offsets[2] == 7


async def test_slave_sync_survives_a_missing_or_hostile_master(tmp_path, caplog):
    topics = TopicConfigManager(tmp_path, 4, True, 2, lambda: 1)
    offsets = ConsumerOffsetManager(tmp_path)
    answers: list[Any] = []

    async def invoke(addr: str, cmd: RemotingCommand, timeout: float) -> RemotingCommand:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return cmd.response(a[0], body=a[1], remark="nope" if a[0] else None)

    sync = SlaveSynchronize(topics, offsets, str(tmp_path), invoke)
    assert (await sync.sync_all()).errors == {}  # master unknown yet: nothing asked
    sync.master_addr = "127.0.0.1:1"
    before = dict(topics.table)
    answers[:] = [ConnectionRefusedError("refused"), (0, b"{not json"), (C.SYSTEM_ERROR, b"")]
    with caplog.at_level(logging.WARNING):
        res = await sync.sync_all()
    assert set(res.errors) == {"topics", "consumer offsets", "delay offsets"}
    assert "not JSON" in res.errors["consumer offsets"] and "nope" in res.errors["delay offsets"]
    assert topics.table == before and offsets.table == {}
    assert "slave sync" in caplog.text
    answers[:] = [(0, b'{"dataVersion": {"timestamp": 5, "counter": 1}, "topicConfigTable": {"T": {}}}'),
                  (0, b'{"offsetTable": {"T@G": {"x": 1}}}'), (0, b'{"offsetTable": {"0": 3}}')]
    res = await sync.sync_all()  # malformed entries: refused whole, nothing half-applied
    assert set(res.errors) == {"topics", "consumer offsets", "delay offsets"}
    assert topics.table == before and offsets.table == {}


async def test_lag_in_bytes_and_ms_follows_appends_and_acks():
    class Store:
        max_phy_offset = 0

    clock = VirtualClock()
    config, _ = BrokerConfig.load(None, {})
    ha = HAService(config, Store(), clock)  # type: ignore[arg-type]
    assert ha.lag() == (-1, -1)  # no slave
    ha.links[1] = SlaveLink("s")
    ha.store.max_phy_offset = 100
    ha.wake()
    await clock.advance(5)
    ha.store.max_phy_offset = 300
    ha.wake()
    await clock.advance(10)
    assert ha.lag() == (300, 15)  # the oldest byte it lacks was appended 15 ms ago
    ha._acked(100)
    assert ha.lag() == (200, 10) and list(ha.replication_ms) == [15]
    ha._acked(300)
    assert ha.lag() == (0, 0) and list(ha.replication_ms) == [15, 10]
    ha.wake()  # nothing new: no note
    assert not ha._marks


async def test_our_consumer_reads_from_the_slave_while_the_master_is_down(tmp_path):
    ns = NameServer("127.0.0.1", free_port(), SystemClock())
    await ns.start()
    master = broker(tmp_path, None, "m", SystemClock(), namesrvAddr=ns.address)
    slave = broker(tmp_path, None, "s", SystemClock(), namesrvAddr=ns.address, brokerRole="SLAVE",
                   brokerId="1")
    await master.start()
    await slave.start()
    got: list[bytes] = []
    try:
        async with Producer("PG_ha", ns.address) as p:
            sent = [(await p.send(Message("HARead", f"m{i}".encode()))).msg_id for i in range(40)]
        assert len(set(sent)) == 40
        await async_wait_for(lambda: slave.store.max_phy_offset == master.store.max_phy_offset, 10)
        await master.shutdown()  # it unregisters: the route lists only the slave now
        async with PushConsumer("CG_ha", "HARead", lambda m: got.append(m.body), ns.address,
                                consume_from="first", rebalance_interval=0.5, offset_commit_interval=0.3,
                                long_poll_timeout=1.0, route_refresh_interval=0.5):
            await async_wait_for(lambda: len(got) == 40, 20, message="every message, from the slave")
            # with the master down, consumed offsets are kept by the slave
            await async_wait_for(lambda: sum(slave.offsets.offsets_of("CG_ha", "HARead").values()) == 40, 10)
        assert sorted(got) == sorted(f"m{i}".encode() for i in range(40))
    finally:
        await slave.shutdown()
        await master.shutdown()
        await ns.stop()


def delivered(b: BrokerController, topic: str) -> list[MessageExt]:
    return queue_messages(b.store, topic)


async def test_a_promoted_slave_delivers_every_pending_delayed_message_once(tmp_path):
    routes = RouteInfoManager()
    clock = VirtualClock()
    t0 = clock.now_ms()
    master = broker(tmp_path, routes, "m", clock, timerReplication="true")  # levels 1s 5s
    slave = broker(tmp_path, routes, "s", clock, brokerRole="SLAVE", brokerId="1")
    await master.start()
    await slave.start()
    c = await AsyncRawClient.connect(master.server.address)
    try:
        for i in range(20):  # t0..t4 due within 3 s, the rest 10..29 s ahead
            due = t0 + (3000 if i < 5 else 10_000 + 1000 * i)
            r = await c.send_message("Promo", f"t{i}".encode(), i % 4, {"TIMER_DELIVER_MS": str(due),
                                                                         "UNIQ_KEY": f"U{i:04d}"})
            assert r.code == C.SUCCESS, r.remark
        for i in range(10):
            r = await c.send_message("Promo", f"L{i}".encode(), i % 4, {"DELAY": "2" if i < 5 else "1"})
            assert r.code == C.SUCCESS
        cancel = await c.request(R.CHRONOMQ_CANCEL_SCHEDULED, {"id": "U0007", "byKey": "false"})
        assert json.loads(cancel.body)["results"][0]["outcome"] == "CANCELLED"
        later = await c.request(R.CHRONOMQ_RESCHEDULE, {"id": "U0008", "byKey": "false",
                                                        "deliverMs": str(t0 + 40_000)})
        assert json.loads(later.body)["results"][0]["outcome"] == "RESCHEDULED"

        await clock.advance(3500)  # the master delivers t0..t4 and the 1 s levels
        await async_wait_for(lambda: len(delivered(master, "Promo")) == 10, 10)
        journal_end = lambda: master.store.get_max_offset_in_queue(JOURNAL_TOPIC, 0)  # noqa: E731
        await async_wait_for(lambda: slave.store.max_phy_offset == master.store.max_phy_offset
                             and slave.timer_follower.offset == journal_end(), 10)
        assert slave.timer.count() == 14  # 20 parked - 5 delivered - 1 cancelled (t8 pending, moved)
        slave.timer_follower.offset = 0  # a replay from the start changes nothing
        slave.timer_follower.apply_available()
        assert slave.timer.count() == 14 and slave.timer_follower.skipped == 0
        assert (await slave.slave_sync.sync_all()).errors == {}
    finally:
        await c.close()
        await master.shutdown()  # the master goes away (cleanly: the 0-duplicate case)

    await slave.promote()
    try:
        assert slave.runtime_info()["brokerRole"] == "ASYNC_MASTER"
        assert routes.brokers[slave.config.brokerName].brokerAddrs == {0: slave.broker_addr}
        for _ in range(45):
            await clock.advance(1000)
        want = {f"t{i}" for i in range(20)} - {"t7"} | {f"L{i}" for i in range(10)}
        await async_wait_for(lambda: len(delivered(slave, "Promo")) >= len(want), 10)
        got = delivered(slave, "Promo")
        bodies = [m.body.decode() for m in got]
        assert sorted(bodies) == sorted(want)  # each once: none lost, none twice, the cancelled never
        for m in got:
            due = m.properties.get("TIMER_DELIVER_MS")
            if due is not None:
                assert m.store_timestamp >= int(due), m.body  # never early
        t8 = next(m for m in got if m.body == b"t8")
        assert t8.store_timestamp >= t0 + 40_000
    finally:
        await slave.shutdown()
    # the promotion outlives a restart with the slave's configuration
    again = broker(tmp_path, routes, "s", clock, brokerRole="SLAVE", brokerId="1")
    assert again.config.brokerRole == "ASYNC_MASTER" and again.config.brokerId == 0


async def test_with_slave_read_enabled_a_far_behind_consumer_reads_from_the_slave(tmp_path):
    ns = NameServer("127.0.0.1", free_port(), SystemClock())
    await ns.start()
    master = broker(tmp_path, None, "m", SystemClock(), namesrvAddr=ns.address, slaveReadEnable="true")
    slave = broker(tmp_path, None, "s", SystemClock(), namesrvAddr=ns.address, brokerRole="SLAVE",
                   brokerId="1", slaveReadEnable="true")
    await master.start()
    await slave.start()
    got: list[bytes] = []
    try:
        assert master.processor.pull.slave_read_behind_bytes > 1 << 20  # 40 % of this machine's RAM
        for b in (master, slave):
            b.processor.pull.slave_read_behind_bytes = -1  # all behind
        async with Producer("PG_sre", ns.address) as p:
            for i in range(40):
                await p.send(Message("SlaveRead", f"r{i}".encode()))
        await async_wait_for(lambda: slave.store.max_phy_offset == master.store.max_phy_offset, 10)
        async with PushConsumer("CG_sre", "SlaveRead", lambda m: got.append(m.body), ns.address,
                                consume_from="first", rebalance_interval=0.5, long_poll_timeout=5.0,
                                route_refresh_interval=0.5):
            await async_wait_for(lambda: len(got) == 40, 20, message="every message")
            # the consumer now waits for more on the slave, where the master's answers sent it (its retry
            # topic, never far behind, stays on the master)
            def held(b: BrokerController) -> set[int]:
                return {k[1] for k, w in b.hold._waiters.items() if k[0] == "SlaveRead" and w}

            await async_wait_for(lambda: len(held(slave)) == 4, 10, message="long polls held on the slave")
            assert held(master) == set()
        assert sorted(got) == sorted(f"r{i}".encode() for i in range(40))
    finally:
        await slave.shutdown()
        await master.shutdown()
        await ns.stop()


async def test_a_slave_promotes_itself_only_when_the_name_server_lists_no_master(tmp_path):
    routes = RouteInfoManager()
    clock = VirtualClock()
    master = broker(tmp_path, routes, "m", clock, timerReplication="true")
    slave = broker(tmp_path, routes, "s", clock, brokerRole="SLAVE", brokerId="1",
                   slaveAutoPromoteAfterMs="3000")
    await master.start()
    await slave.start()
    due = clock.now_ms() + 20_000
    c = await AsyncRawClient.connect(master.server.address)
    try:
        r = await c.send_message("Auto", b"later", 0, {"TIMER_DELIVER_MS": str(due)})
        assert r.code == C.SUCCESS
        await async_wait_for(lambda: slave.timer.count() == 1, 10)
    finally:
        await c.close()
        await master.shutdown()  # the link drops; the route still lists the master (no unregister here)
    await async_wait_for(lambda: slave.ha_client is not None and not slave.ha_client.connected, 10)
    for _ in range(6):
        await clock.advance(1000)
    assert slave.config.is_slave  # the name server still names a master: no promotion
    routes.unregister_broker(master.config.brokerClusterName, master.config.brokerName, master.broker_addr, 0)
    try:
        for _ in range(3):
            await clock.advance(1000)
        await async_wait_for(lambda: slave.runtime_info()["brokerRole"] == "ASYNC_MASTER", 10)
        # the promoted broker registers as the master right after (a task of its own)
        await async_wait_for(
            lambda: routes.brokers[slave.config.brokerName].brokerAddrs == {0: slave.broker_addr}, 10)
        await clock.advance_to(due + 100)
        await async_wait_for(lambda: [m.body for m in delivered(slave, "Auto")] == [b"later"], 10)
    finally:
        await slave.shutdown()


async def test_an_empty_slave_copies_a_master_whose_oldest_segments_were_cleaned(tmp_path, caplog):
    routes = RouteInfoManager()
    clock = VirtualClock()
    master = broker(tmp_path, routes, "m", clock, fileReservedTime="1")
    await master.start()
    c = await AsyncRawClient.connect(master.server.address)
    slave = None
    try:
        for i in range(60):  # about 2 KiB each: several 64 KiB segments
            assert (await c.send_message("Old", f"o{i}".encode() * 500, i % 2)).code == C.SUCCESS
        await clock.advance(2 * 3_600_000)  # past fileReservedTime (1 h)
        for i in range(5):
            assert (await c.send_message("New", f"n{i}".encode(), 0)).code == C.SUCCESS
        # the clean keeps a segment whose queue or index entries are not written yet (the broker defers
        # its index writes by a few ms): wait until both cover the whole log
        end = master.store.max_phy_offset
        assert await asyncio.to_thread(master.store.wait_dispatched, end, 30)
        await async_wait_for(lambda: master.store._reput.recover_point() >= end, 30)
        # the broker's own clean thread may have deleted them already (it runs on the virtual clock and
        # reads the real disk use): what matters is that the log no longer starts at 0
        master.store.run_clean_once(force=True)
        oldest = master.store.min_phy_offset
        assert oldest > 0
        with caplog.at_level(logging.INFO, logger="chronomq.ha"):
            slave = broker(tmp_path, routes, "s", clock, brokerRole="SLAVE", brokerId="1")
            await slave.start()
            await async_wait_for(lambda: slave.store.max_phy_offset == master.store.max_phy_offset, 10)
        assert "is empty and this master's log starts at" in caplog.text
        assert slave.store.min_phy_offset == oldest and log_bytes(slave) == log_bytes(master)
        await asyncio.to_thread(slave.store.wait_dispatched, slave.store.max_phy_offset, 5)
        res = slave.store.get_message("New", 0, 0, 10)
        assert [decode_record(r).body for r in res.messages] == [f"n{i}".encode() for i in range(5)]
    finally:
        await c.close()
        if slave is not None:
            await slave.shutdown()
        await master.shutdown()


async def test_stopping_the_ha_client_ends_it_when_the_cancel_meets_the_links_end(tmp_path, monkeypatch):
    """A slave promoted as its master dies stops its HA client in the same loop turn as the link reads the
    master's end-of-file: the cancel must end the client, not be taken for the read's answer."""
    from chronomq.ha.client import HAClient

    class Writer:
        def write(self, data: bytes) -> None:
            pass

        async def drain(self) -> None:
            pass

        def close(self) -> None:
            pass

    readers: list[asyncio.StreamReader] = []

    async def open_connection(host: str, port: int, **kw: Any) -> tuple[asyncio.StreamReader, Writer]:
        readers.append(asyncio.StreamReader())
        return readers[-1], Writer()

    monkeypatch.setattr("chronomq.ha.client.asyncio.open_connection", open_connection)
    config, _ = BrokerConfig.load(None, {"storePathRootDir": str(tmp_path / "s"), "brokerRole": "SLAVE",
                                         "brokerId": "1", "haMasterAddress": "127.0.0.1:1",
                                         "haSendHeartbeatInterval": "60000"})
    store: Any = type("Store", (), {"max_phy_offset": 0})()
    client = HAClient(config, store, VirtualClock())
    client.start()
    await async_wait_for(lambda: readers and readers[0]._waiter is not None, timeout=10)
    stopping = asyncio.ensure_future(client.stop())  # the promotion cancels the client ...
    readers[0].feed_eof()  # ... in the turn the master's end arrives
    task = client._task
    done, _ = await asyncio.wait([stopping], timeout=10)
    assert done, "stop() did not end"
    assert task is not None and task.cancelled()
    assert len(readers) == 1  # it did not go on to link again


async def test_a_slave_reclaims_what_its_master_delivered_and_once_promoted_delivers_the_rest_once(tmp_path):
    """The slave's timer, fed by the journal, reclaims the delivered records of a segment a long delay
    pins (its own retention, after its flush and the follower's saved position); promoted, it delivers the
    long one once and none of the delivered ones again."""
    routes = RouteInfoManager()
    clock = VirtualClock()
    t0 = clock.now_ms()
    timer = {"timerDataSegmentSize": str(256 * 1024), "timerRetentionIntervalMs": "2000"}
    master = broker(tmp_path, routes, "m", clock, timerReplication="true", **timer)
    slave = broker(tmp_path, routes, "s", clock, brokerRole="SLAVE", brokerId="1", **timer)
    await master.start()
    await slave.start()
    c = await AsyncRawClient.connect(master.server.address)
    body = b"." * 1000
    try:
        r = await c.send_message("Reclaim", b"long" + body, 0, {"TIMER_DELIVER_MS": str(t0 + 60_000),
                                                                 "UNIQ_KEY": "ULONG"})
        assert r.code == C.SUCCESS, r.remark
        for i in range(400):  # past the first 256 KiB segment, all due within 2 s
            r = await c.send_message("Reclaim", f"s{i}".encode() + body, i % 4,
                                     {"TIMER_DELIVER_MS": str(t0 + 1000 + i * 2), "UNIQ_KEY": f"U{i:04d}"})
            assert r.code == C.SUCCESS, r.remark
        await clock.advance(2500)
        await async_wait_for(lambda: len(delivered(master, "Reclaim")) == 400, 10)
        journal_end = lambda: master.store.get_max_offset_in_queue(JOURNAL_TOPIC, 0)  # noqa: E731
        await async_wait_for(lambda: slave.timer_follower.offset == journal_end(), 10)
        st = slave.timer.timer
        first = st.data.starts[0]

        async def reclaimed() -> bool:
            await clock.advance(1000)  # the slave's flush, its saved position, then its retention
            return bool(st.data.holes.get(first))

        await async_wait_for(reclaimed, 10, message="the slave reclaimed the delivered records")
        assert st.count() == 1 and first in st.data.starts
        slave.timer_follower.offset = 0  # a replay from the start: parks again what was reclaimed, and
        slave.timer_follower.apply_available()  # the completions journaled after them complete them again
        assert st.count() == 1 and slave.timer_follower.skipped == 0
    finally:
        await c.close()
        await master.shutdown()

    await slave.promote()
    try:
        await clock.advance(60_000 - (clock.now_ms() - t0) + 500)
        await async_wait_for(lambda: any(m.body.startswith(b"long") for m in delivered(slave, "Reclaim")), 10)
        bodies = [m.body for m in delivered(slave, "Reclaim")]
        # the master's 400 deliveries (replicated) and the long one (the promoted slave's): each once
        assert sorted(bodies) == sorted([b"long" + body] + [f"s{i}".encode() + body for i in range(400)])
    finally:
        await slave.shutdown()
