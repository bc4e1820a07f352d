"""SQL92 subscriptions on the 4.x broker with enablePropertyFilter=true: CHECK_CLIENT_CONFIG, heartbeats,
PULL_MESSAGE filtering by properties (the request's subscription or the registered one) and the next
offset moving past what did not match, as RocketMQ's PullMessageProcessor and getMessage do."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from tests.integration.rawclient import AsyncRawClient, pull_ext
from tests.unit.test_broker_processors import Env

from chronomq.message import decode_records
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C


@pytest.fixture
async def env(tmp_path: Path):
    e = Env(tmp_path, {"enablePropertyFilter": "true"})
    await e.broker.start()
    yield e
    await e.close()


def _check_body(expression: str, expression_type: str | None = "SQL92") -> bytes:
    data: dict[str, Any] = {"topic": "T", "subString": expression, "tagsSet": [], "codeSet": [],
                            "subVersion": 1, "classFilterMode": False}
    if expression_type is not None:
        data["expressionType"] = expression_type
    return json.dumps({"clientId": "127.0.0.1@1", "group": "G", "subscriptionData": data}).encode()


def _heartbeat(group: str, topic: str, expression: str, expression_type: str = "SQL92",
               version: int = 1) -> bytes:
    sub = {"topic": topic, "subString": expression, "expressionType": expression_type, "subVersion": version,
           "tagsSet": [], "codeSet": [], "classFilterMode": False}
    return json.dumps({"clientID": "127.0.0.1@sql", "consumerDataSet": [{
        "groupName": group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
        "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "subscriptionDataSet": [sub]}],
        "producerDataSet": []}).encode()


def _sql_pull(group: str, topic: str, offset: int, expression: str, **kw: Any) -> dict[str, Any]:
    return {**pull_ext(group, topic, 0, offset, subscription=expression, **kw), "expressionType": "SQL92"}


async def _send(env: Env, c: AsyncRawClient, topic: str, props_list: list[dict[str, str]]) -> None:
    for i, props in enumerate(props_list):
        resp = await c.send_message(topic, f"m{i}".encode(), 0, props)
        assert resp.code == C.SUCCESS, resp.remark
    store = env.broker.store
    assert await asyncio.to_thread(store.wait_dispatched, store.max_phy_offset, 5)


def _bodies(resp: Any) -> list[bytes]:
    return [m.body for m in decode_records(resp.body)] if resp.body else []


async def test_check_client_config_compiles_the_expression(env: Env) -> None:
    c = await env.client()
    resp = await c.request(R.CHECK_CLIENT_CONFIG, body=_check_body("a > 5 AND TAGS IN ('x', 'y')"))
    assert resp.code == C.SUCCESS, resp.remark
    resp = await c.request(R.CHECK_CLIENT_CONFIG, body=_check_body("a > "))
    assert resp.code == C.SUBSCRIPTION_PARSE_FAILED
    assert "line 1, column 5" in resp.remark and "Was expecting" in resp.remark
    resp = await c.request(R.CHECK_CLIENT_CONFIG, body=_check_body("a > 'x'"))
    assert resp.code == C.SUBSCRIPTION_PARSE_FAILED and "cannot be compared" in resp.remark
    resp = await c.request(R.CHECK_CLIENT_CONFIG, body=_check_body("x", "BLOOM"))
    assert resp.code == C.SUBSCRIPTION_PARSE_FAILED and "BLOOM" in resp.remark
    resp = await c.request(R.CHECK_CLIENT_CONFIG, body=_check_body("*", "TAG"))
    assert resp.code == C.SUCCESS


async def test_pull_with_the_request_subscription_filters_and_moves_past_the_rest(env: Env) -> None:
    c = await env.client()
    props = [{"a": str(i), "TAGS": "even" if i % 2 == 0 else "odd"} for i in range(10)]
    await _send(env, c, "SqlT", props)
    resp = await c.request(R.PULL_MESSAGE, _sql_pull("G", "SqlT", 0, "a >= 4 AND TAGS = 'even'"))
    assert resp.code == C.SUCCESS, resp.remark
    assert _bodies(resp) == [b"m4", b"m6", b"m8"]
    assert resp.ext_fields["nextBeginOffset"] == "10"  # m9 did not match: the offset is past it too
    # nothing matches from offset 9: PULL_RETRY_IMMEDIATELY, and the offset still advances
    resp = await c.request(R.PULL_MESSAGE, _sql_pull("G", "SqlT", 9, "TAGS = 'even'"))
    assert resp.code == C.PULL_RETRY_IMMEDIATELY and resp.ext_fields["nextBeginOffset"] == "10"
    # a batch stops at maxMsgNums matches; the next offset is right after the last one returned
    resp = await c.request(R.PULL_MESSAGE, _sql_pull("G", "SqlT", 0, "TAGS = 'odd'", max_msgs=2))
    assert _bodies(resp) == [b"m1", b"m3"] and resp.ext_fields["nextBeginOffset"] == "4"
    # missing properties are unknown, never a match; evaluation errors are no match
    resp = await c.request(R.PULL_MESSAGE, _sql_pull("G", "SqlT", 0, "b = 'x' OR a > 7"))
    assert _bodies(resp) == [b"m8", b"m9"]
    resp = await c.request(R.PULL_MESSAGE, _sql_pull("G", "SqlT", 0, "TAGS > 1"))
    assert resp.code == C.PULL_RETRY_IMMEDIATELY and resp.ext_fields["nextBeginOffset"] == "10"


async def test_pull_with_a_bad_request_subscription_is_refused(env: Env) -> None:
    c = await env.client()
    await _send(env, c, "SqlBad", [{"a": "1"}])
    resp = await c.request(R.PULL_MESSAGE, _sql_pull("G", "SqlBad", 0, "a >"))
    assert resp.code == C.SUBSCRIPTION_PARSE_FAILED
    assert resp.remark.startswith("parse the consumer's subscription failed") and "column 4" in resp.remark
    ext = {**_sql_pull("G", "SqlBad", 0, "a"), "expressionType": "BLOOM"}
    assert (await c.request(R.PULL_MESSAGE, ext)).code == C.SUBSCRIPTION_PARSE_FAILED


async def test_pull_without_the_subscription_flag_uses_the_heartbeat(env: Env) -> None:
    c = await env.client()
    await _send(env, c, "SqlHb", [{"k": v} for v in ("a", "b", "a", "c")])
    no_flag = {**_sql_pull("G2", "SqlHb", 0, ""), "sysFlag": 0, "subVersion": "1"}
    # no registered subscription: RocketMQ's SUBSCRIPTION_NOT_EXIST, never everything
    assert (await c.request(R.PULL_MESSAGE, no_flag)).code == C.SUBSCRIPTION_NOT_EXIST
    resp = await c.request(R.HEART_BEAT, body=_heartbeat("G2", "SqlHb", "k IN ('a', 'c')"))
    assert resp.code == C.SUCCESS
    resp = await c.request(R.PULL_MESSAGE, no_flag)
    assert resp.code == C.SUCCESS, resp.remark
    assert _bodies(resp) == [b"m0", b"m2", b"m3"] and resp.ext_fields["nextBeginOffset"] == "4"
    # a newer subscription version than the broker registered: FILTER_DATA_NOT_LATEST
    resp = await c.request(R.PULL_MESSAGE, {**no_flag, "subVersion": "2"})
    assert resp.code == C.FILTER_DATA_NOT_LATEST
    # a heartbeat whose expression does not compile is accepted, and its pulls answer FILTER_DATA_NOT_EXIST
    assert (await c.request(R.HEART_BEAT, body=_heartbeat("G2", "SqlHb", "k IN"))).code == C.SUCCESS
    resp = await c.request(R.PULL_MESSAGE, no_flag)
    assert resp.code == C.FILTER_DATA_NOT_EXIST and "column 5" in resp.remark


async def test_tag_subscriptions_are_unchanged_with_the_property_filter_on(env: Env) -> None:
    c = await env.client()
    await _send(env, c, "TagT", [{"TAGS": t} for t in ("x", "y", "x")])
    resp = await c.pull("G", "TagT", 0, 0, subscription="x")
    assert _bodies(resp) == [b"m0", b"m2"] and resp.ext_fields["nextBeginOffset"] == "3"
    resp = await c.pull("G", "TagT", 0, 0)  # "*"
    assert _bodies(resp) == [b"m0", b"m1", b"m2"]


async def test_the_property_filter_is_off_by_default(tmp_path: Path) -> None:
    e = Env(tmp_path)
    assert e.config.enablePropertyFilter is False
    await e.broker.start()
    try:
        c = await e.client()
        resp = await c.request(R.CHECK_CLIENT_CONFIG, body=_check_body("a > 1"))
        assert (resp.code, resp.remark) == (
            C.SYSTEM_ERROR, "The broker does not support consumer to filter message by SQL92")
        resp = await c.request(R.PULL_MESSAGE, _sql_pull("G", "Off", 0, "a > 1"))
        assert resp.code == C.SYSTEM_ERROR
    finally:
        await e.close()
