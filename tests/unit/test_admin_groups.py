"""The broker's answers to RocketMQ's admin tools about groups, configuration and offsets (codes 200, 201,
207, 352, 203, 204, 208, 300, 222, 307, 25, 26, 315), the subscription-group table and its file, and the
offset reset by time reaching an online chronomq PushConsumer. In process, on loopback, a virtual clock."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import async_wait_for
from tests.integration.rawclient import AsyncRawClient, heartbeat_body
from tests.unit import test_broker_processors, test_rocketmq_parity
from tests.unit.test_broker_processors import Env, _dispatched
from tests.unit.test_rocketmq_parity import Cluster

from chronomq.broker.subgroups import (
    SubscriptionGroupConfig,
    SubscriptionGroupError,
    SubscriptionGroupManager,
)
from chronomq.cli.main import main
from chronomq.client import SUCCESS, Admin, Message, MessageQueue, Producer, PushConsumer, ReceivedMessage
from chronomq.config import parse_properties
from chronomq.remoting import fastjson
from chronomq.remoting.codec import encode
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C

env = test_broker_processors.env  # the fixtures of those modules, shared
cluster = test_rocketmq_parity.cluster


def _ok(resp: Any) -> Any:
    assert resp.code == C.SUCCESS, resp.remark
    return fastjson.loads(resp.body) if resp.body else None


def _mq(key: str) -> tuple[str, str, int]:
    q = json.loads(key)
    return q["topic"], q["brokerName"], q["queueId"]


async def _heartbeat(c: AsyncRawClient, client_id: str, group: str, topics: list[str]) -> None:
    _ok(await c.request(R.HEART_BEAT, body=heartbeat_body(client_id, group, topics)))


async def _send(env: Env, c: AsyncRawClient, topic: str, n: int, queue_id: int = 0) -> None:
    for i in range(n):
        _ok(await c.send_message(topic, f"m{i}".encode(), queue_id))
    await _dispatched(env)


# --- the table and its file ----------------------------------------------------------------------------
def test_subscription_group_table_persists_round_trips_and_refuses_bad_configs(tmp_path: Path) -> None:
    auto = [True]
    m = SubscriptionGroupManager(tmp_path, lambda: 5, lambda: auto[0])
    assert m.get("TOOLS_CONSUMER") is not None and m.get("CID_RMQ_SYS_TRANS") is not None
    cfg = SubscriptionGroupConfig.from_json({"groupName": "G1", "consumeMessageOrderly": True,
                                             "retryMaxTimes": 3, "groupRetryPolicy": {"type": "EXPONENTIAL"},
                                             "someNewKey": 7})
    m.update(cfg)
    assert m.find("G2") is not None  # auto-created
    auto[0] = False
    assert m.find("G3") is None and "G3" not in m
    assert m.find("bad name") is None
    again = SubscriptionGroupManager(tmp_path, lambda: 6)
    g1 = again.get("G1")
    assert g1 is not None and g1.consumeMessageOrderly and g1.retryMaxTimes == 3
    assert g1.to_json()["groupRetryPolicy"] == {"type": "EXPONENTIAL"} and g1.to_json()["someNewKey"] == 7
    assert again.get("G2") is not None and again.data_version["counter"] == 2
    assert again.delete("G2") and not again.delete("G2")
    assert SubscriptionGroupManager(tmp_path, lambda: 7).get("G2") is None
    with pytest.raises(SubscriptionGroupError, match="not a boolean"):
        SubscriptionGroupConfig.from_json({"groupName": "G", "consumeEnable": "yes"})
    with pytest.raises(SubscriptionGroupError, match="not an integer"):
        SubscriptionGroupConfig.from_json({"groupName": "G", "retryMaxTimes": True})
    with pytest.raises(SubscriptionGroupError, match="no groupName"):
        SubscriptionGroupConfig.from_json({"consumeEnable": True})
    with pytest.raises(SubscriptionGroupError, match="characters outside"):
        m.update(SubscriptionGroupConfig("a b"))


# --- subscription groups over the wire -----------------------------------------------------------------
async def test_subscription_groups_created_by_heartbeat_and_admin_then_deleted(env: Env) -> None:
    c = await env.client()
    await _heartbeat(c, "cid-1", "GA", ["T"])
    services = env.broker.services
    assert services.subscription_group("GA") is not None
    assert not services.subscription_group("GA").consumeMessageOrderly  # type: ignore[union-attr]
    body = json.dumps({"groupName": "GO", "consumeMessageOrderly": True, "retryQueueNums": 2}).encode()
    _ok(await c.request(R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, body=body))
    assert services.subscription_group("GO").consumeMessageOrderly  # type: ignore[union-attr]
    table = _ok(await c.request(R.GET_ALL_SUBSCRIPTIONGROUP_CONFIG))["subscriptionGroupTable"]
    assert {"GA", "GO", "TOOLS_CONSUMER"} <= set(table) and table["GO"]["retryQueueNums"] == 2
    one = _ok(await c.request(R.GET_SUBSCRIPTIONGROUP_CONFIG, {"group": "GO"}))
    assert one["groupName"] == "GO" and one["consumeMessageOrderly"] is True
    out = await c.request(R.GET_SUBSCRIPTIONGROUP_CONFIG, {"group": "nope"})
    assert out.code == C.SUBSCRIPTION_GROUP_NOT_EXIST
    bad = await c.request(R.UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, body=b'{"groupName": "x y"}')
    assert bad.code == C.SYSTEM_ERROR and "characters outside" in (bad.remark or "")
    _ok(await c.request(R.UPDATE_CONSUMER_OFFSET, {"consumerGroup": "GO", "topic": "T", "queueId": 0,
                                                   "commitOffset": 3}))
    _ok(await c.request(R.DELETE_SUBSCRIPTIONGROUP, {"groupName": "GO", "cleanOffset": "true"}))
    assert services.subscription_group("GO") is None and services.offsets.query("GO", "T", 0) == -1
    saved = json.loads((Path(env.config.storePathRootDir) / "config" / "subscriptionGroup.json").read_text())
    assert "GA" in saved["subscriptionGroupTable"] and "GO" not in saved["subscriptionGroupTable"]


async def test_no_group_is_created_by_heartbeat_when_auto_create_is_off(tmp_path: Path) -> None:
    e = Env(tmp_path, {"autoCreateSubscriptionGroup": "false"})
    await e.broker.start()
    try:
        c = await e.client()
        await _heartbeat(c, "cid-1", "GA", ["T"])
        assert e.broker.services.subscription_group("GA") is None
    finally:
        await e.close()


# --- connections, who consumes, consume stats ----------------------------------------------------------
async def test_connections_consumers_of_a_topic_and_consume_stats(env: Env) -> None:
    c = await env.client()
    out = await c.request(R.GET_CONSUMER_CONNECTION_LIST, {"consumerGroup": "GA"})
    assert out.code == C.CONSUMER_NOT_ONLINE
    await _heartbeat(c, "cid-1", "GA", ["T"])
    hb = json.dumps({"clientID": "cid-p", "producerDataSet": [{"groupName": "PG"}]}).encode()
    _ok(await c.request(R.HEART_BEAT, body=hb))
    cc = _ok(await c.request(R.GET_CONSUMER_CONNECTION_LIST, {"consumerGroup": "GA"}))
    assert [x["clientId"] for x in cc["connectionSet"]] == ["cid-1"]
    assert cc["connectionSet"][0]["language"] == "PYTHON" and ":" in cc["connectionSet"][0]["clientAddr"]
    assert set(cc["subscriptionTable"]) == {"T"}
    assert (cc["consumeType"], cc["messageModel"], cc["consumeFromWhere"]) == (
        "CONSUME_PASSIVELY", "CLUSTERING", "CONSUME_FROM_LAST_OFFSET")
    pc = _ok(await c.request(R.GET_PRODUCER_CONNECTION_LIST, {"producerGroup": "PG"}))
    assert [x["clientId"] for x in pc["connectionSet"]] == ["cid-p"]
    assert (await c.request(R.GET_PRODUCER_CONNECTION_LIST, {"producerGroup": "none"})).code == C.SYSTEM_ERROR

    _ok(await c.request(R.UPDATE_AND_CREATE_TOPIC, {"topic": "T", "readQueueNums": 2, "writeQueueNums": 2}))
    await _send(env, c, "T", 3, queue_id=1)
    _ok(await c.request(R.UPDATE_CONSUMER_OFFSET, {"consumerGroup": "GB", "topic": "T", "queueId": 1,
                                                   "commitOffset": 2}))
    who = _ok(await c.request(R.QUERY_TOPIC_CONSUME_BY_WHO, {"topic": "T"}))
    assert who["groupList"] == ["GA", "GB"]
    stats = _ok(await c.request(R.GET_CONSUME_STATS, {"consumerGroup": "GB"}))
    rows = {_mq(k): v for k, v in stats["offsetTable"].items()}
    q1 = rows[("T", "broker-a", 1)]
    assert (q1["brokerOffset"], q1["consumerOffset"], q1["lastTimestamp"]) == (3, 2, env.clock.now_ms())
    assert rows[("T", "broker-a", 0)] == {"brokerOffset": 0, "consumerOffset": 0, "pullOffset": 0,
                                          "lastTimestamp": 0}
    # an online group's stats keep only the topics it subscribes to
    stats = _ok(await c.request(R.GET_CONSUME_STATS, {"consumerGroup": "GA", "topic": "Other"}))
    assert stats["offsetTable"] == {}


# --- offset reset by time ------------------------------------------------------------------------------
async def test_reset_offset_by_time_commits_answers_and_pushes_to_online_clients(env: Env) -> None:
    c = await env.client()
    _ok(await c.request(R.UPDATE_AND_CREATE_TOPIC, {"topic": "T", "readQueueNums": 2, "writeQueueNums": 2}))
    await _send(env, c, "T", 2)
    await env.clock.advance(1000)
    middle = env.clock.now_ms()
    await _send(env, c, "T", 3)
    await _heartbeat(c, "cid-1", "G", ["T"])
    for q, off in ((0, 5), (1, 0)):
        _ok(await c.request(R.UPDATE_CONSUMER_OFFSET, {"consumerGroup": "G", "topic": "T", "queueId": q,
                                                       "commitOffset": off}))
    ext = {"topic": "T", "group": "G", "timestamp": middle, "isForce": "true", "offset": -1}
    body = _ok(await c.request(R.INVOKE_BROKER_TO_RESET_OFFSET, ext))
    assert {_mq(k): v for k, v in body["offsetTable"].items()} == {("T", "broker-a", 0): 2,
                                                                   ("T", "broker-a", 1): 0}
    assert env.broker.offsets.query("G", "T", 0) == 2
    await async_wait_for(lambda: any(r.code == R.RESET_CONSUMER_CLIENT_OFFSET for r in c.server_requests),
                         message="the reset pushed to the online client")
    push = next(r for r in c.server_requests if r.code == R.RESET_CONSUMER_CLIENT_OFFSET)
    assert push.is_oneway and push.ext_fields["group"] == "G" and push.ext_fields["topic"] == "T"
    assert fastjson.loads(push.body) == body
    # without force a queue moves only back; timestamp -1 is the end of each queue
    body = _ok(await c.request(R.INVOKE_BROKER_TO_RESET_OFFSET, {**ext, "timestamp": -1, "isForce": "false"}))
    assert sorted(body["offsetTable"].values()) == [0, 2]
    body = _ok(await c.request(R.INVOKE_BROKER_TO_RESET_OFFSET, {**ext, "timestamp": -1}))
    assert sorted(body["offsetTable"].values()) == [0, 5]
    # one queue to an offset (mqadmin resetOffsetByTime -b -q -o)
    body = _ok(await c.request(R.INVOKE_BROKER_TO_RESET_OFFSET, {**ext, "queueId": 0, "offset": 1}))
    assert list(body["offsetTable"].values()) == [1]
    body = _ok(await c.request(R.INVOKE_BROKER_TO_RESET_OFFSET, {**ext, "queueId": 0, "offset": 4,
                                                                 "isForce": "false"}))
    assert list(body["offsetTable"].values()) == [4]  # a given offset moves forward too
    out = await c.request(R.INVOKE_BROKER_TO_RESET_OFFSET, {**ext, "queueId": 0, "offset": 9})
    assert out.code == C.SYSTEM_ERROR and "not in consume queue range [0-5]" in (out.remark or "")
    out = await c.request(R.INVOKE_BROKER_TO_RESET_OFFSET, {**ext, "topic": "Nope"})
    assert out.code == C.TOPIC_NOT_EXIST
    out = await c.request(R.INVOKE_BROKER_TO_RESET_OFFSET, {**ext, "group": "Nope"})
    assert out.code == C.SUBSCRIPTION_GROUP_NOT_EXIST and out.remark == "Group Nope does not exist"


async def test_consumer_running_info_is_asked_of_the_consumer(env: Env) -> None:
    c = await env.client()
    admin = await env.client()
    await _heartbeat(c, "cid-1", "G", ["T"])
    ext = {"consumerGroup": "G", "clientId": "cid-1", "jstackEnable": "false"}
    answer = admin.start(R.GET_CONSUMER_RUNNING_INFO, ext)
    relayed: Any = await async_wait_for(
        lambda: [r for r in c.server_requests if r.code == R.GET_CONSUMER_RUNNING_INFO],
        message="the request relayed to the consumer")
    asked = relayed[0]
    assert asked.ext_fields["clientId"] == "cid-1" and not asked.is_oneway
    c.send_raw(encode(asked.response(body=b'{"properties":{"x":"1"}}')))
    assert _ok(await asyncio.wait_for(answer, 10)) == {"properties": {"x": "1"}}
    out = await admin.request(R.GET_CONSUMER_RUNNING_INFO, {**ext, "clientId": "gone"})
    assert out.code == C.SYSTEM_ERROR and out.remark == "The Consumer <G> <gone> not online"


# --- broker config and stats ---------------------------------------------------------------------------
async def test_broker_config_read_and_changed_at_run_time_only_where_safe(env: Env) -> None:
    c = await env.client()
    resp = await c.request(R.GET_BROKER_CONFIG)
    props = parse_properties(resp.body.decode())
    assert props["brokerName"] == "broker-a" and props["longPollingEnable"] == "true"
    assert json.loads(resp.ext_fields["version"])["counter"] == 0
    _ok(await c.request(R.UPDATE_BROKER_CONFIG, body=b"maxReconsumeTimes=3\nlongPollingEnable=false\n"))
    assert env.config.maxReconsumeTimes == 3 and env.config.longPollingEnable is False
    out = await c.request(R.UPDATE_BROKER_CONFIG, body=b"maxReconsumeTimes=4\nlistenPort=1\n")
    assert out.code == C.NO_PERMISSION and "cannot change listenPort while running" in (out.remark or "")
    assert env.config.maxReconsumeTimes == 3
    out = await c.request(R.UPDATE_BROKER_CONFIG, body=b"maxReconsumeTimes=x\n")
    assert out.code == C.SYSTEM_ERROR and "not an integer" in (out.remark or "")
    version = json.loads((await c.request(R.GET_BROKER_CONFIG)).ext_fields["version"])
    assert version["counter"] == 1


async def test_broker_stats_and_runtime_figures_count_since_start(env: Env) -> None:
    c = await env.client()
    await _send(env, c, "T", 4)
    await env.clock.advance(2000)
    stats = _ok(await c.request(R.VIEW_BROKER_STATS_DATA, {"statsName": "TOPIC_PUT_NUMS", "statsKey": "T"}))
    assert stats["statsDay"]["sum"] == 4 and stats["statsMinute"]["tps"] == 2.0
    out = await c.request(R.VIEW_BROKER_STATS_DATA, {"statsName": "GROUP_GET_NUMS", "statsKey": "T@G"})
    assert out.code == C.SYSTEM_ERROR and out.remark == "The stats <GROUP_GET_NUMS> <T@G> not exist"
    # the runtime keys RocketMQ's clusterList reads (4.9's fails without putTps)
    table = _ok(await c.request(R.GET_BROKER_RUNTIME_INFO))["table"]
    assert table["putTps"] == "2.00 2.00 2.00" and table["getTransferedTps"] == "0.00 0.00 0.00"
    assert table["sendThreadPoolQueueSize"] == "0" and table["brokerActive"] == "true"
    assert int(table["earliestMessageTimeStamp"]) == env.clock.now_ms() - 2000


# --- an online PushConsumer jumps ----------------------------------------------------------------------
async def test_online_push_consumer_receives_again_from_the_reset_point(
        cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    ns = cluster.ns.address
    got: list[bytes] = []

    async def on(msg: ReceivedMessage) -> Any:
        got.append(msg.body)
        return SUCCESS

    async with Admin(ns) as admin, Producer("PG", ns) as producer:
        await admin.create_topic("ResetT", 2)
        for i in range(4):
            await producer.send(Message("ResetT", f"old{i}".encode()))
        await cluster.clock.advance(1000)
        middle = cluster.clock.now_ms()
        for i in range(4):
            await producer.send(Message("ResetT", f"new{i}".encode()))
        async with PushConsumer("GR", {"ResetT": "*"}, on, ns, consume_from="first", rebalance_interval=0.5,
                                offset_commit_interval=0.2, long_poll_timeout=2.0) as consumer:
            await async_wait_for(lambda: len(got) == 8, message="the first 8 messages")
            info = consumer.running_info()
            assert len([k for k in info["mqTable"] if _mq(k)[0] == "ResetT"]) == 2
            moved = await admin.reset_offsets_by_time("GR", "ResetT", middle)
            assert sorted(moved.values()) == [2, 2]
            assert all(isinstance(mq, MessageQueue) for mq in moved)
            await async_wait_for(lambda: len(got) == 12, message="the 4 messages after the reset point again")
            assert sorted(got[8:]) == [b"new0", b"new1", b"new2", b"new3"]
            await async_wait_for(lambda: sorted(consumer.offsets().values())[-2:] == [4, 4],
                                 message="the consumer's offsets past the re-received messages")
            # the same from a shell, back to the first message: all 8 again
            capsys.readouterr()
            args = ["admin", "reset-offset", "-n", ns, "-g", "GR", "-t", "ResetT", "--timestamp",
                    "2023-11-14T00:00:00Z"]
            assert await asyncio.to_thread(main, args) == 0
            out = capsys.readouterr().out
            assert "offsets reset to the first message stored at or after 2023-11-14T00:00:00.000Z" in out
            assert [line.split() for line in out.splitlines()[2:]] == [["broker-a", "0", "0"],
                                                                       ["broker-a", "1", "0"]]
            await async_wait_for(lambda: len(got) == 20, message="all 8 messages a third time")
            assert await asyncio.to_thread(main, [*args[:5], "Nope", *args[6:]]) == 1
            assert "SUBSCRIPTION_GROUP_NOT_EXIST): Group Nope does not exist" in capsys.readouterr().err
