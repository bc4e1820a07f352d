"""More of what the official Java client sees of RocketMQ's broker, held against chronomq (each test
names the RocketMQ code it follows): the properties the broker stamps on every sent message
(SendMessageProcessor, AbstractSendMessageProcessor.buildMsgContext), TRAN_MSG kept on a committed
message (EndTransactionProcessor) without making it a half message again, no internal property handed to
a client, and request-reply (ReplyMessageProcessor). A real broker and name server in process, on
loopback, driven by the raw-codec client."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from tests.conftest import async_wait_for
from tests.integration.rawclient import AsyncRawClient, send_ext
from tests.unit.test_rocketmq_parity import Cluster, _queue

from chronomq.broker.transaction import HALF_TOPIC
from chronomq.delay.delivery import PROPERTY_DELAY_SOURCE, hide_delay_source
from chronomq.message import (
    MessageExt,
    create_offset_msg_id,
    decode_properties,
    decode_record,
    decode_records,
    encode_properties,
    encode_record,
)
from chronomq.remoting.codec import encode
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C

STAMPS = {"CLUSTER": "DefaultCluster", "MSG_REGION": "DefaultRegion", "TRACE_ON": "true"}


@pytest.fixture
async def cluster(tmp_path: Path):  # test_rocketmq_parity's: a name server and a broker on a virtual clock
    async with _started(Cluster(tmp_path)) as c:
        yield c


@contextlib.asynccontextmanager
async def _started(c: Cluster):
    await c.start()
    try:
        yield c
    finally:
        await c.close()


def _stamps(m: MessageExt) -> dict[str, str]:
    return {k: m.properties[k] for k in STAMPS if k in m.properties}


# --- 1. stamped properties ----------------------------------------------------------------------------------
async def test_every_sent_message_is_stamped_as_rocketmq_stores_it(cluster: Cluster) -> None:
    """SendMessageProcessor puts CLUSTER on single and batch messages; 5.x's buildMsgContext puts
    MSG_REGION and TRACE_ON on every send (the batch's properties are appended to each item). Delay
    levels, timed messages and send-backs keep what the original got."""
    c = await cluster.client(cluster.b.broker_addr)
    assert (await c.send_message("Stamp", b"one", 0, {"CLUSTER": "forged"})).code == C.SUCCESS
    items = b"".join(_batch_item(f"b{i}".encode(), {"UNIQ_KEY": f"U{i}"}) for i in range(2))
    ext = send_ext("Stamp", 1, {}, batch=True)
    assert (await c.request(R.SEND_BATCH_MESSAGE, ext, items)).code == C.SUCCESS
    assert (await c.send_message("Stamp", b"lvl", 2, {"DELAY": "1"})).code == C.SUCCESS
    now = cluster.clock.now_ms()
    timed = await c.send_message("Stamp", b"tmr", 3, {"TIMER_DELIVER_MS": str(now + 2_000)})
    assert timed.code == C.SUCCESS
    assert (timed.ext_fields["MSG_REGION"], timed.ext_fields["TRACE_ON"]) == ("DefaultRegion", "true")
    (one,) = await _queue(cluster, c, "Stamp", 0, 1)
    batch = await _queue(cluster, c, "Stamp", 1, 2)
    await cluster.clock.advance(2_000)
    (lvl,) = await _queue(cluster, c, "Stamp", 2, 1)
    (tmr,) = await _queue(cluster, c, "Stamp", 3, 1)
    for m in (one, *batch, lvl, tmr):
        assert _stamps(m) == STAMPS, (m.body, m.properties)
    back = {"group": "G", "offset": str(one.commit_log_offset), "delayLevel": "0", "maxReconsumeTimes": "0"}
    assert (await c.request(R.CONSUMER_SEND_MSG_BACK, back)).code == C.SUCCESS
    (dead,) = await _queue(cluster, c, "%DLQ%G", 0, 1)
    assert _stamps(dead) == STAMPS


async def test_region_and_trace_switch_come_from_broker_conf(tmp_path: Path) -> None:
    async with _started(Cluster(tmp_path, regionId="eu-west", traceOn="false", brokerClusterName="C2")) as c:
        cl = await c.client(c.b.broker_addr)
        resp = await cl.send_message("Conf", b"x", 0)
        assert (resp.ext_fields["MSG_REGION"], resp.ext_fields["TRACE_ON"]) == ("eu-west", "false")
        (m,) = await _queue(c, cl, "Conf", 0, 1)
        assert _stamps(m) == {"CLUSTER": "C2", "MSG_REGION": "eu-west", "TRACE_ON": "false"}


def _batch_item(body: bytes, props: dict[str, str]) -> bytes:
    """One item of a SEND_BATCH_MESSAGE body (MessageDecoder.encodeMessage)."""
    p = encode_properties(props).encode()
    total = 4 + 4 + 4 + 4 + 4 + len(body) + 2 + len(p)
    return (total.to_bytes(4, "big") + (0).to_bytes(4, "big") + (0).to_bytes(4, "big")
            + (0).to_bytes(4, "big") + len(body).to_bytes(4, "big") + body + len(p).to_bytes(2, "big") + p)


# --- 2. TRAN_MSG on a committed message -------------------------------------------------------------------
async def _commit(cluster: Cluster, c: AsyncRawClient, topic: str, body: bytes,
                  props: dict[str, str] | None = None) -> None:
    half_props = {"TRAN_MSG": "true", "PGROUP": "PG", "UNIQ_KEY": f"U-{body.decode()}", **(props or {})}
    sent = await c.request(R.SEND_MESSAGE, send_ext(topic, 0, half_props, sys_flag=4, group="PG"), body)
    assert sent.code == C.SUCCESS, sent.remark
    offset = int(sent.ext_fields["msgId"][16:], 16)
    end = await c.request(R.END_TRANSACTION, {
        "producerGroup": "PG", "tranStateTableOffset": sent.ext_fields["queueOffset"],
        "commitLogOffset": str(offset), "commitOrRollback": "8", "msgId": sent.ext_fields["msgId"]})
    assert end.code == C.SUCCESS and end.remark == "committed", end.remark


async def test_a_committed_message_keeps_tran_msg_and_is_never_a_half_message_again(cluster: Cluster) -> None:
    """EndTransactionProcessor.endMessageTransaction writes the stored property string before it clears
    TRAN_MSG: the consumer sees TRAN_MSG=true and PGROUP. Its sysFlag (commit bits) is what the store
    goes by: a send-back, the DLQ, a re-send of it with its properties (the console's re-drive) and a
    timed commit all deliver it as an ordinary message."""
    c = await cluster.client(cluster.b.broker_addr)
    await _commit(cluster, c, "TxK", b"c1")
    (m,) = await _queue(cluster, c, "TxK", 0, 1)
    assert (m.properties["TRAN_MSG"], m.properties["PGROUP"]) == ("true", "PG")
    assert m.sys_flag & 0xC == 8 and _stamps(m) == STAMPS
    halves = cluster.b.store.get_max_offset_in_queue(HALF_TOPIC, 0)
    # send-back: a retry copy parked under its level, then delivered to %RETRY%G
    back = {"group": "G", "offset": str(m.commit_log_offset), "delayLevel": "1"}
    assert (await c.request(R.CONSUMER_SEND_MSG_BACK, back)).code == C.SUCCESS
    await cluster.clock.advance(1_000)
    (retry,) = await _queue(cluster, c, "%RETRY%G", 0, 1)
    assert retry.body == b"c1" and retry.properties["TRAN_MSG"] == "true"
    # the DLQ
    dlq = {**back, "offset": str(retry.commit_log_offset), "maxReconsumeTimes": "0"}
    assert (await c.request(R.CONSUMER_SEND_MSG_BACK, dlq)).code == C.SUCCESS
    (dead,) = await _queue(cluster, c, "%DLQ%G", 0, 1)
    assert dead.body == b"c1"
    # a re-send with all its properties and an ordinary sysFlag (chronomq's console re-drive does so)
    again = await c.send_message("TxK", b"c1-again", 0, dict(dead.properties))
    assert again.code == C.SUCCESS
    (_, redriven) = await _queue(cluster, c, "TxK", 0, 2)
    assert redriven.body == b"c1-again"
    # a committed message with a deliver time is timed (chronomq lets a commit wait)
    due = cluster.clock.now_ms() + 3_000
    await _commit(cluster, c, "TxT", b"c2", {"TIMER_DELIVER_MS": str(due)})
    assert cluster.b.store.get_max_offset_in_queue("TxT", 0) == 0
    await cluster.clock.advance(3_000)
    (t,) = await _queue(cluster, c, "TxT", 0, 1)
    assert t.properties["TRAN_MSG"] == "true" and t.properties["TIMER_DELIVER_MS"] == str(due)
    # the only half messages are the two transactions' own
    assert cluster.b.store.get_max_offset_in_queue(HALF_TOPIC, 0) == halves + 1


# --- 3. the level service's marker never reaches a client ----------------------------------------------
async def test_no_internal_property_in_pull_view_or_query_answers(cluster: Cluster) -> None:
    c = await cluster.client(cluster.b.broker_addr)
    props = {"KEYS": "K-src", "UNIQ_KEY": "U-src", "a": "1"}
    assert (await c.send_message("Src", b"x", 0, {**props, "DELAY": "1"})).code == C.SUCCESS
    await cluster.clock.advance(1_000)
    await async_wait_for(lambda: cluster.b.store.get_max_offset_in_queue("Src", 0) == 1,
                         message="the level delivery")
    # in the commit log the marker is still there (the level service's crash recovery reads it)
    cq = cluster.b.store.get_cq_units("Src", 0, 0, 1)[0]
    raw = bytes(cluster.b.store.read_record(cq.commit_log_offset))
    assert PROPERTY_DELAY_SOURCE in decode_record(raw).properties
    resp = await c.pull("G", "Src", 0, 0)
    (pulled,) = decode_records(resp.body)
    view = await c.request(R.VIEW_MESSAGE_BY_ID, {"msgId": create_offset_msg_id(
        cluster.b.services.store_host, cq.commit_log_offset)})
    (viewed,) = decode_records(view.body)
    await async_wait_for(lambda: cluster.b.store.query_message("Src", "K-src", 8, 0, 2**62), timeout=10,
                         message="the key index")
    query = await c.request(R.QUERY_MESSAGE, {"topic": "Src", "key": "K-src", "maxNum": "8",
                                              "beginTimestamp": "0", "endTimestamp": str(2**62)})
    assert query.code == C.SUCCESS
    for m in (pulled, viewed, *decode_records(query.body)):
        assert PROPERTY_DELAY_SOURCE not in m.properties
        assert {k: m.properties[k] for k in props} == props and m.properties["DELAY"] == "1"
        assert m.body == b"x" and m.commit_log_offset == cq.commit_log_offset
    assert pulled.topic == "Src" and pulled.queue_offset == 0


def test_hide_delay_source_rewrites_only_that_property() -> None:
    m = MessageExt("T", b"body", {"A": "1", PROPERTY_DELAY_SOURCE: "1:2:3", "B": "x__CHRONOMQ_DELAY_SRC"},
                   queue_offset=7, commit_log_offset=99, store_timestamp=5)
    rec = bytes(encode_record(m))
    out = decode_record(hide_delay_source(rec))
    assert out.properties == {"A": "1", "B": "x__CHRONOMQ_DELAY_SRC"}
    assert (out.body, out.queue_offset, out.commit_log_offset, out.store_timestamp, out.store_size) == \
        (b"body", 7, 99, 5, len(rec) - len(f"{PROPERTY_DELAY_SOURCE}\x011:2:3\x02"))
    plain = bytes(encode_record(MessageExt("T", b"b", {"A": "1"})))
    assert hide_delay_source(plain) is plain
    last = bytes(encode_record(MessageExt("T", b"b", {"A": "1", PROPERTY_DELAY_SOURCE: "1:2:3"})))
    assert decode_record(hide_delay_source(last)).properties == {"A": "1"}


def _stored_properties(cluster: Cluster, msg_id: str) -> dict[str, str]:
    """The properties as the commit log holds them at a send answer's msgId (a pull would hide the marker)."""
    raw = bytes(cluster.b.store.read_record(int(msg_id[16:], 16)))
    return decode_record(raw).properties


async def test_a_forged_marker_is_stripped_from_replies_and_half_messages(cluster: Cluster) -> None:
    """Only the level service may write the marker (its crash recovery trusts it on any record outside the
    schedule topic): a client's own is dropped on every way in, not only on an ordinary send."""
    forged = {PROPERTY_DELAY_SOURCE: "1:0:0"}
    c = await cluster.client(cluster.b.broker_addr)
    await _heartbeat(c, "cid-m", "PG")
    half = {"TRAN_MSG": "true", "PGROUP": "PG", "UNIQ_KEY": "U-half", **forged}
    sent = await c.request(R.SEND_MESSAGE, send_ext("TxM", 0, half, sys_flag=4, group="PG"), b"h")
    assert sent.code == C.SUCCESS, sent.remark
    stored_half = _stored_properties(cluster, sent.ext_fields["msgId"])
    assert stored_half["UNIQ_KEY"] == "U-half" and PROPERTY_DELAY_SOURCE not in stored_half
    topic = "DefaultCluster_REPLY_TOPIC"
    fut = c.start(R.SEND_REPLY_MESSAGE, send_ext(topic, 0, {"REPLY_TO_CLIENT": "cid-m", **forged}), b"r")
    pushed = await _answer_push(c)
    replied = await fut
    assert replied.code == C.SUCCESS, replied.remark
    assert PROPERTY_DELAY_SOURCE not in decode_properties(pushed["properties"])
    stored_reply = _stored_properties(cluster, replied.ext_fields["msgId"])
    assert stored_reply["REPLY_TO_CLIENT"] == "cid-m" and PROPERTY_DELAY_SOURCE not in stored_reply


# --- 4. request-reply ------------------------------------------------------------------------------------
async def _heartbeat(c: AsyncRawClient, client_id: str, group: str) -> None:
    body = json.dumps({"clientID": client_id, "producerDataSet": [{"groupName": group}],
                       "consumerDataSet": []}).encode()
    assert (await c.request(R.HEART_BEAT, body=body)).code == C.SUCCESS


async def _answer_push(c: AsyncRawClient, code: int = C.SUCCESS) -> dict[str, str]:
    """The requester's side of PUSH_REPLY_MESSAGE_TO_CLIENT (ClientRemotingProcessor.receiveReplyMessage)."""
    await async_wait_for(lambda: any(r.code == R.PUSH_REPLY_MESSAGE_TO_CLIENT for r in c.server_requests),
                         timeout=10, message="the pushed reply")
    push = next(r for r in c.server_requests if r.code == R.PUSH_REPLY_MESSAGE_TO_CLIENT)
    c.server_requests.remove(push)
    c.send_raw(encode(push.response(code)))
    return {**push.ext_fields, "body": push.body.decode()}


async def test_request_reply_pushes_the_reply_to_the_requester_and_stores_it(cluster: Cluster) -> None:
    reply_topic = "DefaultCluster_REPLY_TOPIC"
    tc = cluster.b.topics.get(reply_topic)
    assert tc is not None and (tc.readQueueNums, tc.writeQueueNums, tc.perm) == (1, 1, 6)
    assert cluster.b.topics.is_system_topic(reply_topic)
    await async_wait_for(lambda: cluster.ns.routes.topic_route(reply_topic) is not None,
                         message="the reply topic's route")
    requester = await cluster.client(cluster.b.broker_addr)
    replier = await cluster.client(cluster.b.broker_addr)
    await _heartbeat(requester, "10.0.0.1@req", "PG_req")
    # the request: an ordinary send, stamped with CLUSTER (what createReplyMessage reads)
    req_props = {"CORRELATION_ID": "corr-1", "REPLY_TO_CLIENT": "10.0.0.1@req", "TTL": "3000"}
    assert (await requester.send_message("Ask", b"q", 0, req_props)).code == C.SUCCESS
    (asked,) = await _queue(cluster, requester, "Ask", 0, 1)
    cluster_name = asked.properties["CLUSTER"]
    reply_props = {**req_props, "MSG_TYPE": "reply", "UNIQ_KEY": "U-reply"}
    for code in (R.SEND_REPLY_MESSAGE_V2, R.SEND_REPLY_MESSAGE):
        ext = send_ext(f"{cluster_name}_REPLY_TOPIC", 0, reply_props, group="PG_rep")
        if code == R.SEND_REPLY_MESSAGE_V2:
            ext = {"a": ext["producerGroup"], "b": ext["topic"], "c": "TBW102", "d": "4", "e": "0",
                   "f": "0", "g": ext["bornTimestamp"], "h": "0", "i": ext["properties"], "j": "0"}
        fut = replier.start(code, ext, b"re:q")
        pushed = await _answer_push(requester)
        resp = await fut
        assert resp.code == C.SUCCESS, resp.remark
        assert resp.ext_fields["MSG_REGION"] == "DefaultRegion" and resp.ext_fields["TRACE_ON"] == "true"
        assert resp.ext_fields["msgId"] != "0"  # stored (storeReplyMessageEnable)
        assert pushed["body"] == "re:q" and pushed["topic"] == reply_topic
        props = decode_properties(pushed["properties"])
        assert {k: props[k] for k in ("CORRELATION_ID", "REPLY_TO_CLIENT", "MSG_TYPE")} == \
            {"CORRELATION_ID": "corr-1", "REPLY_TO_CLIENT": "10.0.0.1@req", "MSG_TYPE": "reply"}
        assert "PUSH_REPLY_TIME" in props and "CLUSTER" not in props
        assert props["MSG_REGION"] == "DefaultRegion"
        assert pushed["bornHost"].startswith("127.0.0.1:") and pushed["storeHost"].count(":") == 1
    stored = await _queue(cluster, requester, reply_topic, 0, 2)
    assert [m.body for m in stored] == [b"re:q", b"re:q"]
    assert "PUSH_REPLY_TIME" not in stored[0].properties


async def test_a_reply_whose_requester_is_gone_is_refused_as_rocketmq_does(tmp_path: Path) -> None:
    c = Cluster(tmp_path, storeReplyMessageEnable="false")
    await c.start()
    try:
        replier = await c.client(c.b.broker_addr)
        topic = "DefaultCluster_REPLY_TOPIC"
        no_to = await replier.request(R.SEND_REPLY_MESSAGE, send_ext(topic, 0, {"CORRELATION_ID": "x"}), b"r")
        assert no_to.code == C.SYSTEM_ERROR
        assert no_to.remark == "reply message properties[REPLY_TO_CLIENT] is null"
        gone = await replier.request(R.SEND_REPLY_MESSAGE, send_ext(topic, 0, {"REPLY_TO_CLIENT": "nobody"}),
                                     b"r")
        assert gone.code == C.SYSTEM_ERROR
        assert gone.remark == "push reply message fail, channel of <nobody> not found."
        requester = await c.client(c.b.broker_addr)
        await _heartbeat(requester, "cid", "PG")
        fut = replier.start(R.SEND_REPLY_MESSAGE, send_ext(topic, 0, {"REPLY_TO_CLIENT": "cid"}), b"r")
        await _answer_push(requester, C.SYSTEM_ERROR)
        failed = await fut
        assert failed.code == C.SYSTEM_ERROR and failed.remark == "push reply message to cidfail."
        ok_fut = replier.start(R.SEND_REPLY_MESSAGE, send_ext(topic, 0, {"REPLY_TO_CLIENT": "cid"}), b"r")
        await _answer_push(requester)
        ok = await ok_fut
        assert ok.code == C.SUCCESS and (ok.ext_fields["msgId"], ok.ext_fields["queueOffset"]) == ("0", "0")
        # storeReplyMessageEnable=false: nothing stored
        assert c.b.store.get_max_offset_in_queue(topic, 0) == 0
    finally:
        await c.close()
