"""Broker request processors, in process: a BrokerController (real store + DelayService in tmp_path, a
virtual clock) on the test's event loop, driven over loopback by the raw-codec client."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from tests.conftest import async_wait_for, free_port
from tests.integration.rawclient import AsyncRawClient, heartbeat_body, pull_ext, send_ext

from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig
from chronomq.message import (
    SCHEDULE_TOPIC,
    decode_offset_msg_id,
    decode_record,
    decode_records,
    java_string_hash,
)
from chronomq.namesrv import RouteInfoManager
from chronomq.remoting.codec import BatchItem, encode_batch_body
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C


class Env:
    def __init__(self, tmp_path: Path, overrides: dict[str, str] | None = None) -> None:
        from chronomq.broker.controller import BrokerController

        self.clock = VirtualClock()
        self.routes = RouteInfoManager()
        values = {
            "storePathRootDir": str(tmp_path / "store"),
            "listenPort": str(free_port()),
            "messageDelayLevel": "1s 5s 10s 30s",
            "metricsPort": "-1",  # no /metrics: its port (listenPort + 2) is not one free_port reserved
        }
        values.update(overrides or {})
        self.config, _ = BrokerConfig.load(None, values)
        self.broker = BrokerController(self.config, self.clock, local_register=self.routes.register_broker)
        self.clients: list[AsyncRawClient] = []

    async def client(self) -> AsyncRawClient:
        c = await AsyncRawClient.connect(self.broker.server.address)
        self.clients.append(c)
        return c

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        await self.broker.shutdown()


@pytest.fixture
async def env(tmp_path: Path):
    e = Env(tmp_path)
    await e.broker.start()
    yield e
    await e.close()


async def _dispatched(env: Env) -> None:
    store = env.broker.store
    assert await asyncio.to_thread(store.wait_dispatched, store.max_phy_offset, 5)


async def _pull_all(env: Env, c: AsyncRawClient, topic: str, qid: int, group: str = "G") -> list:
    await _dispatched(env)
    resp = await c.pull(group, topic, qid, 0)
    assert resp.code == C.SUCCESS, resp.remark
    return decode_records(resp.body)


# --- send --------------------------------------------------------------------------------------------------
async def test_send_then_pull_round_trip_and_view_by_id(env: Env) -> None:
    c = await env.client()
    props = {"TAGS": "TagA", "KEYS": "k1 k2", "UNIQ_KEY": "U-1", "WAIT": "true", "myprop": "v"}
    resp = await c.send_message("TopicA", b"hello", 2, props)
    assert resp.code == C.SUCCESS, resp.remark
    ext = resp.ext_fields
    assert ext["queueId"] == "2" and ext["queueOffset"] == "0"
    (host, port), phys = decode_offset_msg_id(ext["msgId"])
    assert (host, port) == env.broker.store_host
    resp = await c.send_message("TopicA", b"second", 2, {"TAGS": "TagB"})
    assert resp.ext_fields["queueOffset"] == "1"
    msgs = await _pull_all(env, c, "TopicA", 2)
    assert [m.body for m in msgs] == [b"hello", b"second"]
    m = msgs[0]
    stamped = {"CLUSTER": "DefaultCluster", "MSG_REGION": "DefaultRegion", "TRACE_ON": "true"}  # as RocketMQ
    assert m.properties == {**props, **stamped}
    assert m.commit_log_offset == phys and m.store_host == env.broker.store_host
    assert m.born_host[0] == "127.0.0.1" and m.queue_offset == 0
    view = await c.request(R.VIEW_MESSAGE_BY_ID, {"offset": str(phys)})
    assert view.code == C.SUCCESS and decode_record(view.body).body == b"hello"
    view = await c.request(R.VIEW_MESSAGE_BY_ID, {"msgId": ext["msgId"]})
    assert view.code == C.SUCCESS and decode_record(view.body).properties["UNIQ_KEY"] == "U-1"
    view = await c.request(R.VIEW_MESSAGE_BY_ID, {"offset": "999999999"})
    assert view.code == C.SYSTEM_ERROR and "offset" in view.remark


async def test_topic_auto_creation_through_tbw102_is_routed_and_persisted(env: Env) -> None:
    c = await env.client()
    assert env.routes.topic_route("NewTopic") is None
    ext = send_ext("NewTopic", 0)
    ext["defaultTopicQueueNums"] = 3
    resp = await c.request(R.SEND_MESSAGE, ext, b"x")
    assert resp.code == C.SUCCESS
    route = env.routes.topic_route("NewTopic")
    assert route is not None and route["queueDatas"][0]["writeQueueNums"] == 3
    path = Path(env.config.storePathRootDir) / "config" / "topics.json"
    await async_wait_for(
        lambda: path.exists() and "NewTopic" in json.loads(path.read_text())["topicConfigTable"],
        message="topics.json written",
    )
    saved = json.loads(path.read_text())
    assert saved["topicConfigTable"]["NewTopic"]["readQueueNums"] == 3


async def test_no_auto_creation_when_disabled(tmp_path: Path) -> None:
    e = Env(tmp_path, {"autoCreateTopicEnable": "false"})
    await e.broker.start()
    try:
        c = await e.client()
        resp = await c.send_message("Nope", b"x", 0)
        assert resp.code == C.TOPIC_NOT_EXIST
        assert "Nope" in resp.remark
    finally:
        await e.close()


@pytest.mark.parametrize(
    ("ext_patch", "code", "text"),
    [
        ({"topic": "bad topic!"}, C.MESSAGE_ILLEGAL, "characters"),
        ({"topic": "T" * 200}, C.MESSAGE_ILLEGAL, "longer"),
        ({"topic": SCHEDULE_TOPIC}, C.NO_PERMISSION, "system topic"),
        ({"queueId": 99}, C.SYSTEM_ERROR, "queueId"),
        ({"queueId": "x"}, C.SYSTEM_ERROR, "not an integer"),
        ({"topic": None}, C.SYSTEM_ERROR, "topic"),
        ({"sysFlag": 4}, C.MESSAGE_ILLEGAL, "TRAN_MSG"),
    ],
)
async def test_bad_sends_are_answered_with_clear_errors(
    env: Env, ext_patch: dict, code: int, text: str
) -> None:
    c = await env.client()
    ext = send_ext("Good", 0)
    for k, v in ext_patch.items():
        if v is None:
            ext.pop(k)
        else:
            ext[k] = v
    resp = await c.request(R.SEND_MESSAGE, ext, b"x")
    assert resp.code == code and text in resp.remark
    assert (await c.send_message("Good", b"ok", 0)).code == C.SUCCESS  # still serving


async def test_batch_send_stores_each_item(env: Env) -> None:
    c = await env.client()
    items = [
        BatchItem(f"b{i}".encode(), {"UNIQ_KEY": f"u{i}", "KEYS": f"key{i}", "TAGS": "t"}) for i in range(3)
    ]
    ext = send_ext("Batch", 1, {"WAIT": "true"}, batch=True)
    resp = await c.request(R.SEND_MESSAGE, ext, encode_batch_body(items))
    assert resp.code == C.SUCCESS, resp.remark
    assert resp.ext_fields["queueOffset"] == "0" and len(resp.ext_fields["msgId"].split(",")) == 3
    msgs = await _pull_all(env, c, "Batch", 1)
    assert [(m.body, m.properties["UNIQ_KEY"], m.queue_offset) for m in msgs] == [
        (b"b0", "u0", 0),
        (b"b1", "u1", 1),
        (b"b2", "u2", 2),
    ]
    # SEND_BATCH_MESSAGE (320) with V2 one-letter names
    v2 = {
        "a": "PG",
        "b": "Batch",
        "c": "TBW102",
        "d": "4",
        "e": "1",
        "f": "0",
        "g": "0",
        "h": "0",
        "i": "",
        "j": "0",
        "k": "false",
        "m": "true",
    }
    resp = await c.request(R.SEND_BATCH_MESSAGE, v2, encode_batch_body(items[:2]))
    assert resp.code == C.SUCCESS and resp.ext_fields["queueOffset"] == "3"
    # delay inside a batch, and a corrupt batch body, are refused
    bad = [BatchItem(b"d", {"DELAY": "2"})]
    resp = await c.request(R.SEND_MESSAGE, ext, encode_batch_body(bad))
    assert resp.code == C.MESSAGE_ILLEGAL and "Delay" in resp.remark
    resp = await c.request(R.SEND_MESSAGE, ext, b"\x00\x00\x00\x30garbage")
    assert resp.code == C.MESSAGE_ILLEGAL and "batch" in resp.remark


async def test_send_message_v2_short_names(env: Env) -> None:
    c = await env.client()
    v2 = {
        "a": "PG",
        "b": "V2Topic",
        "c": "TBW102",
        "d": "4",
        "e": "3",
        "f": "0",
        "g": "123",
        "h": "0",
        "i": "TAGS\x01x\x02KEYS\x01kk\x02",
        "j": "0",
        "k": "false",
        "m": "false",
    }
    resp = await c.request(R.SEND_MESSAGE_V2, v2, b"v2 body")
    assert resp.code == C.SUCCESS and resp.ext_fields["queueId"] == "3"
    (m,) = await _pull_all(env, c, "V2Topic", 3)
    assert m.body == b"v2 body" and m.tags == "x" and m.born_timestamp == 123


async def test_compressed_body_and_sysflag_pass_through(env: Env) -> None:
    import zlib

    c = await env.client()
    body = zlib.compress(b"A" * 10_000)
    resp = await c.send_message("Zip", body, 0, sys_flag=1)
    assert resp.code == C.SUCCESS
    (m,) = await _pull_all(env, c, "Zip", 0)
    assert m.sys_flag & 1 and m.inflated_body() == b"A" * 10_000


# --- pull ---------------------------------------------------------------------------------------------------
async def test_pull_statuses_and_tag_filter(env: Env) -> None:
    c = await env.client()
    resp = await c.pull("G", "Empty", 0, 0)
    assert resp.code == C.PULL_NOT_FOUND and resp.ext_fields["nextBeginOffset"] == "0"
    for i, tag in enumerate(["a", "b", "a", "c"]):
        await c.send_message("Tags", f"m{i}".encode(), 0, {"TAGS": tag})
    await _dispatched(env)
    resp = await c.pull("G", "Tags", 0, 0, subscription="a || c")
    assert resp.code == C.SUCCESS
    assert [m.body for m in decode_records(resp.body)] == [b"m0", b"m2", b"m3"]
    assert all(isinstance(v, str) for v in resp.ext_fields.values())
    assert resp.ext_fields["maxOffset"] == "4" and resp.ext_fields["nextBeginOffset"] == "4"
    resp = await c.pull("G", "Tags", 0, 1, subscription="b")
    assert [m.body for m in decode_records(resp.body)] == [b"m1"]
    resp = await c.pull("G", "Tags", 0, 2, subscription="zzz")
    assert (
        resp.code == C.PULL_RETRY_IMMEDIATELY
        and resp.ext_fields["nextBeginOffset"] == "4"
        and resp.body == b""
    )
    resp = await c.pull("G", "Tags", 0, 4)
    assert resp.code == C.PULL_NOT_FOUND and resp.ext_fields["nextBeginOffset"] == "4"
    resp = await c.pull("G", "Tags", 0, 9)
    assert resp.code == C.PULL_OFFSET_MOVED and resp.ext_fields["nextBeginOffset"] == "4"
    resp = await c.pull("G", "Tags", 0, 0, max_msgs=2)
    assert len(decode_records(resp.body)) == 2 and resp.ext_fields["nextBeginOffset"] == "2"
    # tag filtering from the heartbeat's subscription when the SUBSCRIPTION flag is absent
    hb = json.loads(heartbeat_body("cid", "GH", ["Tags"]))
    hb["consumerDataSet"][0]["subscriptionDataSet"][0]["subString"] = "c"
    await c.request(R.HEART_BEAT, body=json.dumps(hb).encode())
    ext = pull_ext("GH", "Tags", 0, 0)
    ext["sysFlag"] = 0
    resp = await c.request(R.PULL_MESSAGE, ext)
    assert [m.body for m in decode_records(resp.body)] == [b"m3"]
    assert java_string_hash("a") != java_string_hash("c")


async def test_pull_commit_offset_flag_stores_the_offset(env: Env) -> None:
    c = await env.client()
    await c.send_message("CO", b"x", 0)
    await _dispatched(env)
    await c.pull("G", "CO", 0, 1, commit_offset=1)
    resp = await c.request(R.QUERY_CONSUMER_OFFSET, {"consumerGroup": "G", "topic": "CO", "queueId": 0})
    assert resp.ext_fields == {"offset": "1"}


async def test_pull_bad_requests(env: Env) -> None:
    c = await env.client()
    await c.send_message("PB", b"x", 0)
    await _dispatched(env)
    resp = await c.pull("G", "PB", 77, 0)
    assert resp.code == C.SYSTEM_ERROR and "queueId" in resp.remark
    ext = pull_ext("G", "PB", 0, 0)
    del ext["queueOffset"]
    resp = await c.request(R.PULL_MESSAGE, ext)
    assert resp.code == C.SYSTEM_ERROR and "queueOffset" in resp.remark


async def test_long_poll_is_answered_when_a_message_lands(env: Env) -> None:
    c = await env.client()
    p = await env.client()
    await c.send_message("LP", b"first", 1)
    await _dispatched(env)
    held = p.start(R.PULL_MESSAGE, pull_ext("G", "LP", 1, 1, suspend_ms=15_000))
    await async_wait_for(lambda: env.broker.hold.held == 1, message="pull held")
    # other requests on the same connection are served meanwhile
    assert (await p.request(R.GET_MAX_OFFSET, {"topic": "LP", "queueId": 1})).ext_fields == {"offset": "1"}
    assert not held.done()
    await c.send_message("LP", b"wake", 1)
    resp = await asyncio.wait_for(held, 5)  # the virtual clock never moved: woken by the arrival
    assert resp.code == C.SUCCESS and [m.body for m in decode_records(resp.body)] == [b"wake"]
    assert env.broker.hold.held == 0


async def test_long_poll_times_out_at_its_suspend_timeout(env: Env) -> None:
    p = await env.client()
    held = p.start(R.PULL_MESSAGE, pull_ext("G", "LP2", 0, 0, suspend_ms=15_000))
    await async_wait_for(lambda: env.broker.hold.held == 1, message="pull held")
    await env.clock.advance(14_000)
    assert not held.done()
    await env.clock.advance(1_000)
    resp = await asyncio.wait_for(held, 5)
    assert resp.code == C.PULL_NOT_FOUND and resp.ext_fields["nextBeginOffset"] == "0"


async def test_long_poll_on_another_queue_is_not_woken(env: Env) -> None:
    c = await env.client()
    held = c.start(R.PULL_MESSAGE, pull_ext("G", "LP3", 0, 0, suspend_ms=15_000))
    await async_wait_for(lambda: env.broker.hold.held == 1, message="pull held")
    await c.send_message("LP3", b"other queue", 1)
    await _wait_max(env, "LP3", 1, 1)
    await asyncio.sleep(0.1)  # give a (wrong) wake-up the chance to happen
    assert not held.done()
    await env.clock.advance(15_000)
    assert (await asyncio.wait_for(held, 5)).code == C.PULL_NOT_FOUND


# --- clients ---------------------------------------------------------------------------------------
async def test_heartbeat_consumer_list_notify_and_disconnect(env: Env) -> None:
    a = await env.client()
    b = await env.client()
    assert (await a.request(R.HEART_BEAT, body=heartbeat_body("client-a", "CG", ["T"]))).code == C.SUCCESS
    assert env.broker.topics.get("%RETRY%CG") is not None
    assert env.routes.topic_route("%RETRY%CG") is not None
    resp = await a.request(R.GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": "CG"})
    assert json.loads(resp.body) == {"consumerIdList": ["client-a"]}
    n_before = len(a.server_requests)
    await b.request(R.HEART_BEAT, body=heartbeat_body("client-b", "CG", ["T"]))
    await async_wait_for(lambda: len(a.server_requests) > n_before, message="notify to a")
    note = a.server_requests[-1]
    assert note.code == R.NOTIFY_CONSUMER_IDS_CHANGED and note.ext_fields["consumerGroup"] == "CG"
    resp = await a.request(R.GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": "CG"})
    assert json.loads(resp.body)["consumerIdList"] == ["client-a", "client-b"]
    # b's connection closes: it is dropped and a is told
    n_before = len(a.server_requests)
    await b.close()
    await async_wait_for(lambda: env.broker.consumers.client_ids("CG") == ["client-a"], message="b dropped")
    await async_wait_for(lambda: len(a.server_requests) > n_before, message="second notify")
    # unregister
    await a.request(R.UNREGISTER_CLIENT, {"clientID": "client-a", "producerGroup": "", "consumerGroup": "CG"})
    resp = await a.request(R.GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": "CG"})
    assert resp.code == C.SYSTEM_ERROR


async def test_silent_client_is_dropped_after_120s(env: Env) -> None:
    a = await env.client()
    await a.request(R.HEART_BEAT, body=heartbeat_body("client-a", "CG2", ["T"]))
    await a.request(
        R.HEART_BEAT, body=json.dumps({"clientID": "p1", "producerDataSet": [{"groupName": "PG"}]}).encode()
    )
    assert "PG" in env.broker.producers.groups
    await env.clock.advance(110_000)
    assert env.broker.consumers.client_ids("CG2") == ["client-a"]
    await env.clock.advance(20_000)
    await async_wait_for(lambda: env.broker.consumers.client_ids("CG2") == [], message="expiry")
    assert "PG" not in env.broker.producers.groups


@pytest.mark.parametrize("body", [b"{not json", b"[1]", b'{"consumerDataSet": []}'])
async def test_bad_heartbeat_bodies(env: Env, body: bytes) -> None:
    c = await env.client()
    resp = await c.request(R.HEART_BEAT, body=body)
    assert resp.code == C.SYSTEM_ERROR and resp.remark


# --- offsets and lookups ----------------------------------------------------------------------------------
async def test_consumer_offsets_query_update_and_persist(tmp_path: Path) -> None:
    e = Env(tmp_path)
    await e.broker.start()
    c = await e.client()
    q = {"consumerGroup": "OG", "topic": "OT", "queueId": 0}
    assert (await c.request(R.QUERY_CONSUMER_OFFSET, q)).ext_fields == {"offset": "0"}  # fresh queue rule
    assert (await c.request(R.UPDATE_CONSUMER_OFFSET, {**q, "commitOffset": "42"})).code == C.SUCCESS
    assert (await c.request(R.QUERY_CONSUMER_OFFSET, q)).ext_fields == {"offset": "42"}
    # persisted by the periodic task (5 s on the virtual clock)
    path = Path(e.config.storePathRootDir) / "config" / "consumerOffset.json"
    await e.clock.advance(5_000)
    await async_wait_for(lambda: path.exists(), message="offsets persisted")
    assert json.loads(path.read_text())["offsetTable"]["OT@OG"] == {"0": 42}
    await c.request(R.UPDATE_CONSUMER_OFFSET, {**q, "commitOffset": "43"})
    await e.close()  # shutdown persists
    e2 = Env(tmp_path, {"listenPort": str(free_port())})
    await e2.broker.start()
    try:
        c2 = await e2.client()
        assert (await c2.request(R.QUERY_CONSUMER_OFFSET, q)).ext_fields == {"offset": "43"}
        assert e2.broker.topics.get("OT") is None  # offsets do not create topics
    finally:
        await e2.close()


async def test_offset_and_time_lookups(env: Env) -> None:
    c = await env.client()
    t0 = env.clock.now_ms()
    await c.send_message("OL", b"a", 0)
    await env.clock.advance(1000)
    await c.send_message("OL", b"b", 0)
    q = {"topic": "OL", "queueId": 0}
    await async_wait_for(lambda: env.broker.store.get_max_offset_in_queue("OL", 0) == 2, message="dispatch")
    assert (await c.request(R.GET_MAX_OFFSET, q)).ext_fields == {"offset": "2"}
    assert (await c.request(R.GET_MIN_OFFSET, q)).ext_fields == {"offset": "0"}
    assert (await c.request(R.GET_EARLIEST_MSG_STORETIME, q)).ext_fields == {"timestamp": str(t0)}
    resp = await c.request(R.SEARCH_OFFSET_BY_TIMESTAMP, {**q, "timestamp": str(t0 + 500)})
    assert resp.ext_fields == {"offset": "1"}
    resp = await c.request(R.GET_MAX_OFFSET, {"topic": "OL"})
    assert resp.code == C.SYSTEM_ERROR and "queueId" in resp.remark


async def _eq(coro, expected: object) -> bool:  # type: ignore[no-untyped-def]
    return (await coro) == expected


async def test_query_message_by_key_and_unique_key(env: Env) -> None:
    c = await env.client()
    await c.send_message("QK", b"one", 0, {"KEYS": "order-1 shared", "UNIQ_KEY": "UQ1"})
    await c.send_message("QK", b"two", 1, {"KEYS": "shared", "UNIQ_KEY": "UQ2"})
    base = {"topic": "QK", "maxNum": 32, "beginTimestamp": "0", "endTimestamp": str(2**62)}

    async def shared() -> list[bytes]:  # the key index is built asynchronously after the consume queue
        resp = await c.request(R.QUERY_MESSAGE, {**base, "key": "shared"})
        return sorted(m.body for m in decode_records(resp.body)) if resp.code == C.SUCCESS else []

    await async_wait_for(lambda: _eq(shared(), [b"one", b"two"]), message="both messages indexed")
    resp = await c.request(R.QUERY_MESSAGE, {**base, "key": "UQ2"})
    assert [m.body for m in decode_records(resp.body)] == [b"two"]
    resp = await c.request(R.QUERY_MESSAGE, {**base, "key": "missing"})
    assert resp.code == C.QUERY_NOT_FOUND


async def test_lock_and_unlock_batch_mq(env: Env) -> None:
    c = await env.client()
    mqs = [{"topic": "OT", "brokerName": "broker-a", "queueId": i} for i in range(2)]

    def body(cid: str, sets: list) -> bytes:
        return json.dumps({"clientId": cid, "consumerGroup": "LG", "mqSet": sets}).encode()

    resp = await c.request(R.LOCK_BATCH_MQ, body=body("A", mqs))
    assert len(json.loads(resp.body)["lockOKMQSet"]) == 2
    resp = await c.request(R.LOCK_BATCH_MQ, body=body("B", mqs))
    assert json.loads(resp.body)["lockOKMQSet"] == []
    await c.request(R.UNLOCK_BATCH_MQ, body=body("A", mqs[:1]))
    resp = await c.request(R.LOCK_BATCH_MQ, body=body("B", mqs))
    assert json.loads(resp.body)["lockOKMQSet"] == mqs[:1]
    await env.clock.advance(61_000)  # A's remaining lock expires
    resp = await c.request(R.LOCK_BATCH_MQ, body=body("B", mqs))
    assert len(json.loads(resp.body)["lockOKMQSet"]) == 2
    resp = await c.request(R.LOCK_BATCH_MQ, body=b"nope")
    assert resp.code == C.SYSTEM_ERROR and "JSON" in resp.remark


# --- delay, retry, DLQ -------------------------------------------------------------------------------
async def _wait_max(env: Env, topic: str, qid: int, n: int) -> None:
    await async_wait_for(
        lambda: env.broker.store.get_max_offset_in_queue(topic, qid) >= n, message=f"{topic}"
    )


async def test_delayed_send_is_parked_then_delivered(env: Env) -> None:
    c = await env.client()
    resp = await c.send_message("DT", b"later", 1, {"DELAY": "2"})
    assert resp.code == C.SUCCESS
    await _wait_max(env, SCHEDULE_TOPIC, 1, 1)
    assert env.broker.store.get_max_offset_in_queue("DT", 1) == 0
    await env.clock.advance(5_000)
    await _wait_max(env, "DT", 1, 1)
    (m,) = await _pull_all(env, c, "DT", 1)
    assert m.body == b"later" and m.properties["DELAY"] == "2" and m.properties["REAL_TOPIC"] == "DT"
    stats = json.loads((await c.request(R.CHRONOMQ_DELAY_STATS)).body)
    assert stats["levels"][1]["delivered"] == 1 and stats["early_deliveries"] == 0


async def test_one_pull_answers_a_level_delivery_and_a_timed_delivery_together(env: Env) -> None:
    # the level copy's internal marker is cut out of the answer and the timed copy's lateness is read
    # from the same records: both must work on the rewritten ones (the compiled kernel takes bytes only)
    c = await env.client()
    assert (await c.send_message("MixQ", b"level", 0, {"DELAY": "1"})).code == C.SUCCESS
    due = env.clock.now_ms() + 1_000
    resp = await c.send_message("MixQ", b"timed", 0, {"TIMER_DELIVER_MS": str(due)})
    assert resp.code == C.SUCCESS, resp.remark
    await env.clock.advance(1_000)
    await _wait_max(env, "MixQ", 0, 2)
    got = await _pull_all(env, c, "MixQ", 0)
    assert sorted(m.body for m in got) == [b"level", b"timed"]
    assert not any(k.startswith("__CHRONOMQ_DELAY_SRC") for m in got for k in m.properties)


async def test_send_back_goes_to_retry_then_dlq(tmp_path: Path) -> None:
    e = Env(tmp_path, {"maxReconsumeTimes": "1"})
    await e.broker.start()
    try:
        c = await e.client()
        await c.send_message("RT", b"work", 0, {"UNIQ_KEY": "W1"})
        (m,) = await _pull_all(e, c, "RT", 0)
        resp = await c.request(
            R.CONSUMER_SEND_MSG_BACK, {"group": "CGR", "offset": str(m.commit_log_offset), "delayLevel": 0}
        )
        assert resp.code == C.SUCCESS, resp.remark
        # level 3 (10 s): parked first, then %RETRY%CGR
        await _wait_max(e, SCHEDULE_TOPIC, 2, 1)
        await e.clock.advance(10_000)
        await _wait_max(e, "%RETRY%CGR", 0, 1)
        (r,) = await _pull_all(e, c, "%RETRY%CGR", 0, "CGR")
        assert r.body == b"work" and r.reconsume_times == 1 and r.properties["RETRY_TOPIC"] == "RT"
        assert r.properties["ORIGIN_MESSAGE_ID"]
        assert e.routes.topic_route("%RETRY%CGR") is not None
        # reconsume_times (1) >= max (1): dead letter, at once
        resp = await c.request(
            R.CONSUMER_SEND_MSG_BACK, {"group": "CGR", "offset": str(r.commit_log_offset), "delayLevel": 0}
        )
        assert resp.code == C.SUCCESS
        await _wait_max(e, "%DLQ%CGR", 0, 1)
        (d,) = await _pull_all(e, c, "%DLQ%CGR", 0, "x")
        assert d.body == b"work" and d.properties["UNIQ_KEY"] == "W1"
        resp = await c.request(
            R.CONSUMER_SEND_MSG_BACK, {"group": "CGR", "offset": "987654321", "delayLevel": 0}
        )
        assert resp.code == C.SYSTEM_ERROR and "offset" in resp.remark
    finally:
        await e.close()


async def test_producer_send_to_retry_topic_past_max_goes_to_dlq(env: Env) -> None:
    c = await env.client()
    resp = await c.send_message("%RETRY%PG1", b"r", 0, reconsume=16)
    assert resp.code == C.SUCCESS
    await _wait_max(env, "%DLQ%PG1", 0, 1)
    resp = await c.send_message("%RETRY%PG1", b"r2", 0, reconsume=3)
    await _wait_max(env, "%RETRY%PG1", 0, 1)


# --- admin and misc --------------------------------------------------------------------------------------
async def test_sync_flush_send_is_answered_after_the_flush(tmp_path: Path) -> None:
    e = Env(tmp_path, {"flushDiskType": "SYNC_FLUSH"})
    await e.broker.start()
    try:
        c = await e.client()
        results = await asyncio.gather(*(c.send_message("SF", f"m{i}".encode(), i % 4) for i in range(20)))
        assert all(r.code == C.SUCCESS for r in results)
        assert sorted(int(r.ext_fields["queueOffset"]) for r in results) == sorted([i for i in range(5)] * 4)
    finally:
        await e.close()


async def test_admin_codes_and_unknown_code(env: Env) -> None:
    c = await env.client()
    resp = await c.request(
        R.UPDATE_AND_CREATE_TOPIC, {"topic": "Adm", "readQueueNums": 2, "writeQueueNums": 2, "perm": 6}
    )
    assert resp.code == C.SUCCESS and env.routes.topic_route("Adm") is not None
    table = json.loads((await c.request(R.GET_ALL_TOPIC_CONFIG)).body)["topicConfigTable"]
    assert table["Adm"]["writeQueueNums"] == 2 and SCHEDULE_TOPIC in table and "TBW102" in table
    info = json.loads((await c.request(R.GET_BROKER_RUNTIME_INFO)).body)["table"]
    assert info["brokerName"] == "broker-a"
    stats = json.loads((await c.request(R.GET_TOPIC_STATS_INFO, {"topic": "Adm"})).body)
    assert len(stats["offsetTable"]) == 2
    # the 5.x admin tools ask for one topic's config first (examineTopicStats)
    tc = json.loads((await c.request(R.GET_TOPIC_CONFIG, {"topic": "Adm"})).body)
    assert (tc["topicName"], tc["readQueueNums"], tc["writeQueueNums"], tc["perm"]) == ("Adm", 2, 2, 6)
    resp = await c.request(R.GET_TOPIC_CONFIG, {"topic": "NoSuchTopic"})
    assert resp.code == C.TOPIC_NOT_EXIST and "NoSuchTopic" in resp.remark
    resp = await c.request(R.END_TRANSACTION, {})  # a malformed one is refused with the reason
    assert resp.code == C.SYSTEM_ERROR and "commitOrRollback" in resp.remark
    resp = await c.request(R.CHECK_TRANSACTION_STATE, {})  # a client's code: a broker does not serve it
    assert resp.code == C.REQUEST_CODE_NOT_SUPPORTED
    resp = await c.request(R.UPDATE_AND_CREATE_TOPIC, {"topic": "bad name"})
    assert resp.code == C.SYSTEM_ERROR


async def test_compressed_batch_from_the_cpp_client_is_inflated(env: Env) -> None:
    import zlib

    c = await env.client()
    items = [BatchItem(b"x" * 1024, {"UNIQ_KEY": f"z{i}"}) for i in range(16)]
    ext = send_ext("ZB", 0, {"WAIT": "true"}, batch=True, sys_flag=1)
    resp = await c.request(R.SEND_MESSAGE, ext, zlib.compress(encode_batch_body(items)))
    assert resp.code == C.SUCCESS, resp.remark
    msgs = await _pull_all(env, c, "ZB", 0)
    assert len(msgs) == 16 and all(m.body == b"x" * 1024 and m.sys_flag & 1 == 0 for m in msgs)
    resp = await c.request(R.SEND_MESSAGE, ext, b"not zlib")
    assert resp.code == C.MESSAGE_ILLEGAL and "compressed" in resp.remark


async def test_sql92_subscription_is_refused_clearly(env: Env) -> None:
    c = await env.client()
    ext = pull_ext("G", "Sql", 0, 0, subscription="a > 5")
    ext["expressionType"] = "SQL92"
    resp = await c.request(R.PULL_MESSAGE, ext)
    assert resp.code == C.SYSTEM_ERROR and "SQL92" in resp.remark


# --- the processors' services ----------------------------------------------------------------------------
def test_processors_import_services_not_the_controller() -> None:
    import ast

    import chronomq.broker.processor as processor
    import chronomq.broker.processors as processors
    import chronomq.broker.timer_processor as timer_processor

    files = [Path(processor.__file__), Path(timer_processor.__file__)]
    files += sorted(Path(processors.__file__).parent.glob("*.py"))
    for f in files:
        tree = ast.parse(f.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "controller" not in imported and "chronomq.broker.controller" not in imported, f.name


async def test_processor_works_from_services_and_counts_puts(env: Env) -> None:
    s = env.broker.services
    assert env.broker.processor.services is s and env.broker.timers.services is s
    assert s.loop is asyncio.get_running_loop() and not s.stopping
    c = await env.client()
    assert (await c.send_message("Counted", b"a", 0, {"WAIT": "true"})).code == C.SUCCESS
    items = [BatchItem(body=b"b%d" % i, properties={}) for i in range(3)]
    resp = await c.request(R.SEND_MESSAGE, send_ext("Counted", 0, {}, batch=True), encode_batch_body(items))
    assert resp.code == C.SUCCESS, resp.remark
    info = json.loads((await c.request(R.GET_BROKER_RUNTIME_INFO, {})).body)["table"]
    assert info["putMessageTimesTotal"] == "4" and info["putMessageFailedTimes"] == "0"
    assert s.put_stats.count == 4
