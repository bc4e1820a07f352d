"""The 5.x endpoint's ReceiveMessage with a SQL92 FilterExpression: with enablePropertyFilter on it filters
by the message's properties (user properties and the tag), refuses an expression that does not compile
with ILLEGAL_FILTER_EXPRESSION and where; off, SQL is refused as before."""

from __future__ import annotations

from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio and protobuf (chronomq dependencies) are not installed")

from tests.unit.test_grpc import SERVICE, Env  # noqa: E402

from chronomq.grpc import convert  # noqa: E402
from chronomq.grpc._proto import rocketmq_v2_pb2 as pb  # noqa: E402


async def _send(env: Env, topic: str, mid: str, tag: str, **props: str) -> None:
    m = pb.Message(topic=pb.Resource(name=topic), body=mid.encode(), user_properties=props)
    m.system_properties.message_id = mid
    m.system_properties.body_encoding = pb.IDENTITY
    m.system_properties.message_type = pb.NORMAL
    m.system_properties.tag = tag
    r = await env.call("SendMessage", pb.SendMessageRequest(messages=[m]), pb.SendMessageResponse)
    assert r.status.code == pb.OK, r.status.message
    await env.dispatched()


async def _receive_sql(env: Env, topic: str, expression: str) -> tuple[pb.Status, list[pb.Message]]:
    assert env.channel is not None
    req = pb.ReceiveMessageRequest(group=pb.Resource(name="G"), batch_size=16,
                                   message_queue=pb.MessageQueue(topic=pb.Resource(name=topic), id=-1),
                                   filter_expression=pb.FilterExpression(type=pb.SQL, expression=expression),
                                   invisible_duration=convert.duration(30_000),
                                   long_polling_timeout=convert.duration(0))
    fn = env.channel.unary_stream(SERVICE + "ReceiveMessage", request_serializer=req.SerializeToString,
                                  response_deserializer=pb.ReceiveMessageResponse.FromString)
    items = [r async for r in fn(req, timeout=10)]
    statuses = [r.status for r in items if r.WhichOneof("content") == "status"]
    assert len(statuses) == 1
    return statuses[0], [r.message for r in items if r.WhichOneof("content") == "message"]


async def test_receive_filters_by_sql_and_moves_past_the_rest(tmp_path: Path) -> None:
    env = await Env(tmp_path, enablePropertyFilter="true").start()
    try:
        for i in range(6):
            await _send(env, "SqlG", f"0{i}", "even" if i % 2 == 0 else "odd", n=str(i))
        st, msgs = await _receive_sql(env, "SqlG", "n > 1 AND TAGS = 'even'")
        assert st.code == pb.OK, st.message
        assert sorted(m.body for m in msgs) == [b"02", b"04"]
        assert {m.user_properties["n"] for m in msgs} == {"2", "4"}
        st, msgs = await _receive_sql(env, "SqlG", "n > 1 AND TAGS = 'even'")
        assert st.code == pb.MESSAGE_NOT_FOUND and msgs == []  # nothing left that matches, none redelivered
        st, _ = await _receive_sql(env, "SqlG", "n >")
        assert st.code == pb.ILLEGAL_FILTER_EXPRESSION and "column 4" in st.message
    finally:
        await env.close()


async def test_receive_by_sql_is_refused_with_the_property_filter_off(tmp_path: Path) -> None:
    env = await Env(tmp_path).start()
    try:
        await _send(env, "SqlOff", "01", "t", n="1")
        st, msgs = await _receive_sql(env, "SqlOff", "n = 1")
        assert st.code == pb.ILLEGAL_FILTER_EXPRESSION and msgs == []
    finally:
        await env.close()
