"""Where the official Java client meets RocketMQ's broker behaviour, chronomq behaves the same (each test
names the RocketMQ code it follows): the topics named after the cluster and the broker (TopicConfigManager)
and the Java admin's createTopic through them (MQAdminImpl.createTopic), the name server's topic lists,
CHECK_CLIENT_CONFIG (ClientManageProcessor.checkClientConfig), and the properties of a delivered
delay-level message (ScheduleMessageService.messageTimeup) without a second delay on any re-put path.
A real broker and name server in process, on loopback, driven by the raw-codec client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import async_wait_for, free_port
from tests.integration.rawclient import AsyncRawClient, pull_ext, send_ext

from chronomq.broker.controller import BrokerController
from chronomq.broker.topics import TopicConfigManager
from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.message import SCHEDULE_TOPIC, MessageExt, decode_records
from chronomq.namesrv.server import NameServer
from chronomq.remoting.codes import PERM_INHERIT, PERM_READ, PERM_WRITE
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C

CLUSTER = "DefaultCluster"
BROKER = "broker-a"


class Cluster:
    """A name server and one broker registering with it over TCP, on a virtual clock."""

    def __init__(self, tmp_path: Path, **overrides: str) -> None:
        self.clock = VirtualClock()
        self.ns = NameServer("127.0.0.1", free_port(), self.clock)
        values = {"storePathRootDir": str(tmp_path / "store"), "listenPort": str(free_port()),
                  "haListenPort": str(free_port()), "metricsPort": "-1",
                  "messageDelayLevel": "1s 5s 10s 30s", **overrides}
        self.values = values
        self.clients: list[AsyncRawClient] = []
        self.broker: BrokerController | None = None

    async def start(self) -> None:
        await self.ns.start()
        config, _ = BrokerConfig.load(None, {**self.values, "namesrvAddr": self.ns.address})
        self.broker = BrokerController(config, self.clock)
        await self.broker.start()
        await async_wait_for(lambda: self.ns.routes.topic_route("TBW102") is not None,
                             message="the broker's registration")

    @property
    def b(self) -> BrokerController:
        assert self.broker is not None
        return self.broker

    async def client(self, addr: str) -> AsyncRawClient:
        c = await AsyncRawClient.connect(addr)
        self.clients.append(c)
        return c

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        if self.broker is not None:
            await self.broker.shutdown()
        await self.ns.stop()


@pytest.fixture
async def cluster(tmp_path: Path):
    c = Cluster(tmp_path)
    await c.start()
    yield c
    await c.close()


def _body(resp: Any) -> Any:
    assert resp.code == C.SUCCESS, resp.remark
    return json.loads(resp.body)


# --- 1. the cluster- and broker-named topics ----------------------------------------------------------
def test_cluster_and_broker_topics_are_built_in_with_rocketmqs_shape(tmp_path: Path) -> None:
    rw = PERM_READ | PERM_WRITE
    t = TopicConfigManager(tmp_path, 4, True, 18, lambda: 1, cluster_name=CLUSTER, broker_name=BROKER)
    c, b = t.get(CLUSTER), t.get(BROKER)
    assert c is not None and (c.readQueueNums, c.writeQueueNums, c.perm) == (16, 16, PERM_INHERIT | rw)
    assert b is not None and (b.readQueueNums, b.writeQueueNums, b.perm) == (1, 1, PERM_INHERIT | rw)
    assert {CLUSTER, BROKER} <= set(t.snapshot())  # what goes into the registration
    # disabled: still there (and routed), but neither readable nor writable
    t = TopicConfigManager(tmp_path / "off", 4, True, 18, lambda: 1, cluster_name=CLUSTER,
                           broker_name=BROKER, cluster_topic_enable=False, broker_topic_enable=False)
    assert t.get(CLUSTER).perm == PERM_INHERIT and t.get(BROKER).perm == PERM_INHERIT  # type: ignore[union-attr]
    # system topics as TopicValidator.isSystemTopic sees them on this broker
    for name in (CLUSTER, BROKER, "TBW102", "SCHEDULE_TOPIC_XXXX", "RMQ_SYS_TRACE_TOPIC", "rmq_sys_x"):
        assert t.is_system_topic(name), name
    for name in ("%RETRY%g", "%DLQ%g", "TopicA"):
        assert not t.is_system_topic(name), name


def test_cluster_and_broker_topic_keys_come_from_broker_conf(tmp_path: Path) -> None:
    conf = tmp_path / "broker.conf"
    conf.write_text("clusterTopicEnable=false\nbrokerTopicEnable = false\n")
    config, warnings = BrokerConfig.load(conf)
    assert (config.clusterTopicEnable, config.brokerTopicEnable, warnings) == (False, False, [])
    assert BrokerConfig().clusterTopicEnable and BrokerConfig().brokerTopicEnable


async def test_name_server_routes_the_cluster_and_broker_names(cluster: Cluster) -> None:
    ns = await cluster.client(cluster.ns.address)
    for topic, queues in ((CLUSTER, 16), (BROKER, 1)):
        route = _body(await ns.request(R.GET_ROUTEINFO_BY_TOPIC, {"topic": topic}))
        assert route["brokerDatas"][0]["brokerAddrs"]["0"] == cluster.b.broker_addr
        (qd,) = route["queueDatas"]
        assert (qd["brokerName"], qd["writeQueueNums"], qd["perm"]) == (BROKER, queues, 7)
    # every topic, as RocketMQ's getAllTopicList; the system list tells the cluster and broker names apart
    assert {CLUSTER, BROKER, "TBW102"} <= set(_body(await ns.request(R.GET_ALL_TOPIC_LIST_FROM_NAMESERVER))
                                                ["topicList"])
    system = _body(await ns.request(R.GET_SYSTEM_TOPIC_LIST_FROM_NS))
    assert system == {"topicList": [CLUSTER, BROKER], "brokerAddr": cluster.b.broker_addr}
    by_cluster = _body(await ns.request(R.GET_TOPICS_BY_CLUSTER, {"cluster": CLUSTER}))["topicList"]
    assert {CLUSTER, BROKER, "TBW102"} <= set(by_cluster)
    assert _body(await ns.request(R.GET_TOPICS_BY_CLUSTER, {"cluster": "Nope"})) == {"topicList": []}


def test_delete_topic_in_namesrv_as_rocketmq() -> None:
    """DELETE_TOPIC_IN_NAMESRV (mqadmin deleteTopic's second step): the whole route, or with clusterName
    (5.x) only the queues on that cluster's brokers."""
    from chronomq.namesrv import RouteInfoManager
    from chronomq.remoting.codec import RemotingCommand

    ns = NameServer("127.0.0.1", 0, VirtualClock())
    tc = {"T": {"readQueueNums": 2, "writeQueueNums": 2, "perm": 6}, "U": {"readQueueNums": 1}}
    for cluster, name in (("C1", "b1"), ("C2", "b2")):
        ns.routes.register_broker(cluster, name, f"10.0.0.{name[1]}:10911", 0, "", tc, {"counter": 1}, 0)
    assert isinstance(ns.routes, RouteInfoManager)

    def delete(**ext: str) -> None:
        resp = ns.handle_sync(RemotingCommand.request(R.DELETE_TOPIC_IN_NAMESRV, ext), None)
        assert resp is not None and resp.code == C.SUCCESS

    delete(topic="T", clusterName="C1")
    assert [q["brokerName"] for q in ns.routes.topic_route("T")["queueDatas"]] == ["b2"]  # type: ignore[index]
    delete(topic="T")
    assert ns.routes.topic_route("T") is None and ns.routes.topic_route("U") is not None


async def test_java_admin_create_topic_by_cluster_key_end_to_end(cluster: Cluster) -> None:
    """MQAdminImpl.createTopic(key=clusterName, newTopic, queueNum): the route of the key, then
    UPDATE_AND_CREATE_TOPIC (CreateTopicRequestHeader as MQClientAPIImpl.createTopic fills it) to each
    master of that route; the new topic is then routed."""
    ns = await cluster.client(cluster.ns.address)
    route = _body(await ns.request(R.GET_ROUTEINFO_BY_TOPIC, {"topic": CLUSTER}))
    masters = [bd["brokerAddrs"]["0"] for bd in route["brokerDatas"]]
    assert masters == [cluster.b.broker_addr]
    broker = await cluster.client(masters[0])
    header = {"topic": "JavaAdminTopic", "defaultTopic": CLUSTER, "readQueueNums": "6",
              "writeQueueNums": "6", "perm": "6", "topicFilterType": "SINGLE_TAG", "topicSysFlag": "0",
              "order": "false"}
    resp = await broker.request(R.UPDATE_AND_CREATE_TOPIC, header)
    assert resp.code == C.SUCCESS, resp.remark
    await async_wait_for(lambda: cluster.ns.routes.topic_route("JavaAdminTopic") is not None,
                         message="the new topic's route")
    (qd,) = cluster.ns.routes.topic_route("JavaAdminTopic")["queueDatas"]  # type: ignore[index]
    assert (qd["readQueueNums"], qd["writeQueueNums"], qd["perm"]) == (6, 6, 6)
    # and the topic takes messages
    assert (await broker.send_message("JavaAdminTopic", b"x", 5)).code == C.SUCCESS


async def test_system_topics_cannot_be_created_or_updated(cluster: Cluster) -> None:
    broker = await cluster.client(cluster.b.broker_addr)
    for topic in (CLUSTER, BROKER, "TBW102", "SCHEDULE_TOPIC_XXXX", "rmq_sys_mine"):
        resp = await broker.request(R.UPDATE_AND_CREATE_TOPIC, {"topic": topic, "readQueueNums": "1",
                                                                "writeQueueNums": "1", "perm": "6"})
        assert (resp.code, resp.remark) == (C.SYSTEM_ERROR,
                                            f"The topic[{topic}] is conflict with system topic.")
    assert cluster.b.topics.get(CLUSTER).writeQueueNums == 16  # type: ignore[union-attr]


async def test_cluster_topic_is_a_create_key_even_without_auto_creation(tmp_path: Path) -> None:
    """createTopicInSendMessageMethod: any default topic with INHERIT creates the topic; only TBW102
    depends on autoCreateTopicEnable."""
    c = Cluster(tmp_path, autoCreateTopicEnable="false")
    await c.start()
    try:
        broker = await c.client(c.b.broker_addr)
        resp = await broker.send_message("ViaTbw", b"x", 0)
        assert resp.code == C.TOPIC_NOT_EXIST
        ext = {**send_ext("ViaCluster", 0), "defaultTopic": CLUSTER}
        resp = await broker.request(R.SEND_MESSAGE, ext, b"x")
        assert resp.code == C.SUCCESS, resp.remark
        tc = c.b.topics.get("ViaCluster")
        assert tc is not None and tc.perm == PERM_READ | PERM_WRITE and tc.writeQueueNums == 4
    finally:
        await c.close()


# --- 3. CHECK_CLIENT_CONFIG -------------------------------------------------------------------------
def _check_body(expression_type: str | None, sub: str = "a > 1") -> bytes:
    data: dict[str, Any] = {"topic": "T", "subString": sub, "tagsSet": [], "codeSet": [], "subVersion": 1,
                            "classFilterMode": False}
    if expression_type is not None:
        data["expressionType"] = expression_type
    return json.dumps({"clientId": "127.0.0.1@1", "group": "G", "subscriptionData": data}).encode()


async def test_check_client_config_answers_as_rocketmq_without_property_filter(cluster: Cluster) -> None:
    broker = await cluster.client(cluster.b.broker_addr)
    for expression_type in ("TAG", None, ""):
        resp = await broker.request(R.CHECK_CLIENT_CONFIG, body=_check_body(expression_type, "*"))
        assert resp.code == C.SUCCESS, resp.remark
    resp = await broker.request(R.CHECK_CLIENT_CONFIG, body=json.dumps({"clientId": "x"}).encode())
    assert resp.code == C.SUCCESS  # nothing to check
    resp = await broker.request(R.CHECK_CLIENT_CONFIG, body=_check_body("SQL92"))
    assert (resp.code, resp.remark) == (
        C.SYSTEM_ERROR, "The broker does not support consumer to filter message by SQL92")
    # a pull by SQL92 gets the same answer
    resp = await broker.request(R.PULL_MESSAGE, {**pull_ext("G", "TBW102", 0, 0), "expressionType": "SQL92"})
    assert (resp.code, resp.remark) == (
        C.SYSTEM_ERROR, "The broker does not support consumer to filter message by SQL92")
    # bad bodies: a clear error, and the connection keeps serving
    for body in (b"{not json", b"[1]", json.dumps({"subscriptionData": 3}).encode()):
        resp = await broker.request(R.CHECK_CLIENT_CONFIG, body=body)
        assert resp.code != C.SUCCESS and "CHECK_CLIENT_CONFIG" in resp.remark
    assert (await broker.request(R.CHECK_CLIENT_CONFIG, body=_check_body("TAG"))).code == C.SUCCESS


# --- 2. the DELAY property of a delivered delay-level message ----------------------------------------------
async def _queue(cluster: Cluster, c: AsyncRawClient, topic: str, qid: int, n: int) -> list[MessageExt]:
    """The first ``n`` messages of a queue, once the store has them."""
    store = cluster.b.store
    await async_wait_for(lambda: store.get_max_offset_in_queue(topic, qid) >= n, message=f"{topic}:{qid}")
    resp = await c.pull("G", topic, qid, 0)
    assert resp.code == C.SUCCESS, resp.remark
    return decode_records(resp.body)[:n]


async def test_delivered_level_message_keeps_delay_real_topic_and_real_qid(cluster: Cluster) -> None:
    """ScheduleMessageService.messageTimeup stores the parked properties (DELAY, clamped to the highest
    level on the way in, REAL_TOPIC, REAL_QID) before it clears DELAY for the put's own decision."""
    c = await cluster.client(cluster.b.broker_addr)
    props = {"TAGS": "t", "KEYS": "k", "UNIQ_KEY": "U-D", "user": "v"}
    assert (await c.send_message("DelayT", b"two", 1, {**props, "DELAY": "2"})).code == C.SUCCESS
    assert (await c.send_message("DelayT", b"top", 3, {**props, "DELAY": "9"})).code == C.SUCCESS
    await _queue(cluster, c, SCHEDULE_TOPIC, 3, 1)  # both parked (level 4 is the highest of four)
    assert cluster.b.store.get_max_offset_in_queue("DelayT", 1) == 0
    await cluster.clock.advance(30_000)
    (two,) = await _queue(cluster, c, "DelayT", 1, 1)
    (top,) = await _queue(cluster, c, "DelayT", 3, 1)
    for m, level, qid in ((two, "2", "1"), (top, "4", "3")):
        # plus what the broker stamps on every send; the level service's marker is not handed out
        assert m.properties == {**props, "DELAY": level, "REAL_TOPIC": "DelayT", "REAL_QID": qid,
                                "CLUSTER": CLUSTER, "MSG_REGION": "DefaultRegion", "TRACE_ON": "true"}
    # the delivered copy stays where it is: nothing parked again
    await cluster.clock.advance(60_000)
    assert cluster.b.store.get_max_offset_in_queue(SCHEDULE_TOPIC, 1) == 1
    assert cluster.b.store.get_max_offset_in_queue("DelayT", 1) == 1


async def test_a_delivered_copy_sent_back_is_not_delayed_by_its_old_level(cluster: Cluster) -> None:
    """CONSUMER_SEND_MSG_BACK sets its own level (SendMessageProcessor.asyncConsumerSendMsgBack): the retry
    ladder's (3 + reconsume times, not the copy's DELAY), or 0 into the DLQ, which takes it at once."""
    c = await cluster.client(cluster.b.broker_addr)
    assert (await c.send_message("Back", b"x", 0, {"DELAY": "1"})).code == C.SUCCESS
    await cluster.clock.advance(1_000)
    (m,) = await _queue(cluster, c, "Back", 0, 1)
    assert m.properties["DELAY"] == "1"
    back = {"group": "G", "offset": str(m.commit_log_offset), "delayLevel": "0"}
    assert (await c.request(R.CONSUMER_SEND_MSG_BACK, back)).code == C.SUCCESS
    (retry,) = await _queue(cluster, c, SCHEDULE_TOPIC, 2, 1)  # level 3 (queue 2), not the copy's 1
    assert (retry.properties["DELAY"], retry.properties["REAL_TOPIC"]) == ("3", "%RETRY%G")
    resp = await c.request(R.CONSUMER_SEND_MSG_BACK, {**back, "maxReconsumeTimes": "0"})
    assert resp.code == C.SUCCESS
    (dead,) = await _queue(cluster, c, "%DLQ%G", 0, 1)  # no clock advance: not parked
    assert dead.properties["DELAY"] == "0" and dead.body == b"x"
    assert cluster.b.store.get_max_offset_in_queue(SCHEDULE_TOPIC, 0) == 1  # only the original


async def test_a_retry_send_diverted_to_the_dlq_is_not_parked(cluster: Cluster) -> None:
    """The Java consumer's fallback when the send-back fails: SEND_MESSAGE to %RETRY%<group> with DELAY =
    3 + reconsume times; past the limit the broker diverts it to the DLQ with level 0 (handleRetryAndDLQ)."""
    c = await cluster.client(cluster.b.broker_addr)
    ext = send_ext("%RETRY%G", 0, {"DELAY": "3", "UNIQ_KEY": "U-R"}, reconsume=16)
    assert (await c.request(R.SEND_MESSAGE, ext, b"late")).code == C.SUCCESS
    (dead,) = await _queue(cluster, c, "%DLQ%G", 0, 1)
    assert dead.properties["DELAY"] == "0" and dead.body == b"late"
    assert cluster.b.store.get_max_offset_in_queue(SCHEDULE_TOPIC, 2) == 0
