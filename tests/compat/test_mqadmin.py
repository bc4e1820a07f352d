"""Apache RocketMQ's own admin tool, mqadmin (rocketmq-tools 5.3.3, MQAdminStartup), through its real
command line against one chronomq: every command docs/compat.md's "mqadmin" table lists, with what it
prints. mqadmin exits 0 even when a command fails, so each test reads the output. A JVM start costs about
a second of CPU and each command waits ~3 s in the tool's own shutdown, so independent commands run
side by side."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from chronomq.client import SUCCESS, Admin, Message, Producer, PushConsumer, ReceivedMessage
from chronomq.remoting import fastjson
from chronomq.remoting.codes import RequestCode
from tests.compat.harness import ChronomqProcess, CompatUnavailable, RawClient
from tests.compat.reference import (
    _LOGBACK,
    REFERENCE_POM,
    ROCKETMQ4,
    ROCKETMQ5,
    Release,
    java_tools,
    maven_classpath,
)
from tests.conftest import wait_for

pytestmark = pytest.mark.compat

MAIN = "org.apache.rocketmq.tools.command.MQAdminStartup"
PARALLEL = 7  # commands at once: each spends most of its ~4 s waiting, not on the CPU


class MQAdmin:
    """``run(cmd, *args)`` runs one mqadmin command with ``-n`` set and returns what it printed."""

    def __init__(self, java: str, classpath: str, namesrv: str, home: Path) -> None:
        self.namesrv = namesrv
        (home / "conf").mkdir(parents=True, exist_ok=True)  # 4.x reads its logging setup from there
        (home / "conf" / "logback_tools.xml").write_text(_LOGBACK.format(file=home / "logs" / "tools.log"))
        self.cmd = [java, "-Xms64m", "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                    "-XX:-UsePerfData", f"-Duser.home={home}", f"-Drocketmq.home.dir={home}",
                    f"-Drocketmq.client.logRoot={home / 'logs'}", "-cp", classpath, MAIN]

    def run(self, command: str, *args: str) -> str:
        r = subprocess.run([*self.cmd, command, "-n", self.namesrv, *args], capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL)
        return r.stdout + r.stderr

    def run_all(self, commands: Sequence[Sequence[str]]) -> list[str]:
        with ThreadPoolExecutor(PARALLEL) as pool:
            return list(pool.map(lambda c: self.run(*c), commands))


def _ok(out: str) -> str:
    assert "Exception" not in out, out[-3000:]
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChronomqProcess]:
    with ChronomqProcess(tmp_path_factory.mktemp("mqadmin") / "data") as p:
        yield p


def _mqadmin(release: Release, server: ChronomqProcess, tmp_path_factory: pytest.TempPathFactory) -> MQAdmin:
    try:
        java, _ = java_tools()
        cp = maven_classpath(REFERENCE_POM, release.profile)
    except CompatUnavailable as e:
        pytest.skip(str(e))
    return MQAdmin(java, cp, server.namesrv_addr, tmp_path_factory.mktemp(f"mqadmin-{release.name}"))


@pytest.fixture(scope="module")
def mqadmin(server: ChronomqProcess, tmp_path_factory: pytest.TempPathFactory) -> MQAdmin:
    return _mqadmin(ROCKETMQ5, server, tmp_path_factory)


def _broker_config(server: ChronomqProcess) -> dict[str, str]:
    with RawClient(server.broker_addr) as c:
        resp = c.call(RequestCode.GET_BROKER_CONFIG)
    assert resp.code == 0, resp.remark
    return dict(line.split("=", 1) for line in resp.body.decode().splitlines() if "=" in line)


def _collect(got: list[bytes]) -> Any:
    """A consumer listener that keeps the bodies it is given."""
    def on(msg: ReceivedMessage) -> Any:
        got.append(msg.body)
        return SUCCESS
    return on


def _online_producers(server: ChronomqProcess, group: str) -> bool:
    with RawClient(server.broker_addr) as c:
        return c.call(RequestCode.GET_PRODUCER_CONNECTION_LIST, {"producerGroup": group}).code == 0


def _columns(out: str, first: str) -> list[list[str]]:
    """The rows of a printed table whose first column is ``first``, split on white space."""
    return [line.split() for line in out.splitlines() if line.split()[:1] == [first]]


# --- cluster, broker, configuration ----------------------------------------------------------------------
def test_cluster_broker_status_and_broker_config(server: ChronomqProcess, mqadmin: MQAdmin) -> None:
    b = server.broker_addr
    clusters, status, config, topics, changed, refused, bad = mqadmin.run_all([
        ("clusterList",), ("brokerStatus", "-b", b), ("getBrokerConfig", "-b", b), ("topicList",),
        ("updateBrokerConfig", "-b", b, "-k", "maxReconsumeTimes", "-v", "5"),
        ("updateBrokerConfig", "-c", "DefaultCluster", "-k", "listenPort", "-v", "1"),
        ("updateBrokerConfig", "-b", b, "-k", "fileReservedTime", "-v", "soon")])
    rows = [r[:4] for r in _columns(_ok(clusters), "DefaultCluster")]
    assert rows == [["DefaultCluster", "broker-a", "0", b]]
    assert "brokerVersionDesc" in _ok(status) and "chronomq" in status and "ASYNC_MASTER" in status
    assert any(line.split() == ["brokerName", "=", "broker-a"] for line in _ok(config).splitlines())
    assert {"TBW102", "DefaultCluster", "broker-a"} <= set(_ok(topics).split())

    assert f"update broker config success, {b}" in _ok(changed)
    assert "CODE: 16  DESC: chronomq cannot change listenPort while running" in refused
    assert "fileReservedTime: 'soon' is not an integer" in bad
    conf = _broker_config(server)
    assert conf["maxReconsumeTimes"] == "5" and conf["listenPort"] == str(server.broker_port)


# --- topics ----------------------------------------------------------------------------------------------
def test_topic_create_route_status_delete(server: ChronomqProcess, mqadmin: MQAdmin) -> None:
    created = mqadmin.run_all([
        ("updateTopic", "-c", "DefaultCluster", "-t", "MqaTopic", "-r", "3", "-w", "3"),
        ("updateTopic", "-b", server.broker_addr, "-t", "MqaGone")])
    assert all("success" in _ok(out) for out in created)
    assert "readQueueNums=3, writeQueueNums=3" in created[0]
    route, status, deleted = mqadmin.run_all([
        ("topicRoute", "-t", "MqaTopic"), ("topicStatus", "-t", "MqaTopic"),
        ("deleteTopic", "-c", "DefaultCluster", "-t", "MqaGone")])
    data = fastjson.loads(_ok(route)[route.index("{"):])
    assert [q["readQueueNums"] for q in data["queueDatas"]] == [3]
    assert data["brokerDatas"][0]["brokerAddrs"] == {"0": server.broker_addr}
    rows = [r[:4] for r in _columns(_ok(status), "broker-a")]
    assert rows == [["broker-a", str(q), "0", "0"] for q in range(3)]  # broker, queue, min, max
    assert "delete topic [MqaGone] from NameServer success." in _ok(deleted)
    with Admin(server.namesrv_addr) as admin:
        assert "MqaGone" not in admin.list_topics() and "MqaTopic" in admin.list_topics()


# --- messages ----------------------------------------------------------------------------------------------
def test_query_and_print_messages(server: ChronomqProcess, mqadmin: MQAdmin) -> None:
    with Producer("MqaPG", server.namesrv_addr) as p:
        sent = [p.send(Message("MqaMsg", f"body-{i}".encode(), keys=f"key-{i}", tags="tg")) for i in range(3)]
    one = sent[1]
    by_id, by_key, by_unique, by_offset, printed = mqadmin.run_all([
        ("queryMsgById", "-t", "MqaMsg", "-i", one.offset_msg_id),
        ("queryMsgByKey", "-t", "MqaMsg", "-k", "key-1"),
        ("queryMsgByUniqueKey", "-t", "MqaMsg", "-i", one.msg_id),
        ("queryMsgByOffset", "-t", "MqaMsg", "-b", "broker-a", "-i", str(one.queue.queue_id),
         "-o", str(one.queue_offset)),
        ("printMsg", "-t", "MqaMsg")])
    for out in (by_id, by_unique, by_offset):
        assert "Keys:                [key-1]" in _ok(out) and "Topic:               MqaMsg" in out
        path = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Message Body Path:"))
        assert Path(path).read_bytes() == b"body-1"  # where the tool writes the body
    assert [r[0] for r in _columns(_ok(by_key), one.msg_id)] == [one.msg_id]
    assert all(f"BODY: body-{i}" in _ok(printed) for i in range(3))


# --- groups, connections, progress, stats --------------------------------------------------------------
def test_groups_connections_progress_and_stats(server: ChronomqProcess, mqadmin: MQAdmin) -> None:
    kept, gone = mqadmin.run_all([("updateSubGroup", "-c", "DefaultCluster", "-g", "MqaGroup"),
                                  ("updateSubGroup", "-b", server.broker_addr, "-g", "MqaGone", "-r", "3")])
    assert "create subscription group to" in _ok(kept) and "groupName=MqaGone" in _ok(gone)
    assert "retryMaxTimes=3" in gone
    got: list[bytes] = []
    on = _collect(got)
    ns = server.namesrv_addr
    with Producer("MqaPG2", ns, heartbeat_interval=0.2) as p, Admin(ns) as admin, \
            PushConsumer("MqaGroup", {"MqaFlow": "*"}, on, server.namesrv_addr, consume_from="first",
                         offset_commit_interval=0.2, rebalance_interval=0.5) as consumer:
        for i in range(4):
            p.send(Message("MqaFlow", f"f{i}".encode()))
        wait_for(lambda: sum(max(0, r.consumer_offset)
                             for r in admin.group_progress("MqaGroup", "MqaFlow")) == 4,
                 message="4 consumed and committed")
        wait_for(lambda: _online_producers(server, "MqaPG2"), message="the producer's heartbeat")
        client_id = consumer.client_id
        progress, with_ip, connections, status, producers, stats, deleted = mqadmin.run_all([
            ("consumerProgress", "-g", "MqaGroup"), ("consumerProgress", "-g", "MqaGroup", "-s", "true"),
            ("consumerConnection", "-g", "MqaGroup"), ("consumerStatus", "-g", "MqaGroup", "-i", client_id),
            ("producerConnection", "-g", "MqaPG2", "-t", "MqaFlow"), ("statsAll", "-t", "MqaFlow"),
            ("deleteSubGroup", "-c", "DefaultCluster", "-g", "MqaGone")])
    rows = _columns(_ok(progress), "MqaFlow")
    assert sum(int(r[3]) for r in rows) == 4 and sum(int(r[4]) for r in rows) == 4  # broker, consumer offsets
    assert {r[5] for r in _columns(_ok(with_ip), "MqaFlow")} == {client_id.split("@")[0]}
    assert [r[2] for r in _columns(_ok(connections), client_id)] == ["PYTHON"]
    assert "MessageModel: CLUSTERING" in connections
    assert "ConsumeFromWhere: CONSUME_FROM_FIRST_OFFSET" in connections
    assert "#Consumer Properties#" in _ok(status) and "PROP_CONSUMEORDERLY" in status
    assert len([r for r in _columns(status, "MqaFlow") if "ProcessQueueInfo" in r[3]]) == 4  # its queues
    assert "PYTHON" in _ok(producers)
    row = _columns(_ok(stats), "MqaFlow")[0]
    assert row[1] == "MqaGroup" and row[-2:] == ["4", "4"]  # in and out since the broker started
    assert "delete subscription group [MqaGone]" in _ok(deleted)
    with RawClient(server.broker_addr) as c:
        body = c.call(RequestCode.GET_ALL_SUBSCRIPTIONGROUP_CONFIG).body
    table = json.loads(body)["subscriptionGroupTable"]
    assert "MqaGroup" in table and "MqaGone" not in table


# --- reset by time ---------------------------------------------------------------------------------------
def test_reset_offset_by_time_moves_an_online_consumer(server: ChronomqProcess, mqadmin: MQAdmin) -> None:
    got: list[bytes] = []
    on = _collect(got)
    with Producer("MqaPG3", server.namesrv_addr) as p:
        for i in range(3):
            p.send(Message("MqaReset", f"old{i}".encode()))
        middle = int(time.time() * 1000) + 1  # after every old message was stored, before any new one
        wait_for(lambda: time.time() * 1000 >= middle, message="the reset point")
        for i in range(3):
            p.send(Message("MqaReset", f"new{i}".encode()))
    with PushConsumer("MqaResetG", {"MqaReset": "*"}, on, server.namesrv_addr, consume_from="first",
                      offset_commit_interval=0.2, rebalance_interval=0.5):
        wait_for(lambda: len(got) == 6, message="6 consumed")
        reset, unknown = mqadmin.run_all([
            ("resetOffsetByTime", "-g", "MqaResetG", "-t", "MqaReset", "-s", str(middle)),
            ("resetOffsetByTime", "-g", "MqaNoGroup", "-t", "MqaReset", "-s", "now")])
        wait_for(lambda: len(got) == 9, message="the 3 messages after the reset point again")
    assert sorted(got[6:]) == [b"new0", b"new1", b"new2"]
    assert "start reset consumer offset by specified, group[MqaResetG], topic[MqaReset]" in _ok(reset)
    assert len(_columns(reset, "broker-a")) == 4
    assert "CODE: 26  DESC: Group MqaNoGroup does not exist" in unknown


# --- the 4.9.7 tool --------------------------------------------------------------------------------------
def test_rocketmq4_tool_cluster_config_groups_progress_and_reset(
        server: ChronomqProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    """mqadmin of rocketmq-tools 4.9.7: the commands whose requests or output differ from 5.3's."""
    mqadmin4 = _mqadmin(ROCKETMQ4, server, tmp_path_factory)
    got: list[bytes] = []
    on = _collect(got)
    with Producer("Mqa4PG", server.namesrv_addr) as p:
        for i in range(3):
            p.send(Message("Mqa4T", f"m{i}".encode()))
    with Admin(server.namesrv_addr) as admin, \
            PushConsumer("Mqa4G", {"Mqa4T": "*"}, on, server.namesrv_addr, consume_from="first",
                         offset_commit_interval=0.2, rebalance_interval=0.5):
        wait_for(lambda: len(got) == 3 and sum(max(0, r.consumer_offset)
                                               for r in admin.group_progress("Mqa4G", "Mqa4T")) == 3,
                 message="3 consumed and committed")
        clusters, config, group, progress, stats = mqadmin4.run_all([
            ("clusterList",), ("getBrokerConfig", "-b", server.broker_addr),
            ("updateSubGroup", "-b", server.broker_addr, "-g", "Mqa4Other"),
            ("consumerProgress", "-g", "Mqa4G"), ("statsAll", "-t", "Mqa4T")])
        reset = mqadmin4.run("resetOffsetByTime", "-g", "Mqa4G", "-t", "Mqa4T", "-s", "0")
        assert "rollback consumer offset by specified group[Mqa4G]" in _ok(reset)
        try:
            wait_for(lambda: len(got) == 6, timeout=30, message="the 3 messages again after the reset")
        except BaseException:  # what the tool printed and what the broker did, to tell which side missed
            print(reset, f"received: {got}", "--- broker log ---", server.log_tail(6000), sep="\n")
            raise
    assert [r[:4] for r in _columns(_ok(clusters), "DefaultCluster")] == [
        ["DefaultCluster", "broker-a", "0", server.broker_addr]]
    assert any(line.split() == ["brokerName", "=", "broker-a"] for line in _ok(config).splitlines())
    assert "create subscription group to" in _ok(group)
    assert sum(int(r[4]) for r in _columns(_ok(progress), "Mqa4T")) == 3
    assert _columns(_ok(stats), "Mqa4T")[0][-2:] == ["3", "3"]
    assert sorted(got[3:]) == [b"m0", b"m1", b"m2"]
