"""The 5.x gRPC endpoint, in process: the translation (convert.py), the in-flight table (pop.py), and a
BrokerController with its endpoint on a free loopback port driven by a grpc.aio client built on
chronomq's own generated messages."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio and protobuf (chronomq dependencies) are not installed")

from tests.conftest import async_wait_for, free_port  # noqa: E402

from chronomq.clock import SystemClock  # noqa: E402
from chronomq.config import BrokerConfig, ConfigError  # noqa: E402
from chronomq.grpc import convert  # noqa: E402
from chronomq.grpc._proto import rocketmq_v2_pb2 as pb  # noqa: E402
from chronomq.grpc.pop import AckOutcome, PopTable  # noqa: E402
from chronomq.message import MessageExt  # noqa: E402
from chronomq.namesrv import RouteInfoManager  # noqa: E402

SERVICE = "/apache.rocketmq.v2.MessagingService/"


# --- translation --------------------------------------------------------------------------------------------
def _v2(**sp: Any) -> pb.Message:
    m = pb.Message(topic=pb.Resource(name="T"), body=b"hi", user_properties={"a": "b"})
    m.system_properties.message_id = "01AB"
    m.system_properties.body_encoding = pb.IDENTITY
    for k, v in sp.items():
        if k == "delivery_ms":
            m.system_properties.delivery_timestamp.CopyFrom(convert.timestamp(v))
        elif k == "keys":
            m.system_properties.keys.extend(v)
        else:
            setattr(m.system_properties, k, v)
    return m


def test_a_sent_message_becomes_the_4x_message_a_4x_client_would_send() -> None:
    out = convert.from_v2(_v2(tag="t1", keys=["k1", "k2"], message_group="g", message_type=pb.FIFO), 1024)
    assert out.properties == {"a": "b", "TAGS": "t1", "KEYS": "k1 k2", "UNIQ_KEY": "01AB",
                              "__SHARDINGKEY": "g"}
    assert out.group == "g" and out.deliver_ms is None and not out.transactional
    out = convert.from_v2(_v2(delivery_ms=1_800_000_000_123, message_type=pb.DELAY), 1024)
    assert out.properties["TIMER_DELIVER_MS"] == "1800000000123"


def test_a_delivery_time_in_ms_in_the_seconds_field_is_read_as_ms() -> None:
    ts = convert.timestamp(0)
    ts.seconds = 1_800_000_000_123  # the 5.x Python client copies the user's number into seconds
    assert convert.delivery_ms(ts) == 1_800_000_000_123
    ts.seconds = 1_800_000_000
    assert convert.delivery_ms(ts) == 1_800_000_000_000


@pytest.mark.parametrize("change,code", [
    ({"body": b""}, pb.MESSAGE_BODY_EMPTY),
    ({"body": b"x" * 2000}, pb.MESSAGE_BODY_TOO_LARGE),
    ({"user_properties": {"TAGS": "x"}}, pb.ILLEGAL_MESSAGE_PROPERTY_KEY),
    ({"tag": "a|b"}, pb.ILLEGAL_MESSAGE_TAG),
    ({"message_type": pb.FIFO}, pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
    ({"message_type": pb.TRANSACTION, "message_group": "g"}, pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
])
def test_refused_messages_answer_their_v2_code(change: dict[str, Any], code: int) -> None:
    m = _v2()
    for k, v in change.items():
        if k == "body":
            m.body = v
        elif k == "user_properties":
            m.user_properties.update(v)
        else:
            setattr(m.system_properties, k, v)
    with pytest.raises(convert.BadMessage) as e:
        convert.from_v2(m, 1024)
    assert e.value.code == code


def _with(props: dict[str, str] | None = None, tag: str | None = None, keys: list[str] | None = None,
          group: str | None = None) -> pb.Message:
    m = pb.Message(topic=pb.Resource(name="T"), body=b"hi", user_properties=props or {})
    m.system_properties.message_id = "01AB"
    if tag is not None:
        m.system_properties.tag = tag
    m.system_properties.keys.extend(keys or [])
    if group is not None:
        m.system_properties.message_type = pb.FIFO
        m.system_properties.message_group = group
    return m


KIB16 = 16 * 1024


@pytest.mark.parametrize("m,code,text", [
    (_with(keys=["k\u0000"]), pb.ILLEGAL_MESSAGE_KEY, "key cannot contain control character"),
    (_with(keys=["  "]), pb.ILLEGAL_MESSAGE_KEY, "key cannot be the char sequence of whitespace"),
    (_with(keys=["x" * (KIB16 + 1)]), pb.MESSAGE_PROPERTIES_TOO_LARGE,
     "the total size of user property is too large, max is 16384"),
    (_with(tag="t\u0000"), pb.ILLEGAL_MESSAGE_TAG, "tag cannot contain control character"),
    (_with(tag="\t\n"), pb.ILLEGAL_MESSAGE_TAG, "tag cannot be the char sequence of whitespace"),
    (_with(tag="a|b"), pb.ILLEGAL_MESSAGE_TAG, "tag cannot contain '|'"),
    (_with(tag="x" * (KIB16 + 1)), pb.MESSAGE_PROPERTIES_TOO_LARGE,
     "the total size of user property is too large, max is 16384"),
    (_with({"k": "v\u0000"}), pb.ILLEGAL_MESSAGE_PROPERTY_KEY,
     "the value of property cannot contain control character"),
    (_with({"k\u009f": "v"}), pb.ILLEGAL_MESSAGE_PROPERTY_KEY,
     "the key of property cannot contain control character"),
    (_with({"TTL": "1"}), pb.ILLEGAL_MESSAGE_PROPERTY_KEY, "property is used by system: TTL"),
    (_with({f"p{i}": "v" for i in range(129)}), pb.MESSAGE_PROPERTIES_TOO_LARGE,
     "too many user properties, max is 128"),
    # 16 KiB + 1 byte together
    (_with({"k": "x" * (KIB16 // 2)}, tag="y" * (KIB16 // 4), keys=["z" * (KIB16 // 4)]),
     pb.MESSAGE_PROPERTIES_TOO_LARGE, "the total size of user property is too large, max is 16384"),
    (_with(group="g\u0001"), pb.ILLEGAL_MESSAGE_GROUP, "message group cannot contain control character"),
    (_with(group="g" * 64), pb.ILLEGAL_MESSAGE_GROUP, "message group exceed the max size 64"),
], ids=["key-nul", "key-blank", "key-16k", "tag-nul", "tag-blank", "tag-bar", "tag-16k", "value-nul",
        "name-c1", "system-name", "129-props", "all-16k", "group-ctl", "group-64"])
def test_the_proxys_message_checks_answer_its_codes_and_texts(m: pb.Message, code: int, text: str) -> None:
    with pytest.raises(convert.BadMessage) as e:
        convert.from_v2(m, 1024)
    assert (e.value.code, str(e.value)) == (code, text)


def test_messages_at_the_limits_pass_and_the_limits_are_parameters() -> None:
    at_size = _with({"k": "x" * (KIB16 // 2 - 1)}, tag="y" * (KIB16 // 4), keys=["z" * (KIB16 // 4)])
    assert convert.from_v2(at_size, 1024).properties["TAGS"] == "y" * (KIB16 // 4)
    assert len(convert.from_v2(_with({f"p{i}": "v" for i in range(128)}), 1024).properties) == 128 + 1
    assert convert.from_v2(_with(group="g" * 63), 1024).group == "g" * 63
    assert "TAGS" not in convert.from_v2(_with(tag=""), 1024).properties  # an empty tag is no tag
    small = convert.Limits(max_property_size=10, max_property_num=1, max_group_size=4)
    with pytest.raises(convert.BadMessage, match="max is 10"):
        convert.from_v2(_with(keys=["k" * 11]), 1024, small)
    with pytest.raises(convert.BadMessage, match="max is 1"):
        convert.from_v2(_with({"a": "1", "b": "2"}), 1024, small)
    with pytest.raises(convert.BadMessage, match="max size 4"):
        convert.from_v2(_with(group="gggg"), 1024, small)


def test_a_stored_message_reads_back_as_5x_with_its_digest_and_handle() -> None:
    msg = MessageExt(topic="T", body=b"body", properties={"TAGS": "t", "KEYS": "a b", "UNIQ_KEY": "01X",
                                                         "__SHARDINGKEY": "g", "u": "v", "WAIT": "true"},
                     queue_id=2, queue_offset=7, born_timestamp=1000, store_timestamp=2000)
    m = convert.to_v2(msg, "2.7.9", 3, 30_000)
    sp = m.system_properties
    assert (sp.tag, list(sp.keys), sp.message_id, sp.message_group) == ("t", ["a", "b"], "01X", "g")
    assert (sp.receipt_handle, sp.delivery_attempt, sp.queue_id, sp.queue_offset) == ("2.7.9", 3, 2, 7)
    assert sp.message_type == pb.FIFO and sp.body_encoding == pb.IDENTITY
    assert (sp.body_digest.type, sp.body_digest.checksum) == (pb.MD5, "841A2D689AD86BD1611447453C22C6FC")
    # b"K1" has CRC32 038A840B, which the Java client writes without its leading zero: MD5 has no such case
    k1 = convert.to_v2(MessageExt(topic="T", body=b"K1"), "h", 1, 30_000).system_properties.body_digest
    assert (k1.type, k1.checksum) == (pb.MD5, "A1BBA9704DA78D22C74F1C2B0ACF4213")
    assert dict(m.user_properties) == {"u": "v"}


def test_fifo_queue_is_javas_string_hash_of_the_group() -> None:
    assert convert.fifo_queue("g1", 4) == abs(convert.java_string_hash("g1")) % 4
    assert {convert.fifo_queue("order-42", 8) for _ in range(3)} == {convert.fifo_queue("order-42", 8)}


def test_receipt_handles_round_trip_and_junk_is_refused() -> None:
    r = convert.Receipt(3, 1234, 99)
    assert convert.parse_receipt(r.encode()) == r
    for junk in ("", "1.2", "a.b.c", "1.2.3.4", "-1.2.3"):
        assert convert.parse_receipt(junk) is None


# --- the in-flight table --------------------------------------------------------------------------------
async def test_in_flight_table_advances_over_contiguous_done_offsets_and_persists(tmp_path: Path) -> None:
    t = PopTable(tmp_path)
    st = t.state("G", "T", 0, 5)
    e5, e6, e7 = (t.deliver(st, o, 1000) for o in (5, 6, 7))
    assert st.next == 8 and st.settle() == 5
    assert t.ack(st, 6, e6.gen) == "ok" and st.settle() == 5  # 5 still in flight
    assert t.ack(st, 5, e5.gen + 100) == "stale"
    assert t.ack(st, 5, e5.gen) == "ok" and st.settle() == 7
    assert t.ack(st, 5, e5.gen) == "ok"  # again: already done
    assert t.ack(st, 9, 1) == "unknown"
    gen7 = e7.gen
    again = t.deliver(st, 7, 2000)  # a redelivery
    assert (again.attempt, again.gen > gen7) == (2, True)
    assert t.change(st, 7, gen7, 5000) is None  # the old handle
    changed = t.change(st, 7, again.gen, 5000)
    assert changed is not None and changed.until_ms == 5000
    await t.save()
    back = PopTable(tmp_path).get("G", "T", 0)
    assert back is not None
    assert (back.committed, back.next, back.inflight[7].until_ms, back.inflight[7].attempt) == (7, 8, 5000, 2)
    assert json.loads((tmp_path / "popInflight.json").read_text())["seq"] == t.seq


async def test_a_telemetry_stream_takes_no_4x_request() -> None:
    from chronomq.grpc.telemetry import TelemetryChannel
    from chronomq.remoting.codec import RemotingCommand
    from chronomq.remoting.codes import RequestCode

    channel = TelemetryChannel("client-1", "ipv4:10.0.0.1:5")
    with pytest.raises(ConnectionError, match=r"client-1 is a 5\.x client"):
        await channel.invoke(RemotingCommand.request(RequestCode.GET_CONSUMER_RUNNING_INFO, {}))


def test_an_ack_answers_a_typed_outcome(tmp_path: Path) -> None:
    t = PopTable(tmp_path)
    st = t.state("G", "T", 0, 0)
    e = t.deliver(st, 0, 1000)
    assert t.ack(st, 0, e.gen + 1) is AckOutcome.STALE and t.ack(st, 0, e.gen) is AckOutcome.OK
    assert t.ack(st, 5, 1) is AckOutcome.UNKNOWN


def test_grpc_listen_port_is_checked() -> None:
    with pytest.raises(ConfigError):
        BrokerConfig.load(None, {"listenPort": "10911", "grpcListenPort": "10911"})
    with pytest.raises(ConfigError):
        BrokerConfig.load(None, {"grpcListenPort": "-2"})
    assert BrokerConfig().grpcListenPort == -1  # embedded brokers: off unless asked


def test_the_commands_default_grpc_to_8081_unless_configured(tmp_path: Path) -> None:
    from argparse import Namespace

    from chronomq.cli.main import load_config

    base = {"set": None, "data_dir": str(tmp_path), "host": "127.0.0.1", "config": None, "broker_port": None}
    assert load_config(Namespace(**base)).grpcListenPort == 8081
    assert load_config(Namespace(**{**base, "set": ["grpcListenPort=-1"]})).grpcListenPort == -1
    conf = tmp_path / "broker.conf"
    conf.write_text("grpcListenPort=9000\n")
    assert load_config(Namespace(**{**base, "config": str(conf)})).grpcListenPort == 9000
    with pytest.raises(ConfigError, match=r"missing\.conf"):  # the file's error, not the default's
        load_config(Namespace(**{**base, "config": str(tmp_path / "missing.conf")}))


# --- the endpoint, in process ----------------------------------------------------------------------------
class Env:
    def __init__(self, tmp_path: Path, **overrides: str) -> None:
        from chronomq.broker.controller import BrokerController

        self.routes = RouteInfoManager()
        # invisible durations from 1 s (RocketMQ's proxy: 10 s) so that redeliveries come back quickly
        values = {"storePathRootDir": str(tmp_path / "store"), "listenPort": str(free_port()),
                  "haListenPort": str(free_port()), "metricsPort": "-1", "grpcListenPort": "0",
                  "minInvisibleTimeMillsForRecv": "1000", **overrides}
        self.config, _ = BrokerConfig.load(None, values)
        self.broker = BrokerController(self.config, SystemClock(), local_register=self.routes.register_broker)
        self.channel: grpc.aio.Channel | None = None

    async def start(self) -> Env:
        await self.broker.start()
        assert self.broker.grpc is not None
        self.channel = grpc.aio.insecure_channel(self.broker.grpc_addr)
        return self

    async def call(self, method: str, req: Any, resp_type: Any, timeout: float = 10) -> Any:
        assert self.channel is not None
        fn = self.channel.unary_unary(SERVICE + method, request_serializer=type(req).SerializeToString,
                                      response_deserializer=resp_type.FromString)
        return await fn(req, timeout=timeout)

    async def send(self, topic: str, body: bytes, mid: str, **sp: Any) -> pb.SendMessageResponse:
        m = pb.Message(topic=pb.Resource(name=topic), body=body)
        m.system_properties.message_id = mid
        m.system_properties.body_encoding = pb.IDENTITY
        m.system_properties.message_type = pb.NORMAL
        for k, v in sp.items():
            if k == "keys":
                m.system_properties.keys.extend(v)
            else:
                setattr(m.system_properties, k, v)
        r = await self.call("SendMessage", pb.SendMessageRequest(messages=[m]), pb.SendMessageResponse)
        await self.dispatched()
        return r

    async def dispatched(self) -> None:
        """The consume-queue entries of every put so far are written (a receive reads those)."""
        store = self.broker.store
        assert await asyncio.to_thread(store.wait_dispatched, store.max_phy_offset, 5)

    async def receive(self, topic: str, group: str = "G", *, queue: int = -1, batch: int = 16,
                      invisible_ms: int = 30_000, poll_ms: int | None = 0, timeout: float | None = None,
                      tag: str = "*") -> tuple[pb.Status, list[pb.Message]]:
        """A receive; ``poll_ms`` None sends no long_polling_timeout (as the Java client does)."""
        assert self.channel is not None
        req = pb.ReceiveMessageRequest(group=pb.Resource(name=group), batch_size=batch,
                                       message_queue=pb.MessageQueue(topic=pb.Resource(name=topic), id=queue),
                                       filter_expression=pb.FilterExpression(type=pb.TAG, expression=tag),
                                       invisible_duration=convert.duration(invisible_ms))
        if poll_ms is not None:
            req.long_polling_timeout.CopyFrom(convert.duration(poll_ms))
        fn = self.channel.unary_stream(SERVICE + "ReceiveMessage", request_serializer=req.SerializeToString,
                                       response_deserializer=pb.ReceiveMessageResponse.FromString)
        items = [r async for r in fn(req, timeout=timeout or (poll_ms or 0) / 1000 + 10)]
        statuses = [r.status for r in items if r.WhichOneof("content") == "status"]
        assert len(statuses) == 1 and items[-1].WhichOneof("content") == "delivery_timestamp"
        return statuses[0], [r.message for r in items if r.WhichOneof("content") == "message"]

    async def ack(self, topic: str, m: pb.Message, group: str = "G") -> pb.AckMessageResponse:
        entry = pb.AckMessageEntry(message_id=m.system_properties.message_id,
                                   receipt_handle=m.system_properties.receipt_handle)
        req = pb.AckMessageRequest(group=pb.Resource(name=group), topic=pb.Resource(name=topic),
                                   entries=[entry])
        return await self.call("AckMessage", req, pb.AckMessageResponse)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        await self.broker.shutdown()


@pytest.fixture
async def env(tmp_path: Path):
    e = await Env(tmp_path).start()
    yield e
    await e.close()


async def test_unknown_rpcs_answer_unimplemented_and_refusals_a_v2_status(env: Env) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await env.call("PullMessage", pb.QueryRouteRequest(), pb.QueryRouteResponse)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    r = await env.call("QueryRoute", pb.QueryRouteRequest(topic=pb.Resource(name="bad topic!")),
                       pb.QueryRouteResponse)
    assert r.status.code == pb.ILLEGAL_TOPIC


async def test_a_route_to_a_missing_topic_is_not_found_and_creates_nothing(env: Env) -> None:
    assert env.config.autoCreateTopicEnable  # RocketMQ's proxy answers so with it on too
    r = await env.call("QueryRoute", pb.QueryRouteRequest(topic=pb.Resource(name="Nope")),
                       pb.QueryRouteResponse)
    assert (r.status.code, r.status.message) == \
        (pb.TOPIC_NOT_FOUND, "No topic route info in name server for the topic: Nope")
    assert env.broker.topics.get("Nope") is None and not r.message_queues


async def test_system_topics_are_refused_as_illegal_topics_like_rocketmqs_proxy(env: Env) -> None:
    for topic in ("TBW102", "RMQ_SYS_TRANS_HALF_TOPIC", "rmq_sys_anything"):
        r = await env.call("QueryRoute", pb.QueryRouteRequest(topic=pb.Resource(name=topic)),
                           pb.QueryRouteResponse)
        assert (r.status.code, r.status.message) == (pb.ILLEGAL_TOPIC, "cannot access system topic"), topic
    msg = _v2()
    msg.topic.name = "TBW102"
    r = await env.call("SendMessage", pb.SendMessageRequest(messages=[msg]), pb.SendMessageResponse)
    assert [e.status.code for e in r.entries] == [pb.ILLEGAL_TOPIC]
    env.broker.topics.create_in_send("%RETRY%G", None, 0)
    r = await env.call("QueryRoute", pb.QueryRouteRequest(topic=pb.Resource(name="%RETRY%G")),
                       pb.QueryRouteResponse)
    assert r.status.code == pb.OK  # retry topics are not system topics


async def test_route_points_at_this_endpoint_and_settings_are_completed(env: Env) -> None:
    env.broker.topics.create_in_send("TR", None, 0)
    r = await env.call("QueryRoute", pb.QueryRouteRequest(topic=pb.Resource(name="TR")),
                       pb.QueryRouteResponse)
    assert r.status.code == pb.OK and len(r.message_queues) == env.config.defaultTopicQueueNums
    q = r.message_queues[0]
    host, port = env.broker.grpc_addr.rsplit(":", 1)
    assert (q.broker.id, q.broker.endpoints.addresses[0].host, q.broker.endpoints.addresses[0].port) == \
        (0, host, int(port))
    assert q.permission == pb.READ_WRITE and set(q.accept_message_types) == {1, 2, 3, 4}
    assert env.channel is not None
    stream = env.channel.stream_stream(SERVICE + "Telemetry",
                                       request_serializer=pb.TelemetryCommand.SerializeToString,
                                       response_deserializer=pb.TelemetryCommand.FromString)(timeout=10)
    await stream.write(pb.TelemetryCommand(settings=pb.Settings(client_type=pb.PRODUCER,
                                                                publishing=pb.Publishing())))
    reply = await stream.read()
    assert reply.status.code == pb.OK
    assert reply.settings.publishing.max_body_size == env.config.maxMessageSize
    await stream.write(pb.TelemetryCommand(settings=pb.Settings(client_type=pb.SIMPLE_CONSUMER,
                                                                subscription=pb.Subscription())))
    reply = await stream.read()
    assert reply.settings.subscription.receive_batch_size == 32
    assert reply.settings.backoff_policy.max_attempts == env.config.maxReconsumeTimes + 1
    await stream.done_writing()
    hb = await env.call("Heartbeat", pb.HeartbeatRequest(client_type=pb.PRODUCER), pb.HeartbeatResponse)
    assert hb.status.code == pb.OK


async def test_send_receive_ack_and_redelivery_with_attempt_plus_one(env: Env) -> None:
    r = await env.send("TS", b"one", "01A1", tag="x")
    assert r.status.code == pb.OK and r.entries[0].message_id == "01A1"
    # invisible for 3 s: time enough, on a slow machine too, for the next receive to find it invisible
    st, msgs = await env.receive("TS", invisible_ms=3000, poll_ms=5000)
    assert st.code == pb.OK and [m.body for m in msgs] == [b"one"]
    first = msgs[0]
    assert first.system_properties.delivery_attempt == 1 and first.system_properties.tag == "x"
    st, msgs = await env.receive("TS", invisible_ms=1000)  # invisible now
    assert st.code == pb.MESSAGE_NOT_FOUND and msgs == []
    st, msgs = await env.receive("TS", invisible_ms=30_000, poll_ms=8000)  # the long poll wakes at expiry
    assert [m.system_properties.delivery_attempt for m in msgs] == [2]
    stale = await env.ack("TS", first)
    assert stale.status.code == pb.INVALID_RECEIPT_HANDLE
    ok = await env.ack("TS", msgs[0])
    assert ok.status.code == pb.OK
    q = msgs[0].system_properties.queue_id
    assert env.broker.offsets.query("G", "TS", q) == msgs[0].system_properties.queue_offset + 1


async def test_long_poll_wakes_on_a_send(env: Env) -> None:
    await env.send("TL", b"warm", "01B0")
    _, msgs = await env.receive("TL", poll_ms=0)
    await env.ack("TL", msgs[0])
    waiting = asyncio.ensure_future(env.receive("TL", poll_ms=8000))
    await async_wait_for(lambda: env.broker.hold.held > 0, message="the receive is held")
    assert not waiting.done()
    await env.send("TL", b"later", "01B1")
    _, msgs = await asyncio.wait_for(waiting, 8)
    assert [m.body for m in msgs] == [b"later"]


async def test_a_receive_naming_one_queue_gets_the_messages_of_every_queue(env: Env) -> None:
    # RocketMQ's proxy pops from the whole broker whatever queue the request names; the Node.js client
    # names queue 0 only, so a receive limited to it would never see the other queues' messages
    for i in range(8):
        await env.send("TQ", f"q{i}".encode(), f"01Q{i}")
    st, msgs = await env.receive("TQ", queue=0)
    assert st.code == pb.OK
    assert sorted(m.body for m in msgs) == [f"q{i}".encode() for i in range(8)]
    assert len({m.system_properties.queue_id for m in msgs}) > 1


async def test_change_invisible_duration_gives_a_new_handle(env: Env) -> None:
    await env.send("TC", b"m", "01C1")
    _, msgs = await env.receive("TC")
    m = msgs[0]
    req = pb.ChangeInvisibleDurationRequest(group=pb.Resource(name="G"), topic=pb.Resource(name="TC"),
                                            receipt_handle=m.system_properties.receipt_handle,
                                            invisible_duration=convert.duration(0), message_id="01C1")
    r = await env.call("ChangeInvisibleDuration", req, pb.ChangeInvisibleDurationResponse)
    assert r.status.code == pb.OK and r.receipt_handle != m.system_properties.receipt_handle
    again = await env.call("ChangeInvisibleDuration", req, pb.ChangeInvisibleDurationResponse)
    assert again.status.code == pb.INVALID_RECEIPT_HANDLE  # the old handle
    _, msgs = await env.receive("TC")  # visible at once (duration 0)
    assert [m.system_properties.delivery_attempt for m in msgs] == [2]


async def test_a_send_is_checked_as_the_proxy_checks_it_with_the_configured_limits(tmp_path: Path) -> None:
    env = await Env(tmp_path, maxUserPropertySize="64").start()
    try:
        r = await env.send("TV", b"m", "01V1", keys=["k\u0000"])
        assert (r.entries[0].status.code, r.entries[0].status.message) == \
            (pb.ILLEGAL_MESSAGE_KEY, "key cannot contain control character")
        r = await env.send("TV", b"m", "01V2", tag="t" * 65)
        assert (r.entries[0].status.code, r.entries[0].status.message) == \
            (pb.MESSAGE_PROPERTIES_TOO_LARGE, "the total size of user property is too large, max is 64")
        assert (await env.send("TV", b"m", "01V3", tag="t" * 64)).status.code == pb.OK
    finally:
        await env.close()


async def test_a_receive_invisible_duration_is_within_the_proxys_bounds(tmp_path: Path) -> None:
    env = await Env(tmp_path, minInvisibleTimeMillsForRecv="10000").start()  # RocketMQ's default
    try:
        await env.send("TI", b"m", "01I1")
        st, _ = await env.receive("TI", invisible_ms=9_999)
        assert (st.code, st.message) == \
            (pb.ILLEGAL_INVISIBLE_TIME, "the invisibleTime is too small. min is 10000")
        st, _ = await env.receive("TI", invisible_ms=43_200_001)
        assert (st.code, st.message) == \
            (pb.ILLEGAL_INVISIBLE_TIME, "the invisibleTime is too large. max is 43200000")
        st, msgs = await env.receive("TI", invisible_ms=10_000)
        assert st.code == pb.OK and len(msgs) == 1
        req = pb.ChangeInvisibleDurationRequest(group=pb.Resource(name="G"), topic=pb.Resource(name="TI"),
                                                receipt_handle=msgs[0].system_properties.receipt_handle,
                                                invisible_duration=convert.duration(43_200_001))
        r = await env.call("ChangeInvisibleDuration", req, pb.ChangeInvisibleDurationResponse)
        assert (r.status.code, r.status.message) == \
            (pb.ILLEGAL_INVISIBLE_TIME, "the invisibleTime is too large. max is 43200000")
    finally:
        await env.close()
    with pytest.raises(ConfigError, match="minInvisibleTimeMillsForRecv"):
        BrokerConfig.load(None, {"minInvisibleTimeMillsForRecv": "-1"})


async def test_an_expired_receipt_handle_is_refused_though_the_message_was_not_redelivered(env: Env) -> None:
    await env.send("TE", b"late", "01X1")
    _, msgs = await env.receive("TE", invisible_ms=1000)
    m = msgs[0]
    r = convert.parse_receipt(m.system_properties.receipt_handle)
    until = env.broker.grpc.svc.pop.get("G", "TE", r.queue_id).inflight[r.offset].until_ms  # pop time + 1 s
    await async_wait_for(lambda: env.broker.clock.now_ms() >= until, message="the invisible time ends")
    r = await env.ack("TE", m)
    assert (r.entries[0].status.code, r.entries[0].status.message) == \
        (pb.INVALID_RECEIPT_HANDLE, "receipt handle is expired")
    # the answer's own status names the code, as the proxy's: the Java client's exception text is read there
    assert (r.status.code, r.status.message) == (pb.INVALID_RECEIPT_HANDLE, "INVALID_RECEIPT_HANDLE")
    req = pb.ChangeInvisibleDurationRequest(group=pb.Resource(name="G"), topic=pb.Resource(name="TE"),
                                            receipt_handle=m.system_properties.receipt_handle,
                                            invisible_duration=convert.duration(30_000))
    c = await env.call("ChangeInvisibleDuration", req, pb.ChangeInvisibleDurationResponse)
    assert (c.status.code, c.status.message) == (pb.INVALID_RECEIPT_HANDLE, "receipt handle is expired")
    _, again = await env.receive("TE")  # it comes back, and that delivery's handle acks it
    assert [x.system_properties.delivery_attempt for x in again] == [2]
    assert (await env.ack("TE", again[0])).status.code == pb.OK


async def test_a_receive_without_long_polling_timeout_is_held_until_near_its_deadline(env: Env) -> None:
    await env.send("TW", b"warm", "01W0")
    _, msgs = await env.receive("TW")
    await env.ack("TW", msgs[0])
    waiting = asyncio.ensure_future(env.receive("TW", poll_ms=None, timeout=15))
    await async_wait_for(lambda: env.broker.hold.held > 0, message="the receive is held")
    await env.send("TW", b"later", "01W1")
    _, msgs = await asyncio.wait_for(waiting, 10)
    assert [m.body for m in msgs] == [b"later"]


async def test_the_default_long_poll_is_the_deadline_less_half_the_request_timeout(env: Env) -> None:
    svc = env.broker.grpc.svc

    class Ctx:
        def invocation_metadata(self) -> list[tuple[str, str]]:
            return [("x-mq-client-id", "C1")]

    poll = svc._default_poll_ms
    assert poll(Ctx(), 20_000) == 20_000 - 1_500  # the Java client's default request timeout: 3 s
    svc._request_timeouts["C1"] = 10_000  # from the client's settings
    assert poll(Ctx(), 20_000) == 15_000  # awaitDuration 10 s + requestTimeout 10 s: held 15 s
    assert poll(Ctx(), 60_000) == 20_000  # grpcClientConsumerMaxLongPollingTimeoutMillis
    assert poll(Ctx(), 8_000) == 5_000  # grpcClientConsumerMinLongPollingTimeoutMillis
    assert poll(Ctx(), 3_000) == 3_000  # never past the deadline
    assert poll(Ctx(), None) == 20_000  # no deadline


async def test_fifo_messages_of_one_group_share_one_queue(env: Env) -> None:
    offsets = set()
    for i in range(4):
        r = await env.send("TF", f"f{i}".encode(), f"01F{i}", message_type=pb.FIFO, message_group="order-1")
        assert r.status.code == pb.OK
        offsets.add(r.entries[0].offset)
    _, msgs = await env.receive("TF")
    assert [m.body for m in msgs] == [b"f0", b"f1", b"f2", b"f3"]
    assert {m.system_properties.queue_id for m in msgs} == {convert.fifo_queue("order-1", 4)}
    assert {m.system_properties.message_group for m in msgs} == {"order-1"}


async def test_delay_goes_through_the_timer_and_can_be_recalled(env: Env) -> None:
    now = env.broker.clock.now_ms()
    r = await env.send("TD", b"later", "01D1", message_type=pb.DELAY)  # no time: refused
    assert r.status.code == pb.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE
    m = pb.Message(topic=pb.Resource(name="TD"), body=b"x")
    m.system_properties.message_id = "01D2"
    m.system_properties.message_type = pb.DELAY
    m.system_properties.delivery_timestamp.CopyFrom(convert.timestamp(now + 3600_000))
    r = await env.call("SendMessage", pb.SendMessageRequest(messages=[m]), pb.SendMessageResponse)
    assert r.status.code == pb.OK and r.entries[0].recall_handle
    assert env.broker.timer.stats()["pending"] == 1
    too_far = convert.timestamp(now + (env.config.timerMaxDelaySec + 60) * 1000)
    m.system_properties.delivery_timestamp.CopyFrom(too_far)
    r2 = await env.call("SendMessage", pb.SendMessageRequest(messages=[m]), pb.SendMessageResponse)
    assert r2.status.code == pb.ILLEGAL_DELIVERY_TIME
    recall = pb.RecallMessageRequest(topic=pb.Resource(name="TD"), recall_handle=r.entries[0].recall_handle)
    rr = await env.call("RecallMessage", recall, pb.RecallMessageResponse)
    assert rr.status.code == pb.OK and rr.message_id == "01D2"
    rr = await env.call("RecallMessage", recall, pb.RecallMessageResponse)
    assert rr.status.code == pb.NOT_FOUND  # a definite answer: recalled already


async def test_dead_letter_after_max_attempts(tmp_path: Path) -> None:
    env = await Env(tmp_path, maxReconsumeTimes="2").start()
    try:
        await env.send("TX", b"poison", "01E1")
        attempts = []
        for _ in range(3):
            _, msgs = await env.receive("TX", invisible_ms=1000, poll_ms=5000)
            attempts += [m.system_properties.delivery_attempt for m in msgs]
        assert attempts == [1, 2]  # the third receive moved it to %DLQ%G instead
        _, dlq = await env.receive("%DLQ%G", group="D")
        assert [m.body for m in dlq] == [b"poison"]
    finally:
        await env.close()


async def test_in_flight_messages_survive_a_restart_neither_lost_nor_early(tmp_path: Path) -> None:
    env = await Env(tmp_path).start()
    try:
        for i in range(3):
            await env.send("TP", f"p{i}".encode(), f"01P{i}", message_type=pb.FIFO, message_group="one")
        _, msgs = await env.receive("TP", batch=2, invisible_ms=60_000)
        assert [m.body for m in msgs] == [b"p0", b"p1"]
        await env.ack("TP", msgs[0])
    finally:
        await env.close()
    (tmp_path / "store" / "config" / "consumerOffset.json").unlink(missing_ok=True)  # as after a crash
    # the same store on a new port: the old one, released, may already be another test's free port
    env = await Env(tmp_path).start()
    try:
        q = msgs[1].system_properties.queue_id
        assert env.broker.offsets.query("G", "TP", q) == msgs[1].system_properties.queue_offset
        _, again = await env.receive("TP", invisible_ms=60_000)
        assert [m.body for m in again] == [b"p2"]  # p1 stays invisible, p0 stays acked
        ok = await env.ack("TP", msgs[1])  # the handle from before the restart still acks it
        assert ok.status.code == pb.OK
        assert env.broker.offsets.query("G", "TP", q) == again[0].system_properties.queue_offset
    finally:
        await env.close()


async def test_transactions_commit_rollback_and_an_orphan_checked_over_telemetry(tmp_path: Path) -> None:
    env = await Env(tmp_path, transactionTimeOut="1", transactionCheckInterval="3600000").start()
    try:
        async def half(body: bytes, mid: str) -> str:
            r = await env.send("TT", body, mid, message_type=pb.TRANSACTION)
            assert r.status.code == pb.OK and r.entries[0].transaction_id
            return r.entries[0].transaction_id

        async def end(mid: str, tx: str, resolution: int, source: int = pb.SOURCE_CLIENT,
                      topic: str = "TT") -> pb.EndTransactionResponse:
            req = pb.EndTransactionRequest(topic=pb.Resource(name=topic), message_id=mid, transaction_id=tx,
                                           resolution=resolution, source=source)
            return await env.call("EndTransaction", req, pb.EndTransactionResponse)

        assert (await end("01T1", await half(b"commit", "01T1"), pb.COMMIT)).status.code == pb.OK
        tx2 = await half(b"rollback", "01T2")
        assert (await end("01T2", tx2, pb.ROLLBACK, topic="Other")).status.code == pb.INVALID_TRANSACTION_ID
        assert (await end("01T2", tx2, pb.ROLLBACK)).status.code == pb.OK
        await half(b"orphan", "01T3")
        _, msgs = await env.receive("TT")
        assert [m.body for m in msgs] == [b"commit"]  # the orphan stays a half message
        assert env.channel is not None
        stream = env.channel.stream_stream(SERVICE + "Telemetry",
                                           request_serializer=pb.TelemetryCommand.SerializeToString,
                                           response_deserializer=pb.TelemetryCommand.FromString)(timeout=20)
        publishing = pb.Publishing(topics=[pb.Resource(name="TT")])
        await stream.write(pb.TelemetryCommand(settings=pb.Settings(client_type=pb.PRODUCER,
                                                                    publishing=publishing)))
        assert (await stream.read()).status.code == pb.OK
        tx = env.broker.transactions
        assert tx is not None
        await async_wait_for(lambda: tx.check_once()["checked"] == 1, message="the orphan is checked")
        cmd = await asyncio.wait_for(stream.read(), 10)
        rec = cmd.recover_orphaned_transaction_command
        assert (rec.message.body, rec.message.topic.name) == (b"orphan", "TT")
        assert rec.message.system_properties.message_id == "01T3"
        assert (await end("01T3", rec.transaction_id, pb.COMMIT, pb.SOURCE_SERVER_CHECK)).status.code == pb.OK
        await env.dispatched()
        _, msgs = await env.receive("TT")
        assert [m.body for m in msgs] == [b"orphan"]
        await stream.done_writing()
        await async_wait_for(lambda: "TT" not in env.broker.producers.groups, message="unregistered")
    finally:
        await env.close()


async def test_a_fifo_group_gets_a_queues_next_message_only_after_the_one_in_flight(tmp_path: Path) -> None:
    env = await Env(tmp_path, grpcFifoGroups="FG, other").start()
    try:
        for i in range(3):
            await env.send("TH", f"h{i}".encode(), f"01H{i}", message_type=pb.FIFO, message_group="g1")
        _, msgs = await env.receive("TH", group="FG", batch=1)
        assert [m.body for m in msgs] == [b"h0"]
        st, msgs2 = await env.receive("TH", group="FG")
        assert st.code == pb.MESSAGE_NOT_FOUND and msgs2 == []  # h1 waits for h0
        _, plain = await env.receive("TH", group="G")  # a group not listed is not held back
        assert [m.body for m in plain] == [b"h0", b"h1", b"h2"]
        held = env.receive("TH", group="FG", batch=1, invisible_ms=1000, poll_ms=8000)
        waiting = asyncio.ensure_future(held)
        await async_wait_for(lambda: env.broker.hold.held > 0, message="the FIFO receive is held")
        assert not waiting.done()
        await env.ack("TH", msgs[0], group="FG")  # wakes the held receive
        _, msgs = await asyncio.wait_for(waiting, 5)
        assert [m.body for m in msgs] == [b"h1"]
        # h1 is not acked: when its invisibility ends it comes back before h2
        _, msgs = await env.receive("TH", group="FG", poll_ms=5000)
        assert [(m.body, m.system_properties.delivery_attempt) for m in msgs] == [(b"h1", 2), (b"h2", 1)]
    finally:
        await env.close()


async def test_a_subscription_group_made_orderly_is_a_fifo_group(tmp_path: Path) -> None:
    from chronomq.broker.subgroups import SubscriptionGroupConfig

    env = await Env(tmp_path).start()
    try:
        assert env.broker.services.subgroups is not None
        env.broker.services.subgroups.update(SubscriptionGroupConfig("OG", consumeMessageOrderly=True))
        for i in range(2):
            await env.send("TO", f"o{i}".encode(), f"01O{i}", message_type=pb.FIFO, message_group="g1")
        _, msgs = await env.receive("TO", group="OG", batch=1)
        assert [m.body for m in msgs] == [b"o0"]
        st, held = await env.receive("TO", group="OG")
        assert st.code == pb.MESSAGE_NOT_FOUND and held == []  # o1 waits for o0, as in a grpcFifoGroups group
        env.broker.services.subgroups.update(SubscriptionGroupConfig("OG2"))
        _, plain = await env.receive("TO", group="OG2")  # a group that is not orderly is not held back
        assert [m.body for m in plain] == [b"o0", b"o1"]
    finally:
        await env.close()


def test_a_batch_answers_status_is_its_entries_code_by_name() -> None:
    from chronomq.grpc.service import overall_status

    def entry(code: int, text: str) -> pb.AckMessageResultEntry:
        return pb.AckMessageResultEntry(status=pb.Status(code=code, message=text))

    one = overall_status([entry(pb.OK, "fine"), entry(pb.OK, "also")], "ack")
    assert (one.code, one.message) == (pb.OK, "OK")
    mixed = overall_status([entry(pb.OK, "fine"), entry(pb.INVALID_RECEIPT_HANDLE, "expired")], "ack")
    assert (mixed.code, mixed.message) == (pb.MULTIPLE_RESULTS, "MULTIPLE_RESULTS")
    empty = overall_status([], "ack")
    assert (empty.code, empty.message) == (pb.INTERNAL_SERVER_ERROR, "ack message result is empty")


async def test_a_fifo_batch_partly_acked_comes_back_whole_from_its_first_message_not_acked(
        tmp_path: Path) -> None:
    # RocketMQ's orderly pop: an ack inside a batch does not commit past the message not acked before it
    env = await Env(tmp_path, grpcFifoGroups="FG").start()
    try:
        for i in range(6):
            await env.send("TB", f"b{i}".encode(), f"01B{i}", message_type=pb.FIFO, message_group="g1",
                           tag="other" if i == 2 else "t")
        _, batch = await env.receive("TB", group="FG", batch=3, invisible_ms=1000, tag="t")
        assert [m.body for m in batch] == [b"b0", b"b1", b"b3"]  # b2 is not the group's
        for m in batch[1:]:
            assert (await env.ack("TB", m, group="FG")).status.code == pb.OK
        _, again = await env.receive("TB", group="FG", batch=3, poll_ms=5000, tag="t")
        assert [(m.body, m.system_properties.delivery_attempt) for m in again] == \
            [(b"b0", 2), (b"b1", 2), (b"b3", 2)]
        for m in again:
            await env.ack("TB", m, group="FG")
        _, rest = await env.receive("TB", group="FG", batch=3, tag="t")
        assert [(m.body, m.system_properties.delivery_attempt) for m in rest] == [(b"b4", 1), (b"b5", 1)]
    finally:
        await env.close()


async def test_a_cancel_during_the_holds_cleanup_reaches_the_receive() -> None:
    """A receive's handler cancelled while its long-poll wait is tidying up (the client went away just as
    a message woke it) ends cancelled: the cancel is not taken for the wait's own."""
    from types import SimpleNamespace

    from chronomq.grpc.service import MessagingService

    task: asyncio.Task[None] | None = None

    async def hold_wait(*_args: object) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            assert task is not None
            task.cancel()  # the handler's own cancel, while it waits for this wait to end
            raise

    fake = SimpleNamespace(services=SimpleNamespace(hold=SimpleNamespace(wait=hold_wait)), store=None)
    unblocked = asyncio.Event()
    task = asyncio.ensure_future(MessagingService._wait(fake, "T", [(0, SimpleNamespace(next=0))], 0,
                                                        unblocked))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    unblocked.set()  # the wait wakes and cancels the hold's wait
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
