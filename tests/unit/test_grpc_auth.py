"""Credentials on the 5.x endpoint: the clients' MQv2-HMAC-SHA1 signature, what each RPC needs, and a broker
with aclEnable whose endpoint serves signed calls and refuses the others with UNAUTHORIZED."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio and protobuf (chronomq dependencies) are not installed")

from tests.unit.test_grpc import SERVICE, Env  # noqa: E402

from chronomq.acl.plain import ANY, PUB, SUB  # noqa: E402
from chronomq.acl.validator import AclError  # noqa: E402
from chronomq.grpc._proto import rocketmq_v2_pb2 as pb  # noqa: E402
from chronomq.grpc.auth import need, parse_authorization, sign  # noqa: E402

ACL = """
accounts:
  - accessKey: RocketMQ
    secretKey: 12345678
    defaultTopicPerm: DENY
    defaultGroupPerm: SUB
    topicPerms:
      - TopicA=PUB|SUB
      - TopicS=SUB
    groupPerms:
      - GroupX=DENY
  - accessKey: whitelisted
    secretKey: 87654321
    whiteRemoteAddress: 127.0.0.1
    defaultTopicPerm: PUB|SUB
"""


def test_the_signature_is_hmac_sha1_of_the_date_time_in_hex() -> None:
    # `printf %s 20231227T194619Z | openssl dgst -sha1 -hmac 12345678`
    assert sign("12345678", "20231227T194619Z") == "b78a646b41b898e9a4b565927a888b247ea32e86"
    header = ("MQv2-HMAC-SHA1 Credential=abc, SignedHeaders=x-mq-date-time, "
              "Signature=D18A9CBCDDBA9041D6693268FEF15A989E64430B")  # RocketMQ's own test value
    assert parse_authorization(header) == ("abc", "D18A9CBCDDBA9041D6693268FEF15A989E64430B")
    assert parse_authorization("MQv2-HMAC-SHA1 Credential=abc//Rocketmq, Signature=ff")[0] == "abc"
    for bad in ("MQv2-HMAC-SHA1", "MQv2-HMAC-SHA1 Credential", "MQv2-HMAC-SHA1 Signature=ff"):
        with pytest.raises(AclError):
            parse_authorization(bad)


def _res(name: str) -> pb.Resource:
    return pb.Resource(name=name)


def test_each_rpc_needs_what_rocketmqs_proxy_asks() -> None:
    send = pb.SendMessageRequest(messages=[pb.Message(topic=_res("T")), pb.Message(topic=_res("U"))])
    assert need("SendMessage", send) == {"T": PUB, "U": PUB}
    assert need("EndTransaction", pb.EndTransactionRequest(topic=_res("T"))) == {"T": PUB}
    assert need("RecallMessage", pb.RecallMessageRequest(topic=_res("T"))) == {"T": PUB}
    assert need("QueryRoute", pb.QueryRouteRequest(topic=_res("T"))) == {"T": ANY}
    sub = {"T": SUB, "%RETRY%G": SUB}
    recv = pb.ReceiveMessageRequest(group=_res("G"), message_queue=pb.MessageQueue(topic=_res("T")))
    assert need("ReceiveMessage", recv) == sub
    assert need("AckMessage", pb.AckMessageRequest(group=_res("G"), topic=_res("T"))) == sub
    assert need("ChangeInvisibleDuration",
                pb.ChangeInvisibleDurationRequest(group=_res("G"), topic=_res("T"))) == sub
    assert need("ForwardMessageToDeadLetterQueue",
                pb.ForwardMessageToDeadLetterQueueRequest(group=_res("G"), topic=_res("T"))) == sub
    assert need("QueryAssignment", pb.QueryAssignmentRequest(group=_res("G"), topic=_res("T"))) == sub
    assert need("Heartbeat", pb.HeartbeatRequest(group=_res("G"))) == {"%RETRY%G": SUB}
    assert need("Heartbeat", pb.HeartbeatRequest(client_type=pb.PRODUCER)) == {}  # a producer: no group
    assert need("NotifyClientTermination", pb.NotifyClientTerminationRequest(group=_res("G"))) == {
        "%RETRY%G": SUB}
    producer = pb.TelemetryCommand(settings=pb.Settings(publishing=pb.Publishing(topics=[_res("T")])))
    assert need("Telemetry", producer) == {"T": PUB}
    consumer = pb.TelemetryCommand(settings=pb.Settings(subscription=pb.Subscription(
        group=_res("G"), subscriptions=[pb.SubscriptionEntry(topic=_res("T"))])))
    assert need("Telemetry", consumer) == sub
    assert need("Telemetry", pb.TelemetryCommand(status=pb.Status())) == {}


def _md(ak: str | None, secret: str, when: float | None = None) -> tuple[tuple[str, str], ...]:
    if ak is None:
        return ()
    dt = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when if when is not None else time.time()))
    return (("x-mq-date-time", dt), ("authorization", "MQv2-HMAC-SHA1 Credential=" + ak
                                     + ", SignedHeaders=x-mq-date-time, Signature=" + sign(secret, dt)))


async def _unary(env: Env, rpc: str, req: Any, resp: Any, md: Any) -> Any:
    assert env.channel is not None
    fn = env.channel.unary_unary(SERVICE + rpc, request_serializer=type(req).SerializeToString,
                                 response_deserializer=resp.FromString)
    return await fn(req, metadata=md, timeout=10)


async def _receive(env: Env, md: Any, topic: str = "TopicA", group: str = "G") -> pb.Status:
    assert env.channel is not None
    req = pb.ReceiveMessageRequest(group=_res(group), batch_size=1,
                                   message_queue=pb.MessageQueue(topic=_res(topic), id=-1),
                                   filter_expression=pb.FilterExpression(type=pb.TAG, expression="*"))
    req.invisible_duration.seconds = 10
    req.long_polling_timeout.seconds = 0
    fn = env.channel.unary_stream(SERVICE + "ReceiveMessage", request_serializer=req.SerializeToString,
                                  response_deserializer=pb.ReceiveMessageResponse.FromString)
    items = [r async for r in fn(req, metadata=md, timeout=10)]
    return next(r.status for r in items if r.WhichOneof("content") == "status")


async def _telemetry(env: Env, md: Any, cmd: pb.TelemetryCommand) -> pb.Status:
    assert env.channel is not None
    fn = env.channel.stream_stream(SERVICE + "Telemetry",
                                   request_serializer=pb.TelemetryCommand.SerializeToString,
                                   response_deserializer=pb.TelemetryCommand.FromString)
    call = fn(metadata=md, timeout=10)
    await call.write(cmd)
    first = await call.read()
    call.cancel()
    return first.status


def _send(topic: str) -> pb.SendMessageRequest:
    m = pb.Message(topic=_res(topic), body=b"x")
    m.system_properties.message_id = "01" + topic
    m.system_properties.body_encoding = pb.IDENTITY
    m.system_properties.message_type = pb.NORMAL
    return pb.SendMessageRequest(messages=[m])


@pytest.fixture
async def acl_env(tmp_path: Path):
    (tmp_path / "acl.yml").write_text(ACL)
    e = await Env(tmp_path, aclEnable="true", aclFile=str(tmp_path / "acl.yml"),
                  aclRequireTimestamp="true", aclReplayWindowMs="60000").start()
    yield e
    await e.close()


async def test_an_acl_broker_serves_signed_calls_and_refuses_the_others_on_every_rpc(
    acl_env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    env = acl_env
    ok, wrong, none = _md("RocketMQ", "12345678"), _md("RocketMQ", "wrong-secret"), _md(None, "")
    unknown, stale = _md("nobody00", "12345678"), _md("RocketMQ", "12345678", time.time() - 600)
    route = pb.QueryRouteRequest(topic=_res("TopicA"))
    hb = pb.HeartbeatRequest(group=_res("G"), client_type=pb.SIMPLE_CONSUMER)
    settings = pb.TelemetryCommand(settings=pb.Settings(publishing=pb.Publishing(topics=[_res("TopicA")])))
    r = await _unary(env, "SendMessage", _send("TopicA"), pb.SendMessageResponse, ok)
    assert r.status.code == pb.OK
    assert (await _unary(env, "QueryRoute", route, pb.QueryRouteResponse, ok)).status.code == pb.OK
    assert (await _unary(env, "Heartbeat", hb, pb.HeartbeatResponse, ok)).status.code == pb.OK
    assert (await _receive(env, ok)).code in (pb.OK, pb.MESSAGE_NOT_FOUND)
    assert (await _telemetry(env, ok, settings)).code == pb.OK
    caplog.set_level(logging.WARNING, "chronomq.grpc")
    for md in (wrong, none, unknown, stale):
        for rpc, req, resp in (("SendMessage", _send("TopicA"), pb.SendMessageResponse),
                               ("QueryRoute", route, pb.QueryRouteResponse),
                               ("Heartbeat", hb, pb.HeartbeatResponse)):
            assert (await _unary(env, rpc, req, resp, md)).status.code == pb.UNAUTHORIZED
        assert (await _receive(env, md)).code == pb.UNAUTHORIZED
        assert (await _telemetry(env, md, settings)).code == pb.UNAUTHORIZED
    # right credentials, a resource not allowed
    r = await _unary(env, "SendMessage", _send("TopicS"), pb.SendMessageResponse, ok)
    assert r.status.code == pb.UNAUTHORIZED and "TopicS" in r.status.message
    assert (await _receive(env, ok, group="GroupX")).code == pb.UNAUTHORIZED
    denied = pb.TelemetryCommand(settings=pb.Settings(publishing=pb.Publishing(topics=[_res("TopicB")])))
    assert (await _telemetry(env, ok, denied)).code == pb.UNAUTHORIZED
    # an account white address passes without a signature
    assert (await _unary(env, "SendMessage", _send("TopicB"), pb.SendMessageResponse,
                         _md("whitelisted", "nope"))).status.code == pb.OK
    lines = [r.getMessage() for r in caplog.records if "ACL: refused" in r.getMessage()]
    assert len(lines) == 4 * 5 + 3
    assert any("SendMessage" in s and "AccessKey RocketMQ" in s and "127.0.0.1" in s for s in lines)
    # who and what: the refused send names its topic and the action it needs
    assert any(s.startswith("ACL: refused SendMessage (topic:TopicS Pub) from ") for s in lines), lines
    assert any("replay" in s for s in lines) and not any("12345678" in s for s in lines)


def test_white_addresses_pass_a_blank_credential_and_the_date_time_window_is_kept(tmp_path: Path) -> None:
    from chronomq.acl.validator import AclValidator
    from chronomq.clock import VirtualClock
    from chronomq.grpc.auth import Guard, date_time_ms

    (tmp_path / "acl.yml").write_text("globalWhiteRemoteAddresses: [10.1.*.*]\n" + ACL)
    clock = VirtualClock(date_time_ms("20260101T120000Z"))
    guard = Guard(AclValidator(tmp_path / "acl.yml", clock.now_ms), clock.now_ms, require_date_time=True,
                  window_ms=60_000)
    # what the Python client sends with Credentials(): a Credential of nothing, signed with no secret
    blank = {"x-mq-date-time": "20260101T120000Z", "authorization":
             "MQv2-HMAC-SHA1 Credential=, SignedHeaders=x-mq-date-time, Signature=" + sign("", "x")}
    send = _send("TopicA")
    assert guard.refusal("SendMessage", send, blank, "10.1.2.3", "ipv4:10.1.2.3:1") is None
    assert guard.refusal("SendMessage", send, blank, "10.2.2.3", "ipv4:10.2.2.3:1") == \
        "the authorization header names no Credential"
    assert guard.refusal("SendMessage", send, {}, "10.2.2.3", "p") == "No accessKey is configured"

    def signed(dt: str) -> dict[str, str]:
        return {"x-mq-date-time": dt, "authorization": "MQv2-HMAC-SHA1 Credential=RocketMQ, "
                "SignedHeaders=x-mq-date-time, Signature=" + sign("12345678", dt).upper()}

    assert guard.refusal("SendMessage", send, signed("20260101T120059Z"), "10.2.2.3", "p") is None
    def refusal(dt: str) -> str:
        return str(guard.refusal("SendMessage", send, signed(dt), "10.2.2.3", "p"))

    assert "possible replay" in refusal("20260101T120101Z")
    assert "bad x-mq-date-time" in refusal("yesterday")
    guard.require_date_time = False  # as RocketMQ's proxy: no window
    assert guard.refusal("SendMessage", send, signed("20200101T000000Z"), "10.2.2.3", "p") is None
    assert guard.acl.refused == 4


def test_acl_2_users_and_policies_check_5x_calls(tmp_path: Path) -> None:
    from chronomq.acl.auth2 import AuthStore, parse_policies
    from chronomq.acl.validator2 import Acl2Validator
    from chronomq.grpc.auth import Guard
    from chronomq.store.atomicfile import write_atomic

    s = AuthStore(tmp_path / "auth.json", write_atomic)
    s.create_user({"username": "alice00", "password": "alice-pw"})
    s.create_acl("User:alice00", parse_policies({"policies": [{"entries": [
        {"resource": "Topic:orders-*", "actions": ["Pub"], "decision": "Allow"},
        {"resource": "Group:G", "actions": ["Sub"], "decision": "Allow"}]}]}))
    guard = Guard(Acl2Validator(s, lambda: 0), lambda: 0)
    md = dict(_md("alice00", "alice-pw"))
    assert guard.refusal("SendMessage", _send("orders-1"), md, "127.0.0.1", "p") is None
    assert guard.refusal("Heartbeat", pb.HeartbeatRequest(group=_res("G")), md, "127.0.0.1", "p") is None
    refused = guard.refusal("SendMessage", _send("payments"), md, "127.0.0.1", "p")
    assert "Topic:payments (Pub)" in str(refused)
    recv = pb.ReceiveMessageRequest(group=_res("G"), message_queue=pb.MessageQueue(topic=_res("orders-1")))
    assert "Topic:orders-1 (Sub)" in str(guard.refusal("ReceiveMessage", recv, md, "127.0.0.1", "p"))
    wrong = dict(_md("alice00", "nope"))
    assert "check signature failed" in str(guard.refusal("SendMessage", _send("orders-1"), wrong, "127.0.0.1",
                                                         "p"))
