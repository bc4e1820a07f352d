"""The official Java 5.x client (rocketmq-client-java, gRPC) against chronomq's gRPC endpoint and against the
reference Apache RocketMQ 5.3.x proxy (Cluster mode), in the same run, comparing what the client observes.

The client keeps its defaults, TLS included (ClientConfiguration enables SSL unless told otherwise): both
endpoints serve TLS and plaintext on one port. Each scenario runs once per endpoint through the same driver
(tests/compat/java5/, ``run_driver("java5:<op>", ...)``) and the test compares the observations that do not
depend on the broker (bodies, tags, keys, properties, delivery attempts, order, response codes). Topics are
created on both brokers with RocketMQ's ``message.type`` attribute, which the reference needs (its proxy
creates no topic for a gRPC client and the client refuses a message whose type the route does not accept).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.compat import observe
from tests.compat.conftest import DIFFERENTIAL_CONF
from tests.compat.harness import (
    ChronomqProcess,
    CompatUnavailable,
    RawClient,
    free_port,
    run_driver,
    start_driver,
)
from tests.compat.observe import assert_same, b64, text, uniq
from tests.compat.reference import RocketMQProcess
from tests.conftest import wait_for

pytestmark = pytest.mark.compat

# properties a broker fills with its own values: compared by presence
BROKER_VALUED = {"TRANSACTION_CHECK_TIMES"}
# the reference delivers a timed message within its timer precision (timerPrecisionMs in reference.py)
REFERENCE_TIMER_PRECISION_MS = 100
# a consumer group that consumes in order: its subscription group says "consumeMessageOrderly" on both
FIFO_GROUP = f"J5Fifo_{uuid.uuid4().hex[:8]}"


@dataclass
class Endpoint:
    """One broker as the 5.x client sees it: the gRPC endpoint, and the broker address topics are made on."""

    name: str
    endpoint: str
    broker_addr: str
    early_ms: int  # how early a timed message may be delivered: the broker's timer precision





def _java5_or_skip() -> None:
    from tests.compat.jvm import java_driver

    try:
        java_driver("java5")
    except CompatUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def brokers(chronomq_factory: Callable[..., ChronomqProcess], rocketmq5: RocketMQProcess
            ) -> dict[str, Endpoint]:
    _java5_or_skip()
    port = free_port()
    # SQL92 subscriptions served, as on the reference (reference.py runs it with enablePropertyFilter=true)
    server = chronomq_factory({"grpcListenPort": str(port), **DIFFERENTIAL_CONF,
                               "enablePropertyFilter": "true"})
    return {"chronomq": Endpoint("chronomq", f"127.0.0.1:{port}", server.broker_addr, 0),
            "rocketmq5": Endpoint("rocketmq5", rocketmq5.proxy_endpoint, rocketmq5.broker_addr,
                                  REFERENCE_TIMER_PRECISION_MS)}


def create_topic(ep: Endpoint, message_type: str, queues: int = 4) -> str:
    """A fresh topic with RocketMQ's message.type attribute, made on the broker (UPDATE_AND_CREATE_TOPIC)."""
    topic = uniq(f"J5{message_type[0]}")
    with RawClient(ep.broker_addr) as c:
        r = c.call(17, {"topic": topic, "defaultTopic": "TBW102", "readQueueNums": str(queues),
                        "writeQueueNums": str(queues), "perm": "6", "topicFilterType": "SINGLE_TAG",
                        "topicSysFlag": "0", "order": "false", "attributes": f"+message.type={message_type}"})
    assert r.code == 0, f"{ep.name}: creating {topic} ({message_type}) -> {r.code} {r.remark}"
    return topic


def create_fifo_group(ep: Endpoint, group: str) -> None:
    """The subscription group, consuming in order (UPDATE_AND_CREATE_SUBSCRIPTIONGROUP)."""
    config = {"groupName": group, "consumeEnable": True, "consumeFromMinEnable": True,
              "consumeBroadcastEnable": True, "consumeMessageOrderly": True, "retryQueueNums": 1,
              "retryMaxTimes": 16, "brokerId": 0, "whichBrokerWhenConsumeSlowly": 1,
              "notifyConsumerIdsChangedEnable": True}
    with RawClient(ep.broker_addr) as c:
        r = c.call(200, {}, json.dumps(config).encode())
    assert r.code == 0, f"{ep.name}: creating the FIFO group {group} -> {r.code} {r.remark}"


def produce(ep: Endpoint, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return run_driver("java5:produce", {"endpoint": ep.endpoint, "messages": messages, **kw}, timeout=150)


def sent_ok(result: dict[str, Any]) -> list[bool]:
    return [r["ok"] for r in result["results"]]


def simple_consume(ep: Endpoint, topic: str, expect: int, **kw: Any) -> dict[str, Any]:
    args = {"endpoint": ep.endpoint, "group": kw.pop("group", uniq("SG")), "topic": topic, "expect": expect,
            "maxSeconds": 60, **kw}
    result = run_driver("java5:simple_consume", args, timeout=float(args["maxSeconds"]) + 90)
    assert not result.get("startError"), f"{ep.name}: {result['startError']}"
    return result


def key(rec: dict[str, Any]) -> str:
    return rec["keys"][0] if rec["keys"] else ""


def each(brokers: dict[str, Endpoint], scenario: Callable[[Endpoint], dict[str, Any]]
         ) -> dict[str, dict[str, Any]]:
    return observe.each(brokers, lambda _name, ep: scenario(ep))


def visible_props(rec: dict[str, Any]) -> str:
    """A delivered message's properties (JSON), with the broker-valued ones reduced to their presence."""
    props = {k: "<set>" if k in BROKER_VALUED else v for k, v in rec["props"].items()}
    return json.dumps(props, sort_keys=True)


def error_of(result: dict[str, Any]) -> tuple[str, int] | str:
    r = result["results"][0]
    return "ok" if r["ok"] else (r["error"]["type"], r["error"]["code"])


# --- scenarios -----------------------------------------------------------------------------------------
def test_normal_send_and_simple_consumer_see_bodies_tags_keys_and_properties(
        brokers: dict[str, Endpoint]) -> None:
    def scenario(ep: Endpoint) -> dict[str, Any]:
        topic = create_topic(ep, "NORMAL")
        bodies = [b64(bytes(range(256))), *(b64(f"body-{i}") for i in range(1, 4))]
        msgs = [{"topic": topic, "body": body, "tag": f"T{i % 2}", "keys": [f"K{i}", f"X{i}"],
                 "props": {"color": "blue", "n": str(i)}} for i, body in enumerate(bodies)]
        sent = produce(ep, msgs, topics=[topic])
        ids = {m["keys"][0]: r.get("messageId") for m, r in zip(msgs, sent["results"], strict=True)}
        got = simple_consume(ep, topic, 4)
        tagged = simple_consume(ep, topic, 2, filter="T1", lingerMs=1500)
        records = sorted(got["records"], key=key)
        return {
            "sent": sent_ok(sent),
            "received": [(r["topic"] == topic, r["body"], r["tag"], r["keys"], r["props"],
                          r["deliveryAttempt"], r["messageGroup"], r["deliveryTimestamp"], r["action"],
                          r["ok"]) for r in records],
            "message ids are the send receipts'": all(ids[key(r)] == r["messageId"] for r in records),
            "born before received": all(r["bornTimestamp"] <= r["receivedAt"] for r in records),
            "tag T1 filter": sorted(key(r) for r in tagged["records"]),
        }

    assert_same(each(brokers, scenario), "normal messages through a SimpleConsumer")


def test_fifo_message_groups_keep_their_order_and_a_held_message_blocks_its_group(
        brokers: dict[str, Endpoint]) -> None:
    def scenario(ep: Endpoint) -> dict[str, Any]:
        topic = create_topic(ep, "FIFO")
        msgs = [{"topic": topic, "body": b64(f"{g}-{i}"), "group": g, "keys": [f"{g}-{i}"]}
                for i in range(5) for g in ("A", "B")]
        sent = produce(ep, msgs, topics=[topic])
        create_fifo_group(ep, FIFO_GROUP)
        # one message a receive: a FIFO receive may hand out several of a group at once (both brokers)
        got = simple_consume(ep, topic, 10, group=FIFO_GROUP, change={"A-0": "1000"}, invisibleMs=20_000,
                             batch=1)
        by_group: dict[str, list[tuple[str, str, int]]] = {}
        for r in got["records"]:
            by_group.setdefault(r["messageGroup"], []).append((text(r), r["action"], r["deliveryAttempt"]))
        return {"sent": sent_ok(sent), "by group": dict(sorted(by_group.items()))}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["by group"]["A"][:2] == [("A-0", "change", 1), ("A-0", "ack", 2)]
    assert_same(observed, "FIFO message groups")


def test_delivery_timestamp_is_not_delivered_before_its_time(
        brokers: dict[str, Endpoint], tmp_path: Path) -> None:
    # chronomq delivers at the timestamp; RocketMQ within its timer precision (timerPrecisionMs=100 here),
    # so the bound is "not before the timestamp" for chronomq and "not before it minus 100 ms" for RocketMQ.
    def scenario(ep: Endpoint) -> dict[str, Any]:
        topic = create_topic(ep, "DELAY")
        # the consumer first, so that it is polling when the time comes (the sender sets it 3 s ahead): the
        # messages are sent once it says it receives (a JVM's start under load can take longer than 3 s)
        out = tmp_path / f"{ep.name}-receiving.jsonl"
        consumer = start_driver("java5:simple_consume", {
            "endpoint": ep.endpoint, "group": uniq("SG"), "topic": topic, "expect": 2, "awaitMs": 5000,
            "maxSeconds": 60, "out": str(out)}, tmp_path)
        try:
            wait_for(lambda: consumer.records() or not consumer.alive(), timeout=60,
                     message=f"{ep.name}: the consumer receiving")
            msgs = [{"topic": topic, "body": b64(f"d{i}"), "keys": [f"D{i}"], "deliveryDelayMs": 3000}
                    for i in range(2)]
            sent = produce(ep, msgs, topics=[topic])
            got = consumer.wait(timeout=120)
        finally:
            if consumer.alive():
                consumer.kill()
        at = {m["keys"][0]: r.get("deliveryTimestamp") for m, r in zip(msgs, sent["results"], strict=True)}
        records = sorted(got["records"], key=key)
        late = [r["receivedAt"] - at[key(r)] for r in records]
        print(f"{ep.name}: timed messages received {late} ms after their time")
        return {
            "sent": sent_ok(sent),
            "received": [(key(r), text(r), r["deliveryTimestamp"] == at[key(r)], r["deliveryAttempt"])
                         for r in records],
            "not early": all(ms >= -ep.early_ms for ms in late),
            "within 3 s of its time": all(ms <= 3000 for ms in late),
        }

    assert_same(each(brokers, scenario), "timed messages")


def test_change_invisible_duration_brings_a_message_back_as_attempt_2(brokers: dict[str, Endpoint]) -> None:
    def scenario(ep: Endpoint) -> dict[str, Any]:
        topic = create_topic(ep, "NORMAL")
        msgs = [{"topic": topic, "body": b64(k), "keys": [k]} for k in ("K0", "K1")]
        sent = produce(ep, msgs, topics=[topic])
        got = simple_consume(ep, topic, 2, change={"K0": "1500"}, invisibleMs=30_000)
        per_key: dict[str, list[tuple[str, int, bool]]] = {}
        for r in got["records"]:
            per_key.setdefault(key(r), []).append((r["action"], r["deliveryAttempt"], r["ok"]))
        k0 = [r for r in got["records"] if key(r) == "K0"]
        back_after = k0[1]["receivedAt"] - k0[0]["receivedAt"] if len(k0) == 2 else None
        return {"sent": sent_ok(sent), "per key": dict(sorted(per_key.items())),
                "back after the changed duration": back_after is not None and back_after >= 1400}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["per key"]["K0"] == [("change", 1, True), ("ack", 2, True)]
    assert_same(observed, "changeInvisibleDuration")


def test_a_sql92_filter_expression_selects_by_properties_and_tag(brokers: dict[str, Endpoint]) -> None:
    expression = "(n BETWEEN 2 AND 7 AND color IS NOT NULL) OR TAGS = 'T1'"  # m1, m2, m4, m6, m7

    def scenario(ep: Endpoint) -> dict[str, Any]:
        topic = create_topic(ep, "NORMAL")
        msgs = [{"topic": topic, "body": b64(f"m{i}"), "tag": f"T{i % 3}", "keys": [f"K{i}"],
                 "props": {"n": str(i), **({"color": "red"} if i % 2 == 0 else {})}} for i in range(10)]
        sent = produce(ep, msgs, topics=[topic])
        # the five matches, then 3 s more: a wrong match would be handed out by then
        got = simple_consume(ep, topic, 5, filter=expression, filterType="SQL92", lingerMs=3000)
        return {"sent": sent_ok(sent), "received": sorted(text(r) for r in got["records"])}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["received"] == ["m1", "m2", "m4", "m6", "m7"]
    assert_same(observed, "SQL92 over gRPC")


def test_transactions_commit_rollback_and_check_back(brokers: dict[str, Endpoint]) -> None:
    def scenario(ep: Endpoint) -> dict[str, Any]:
        topic = create_topic(ep, "TRANSACTION")
        msgs = [{"topic": topic, "body": b64("commit"), "keys": ["C"], "tx": "commit"},
                {"topic": topic, "body": b64("rollback"), "keys": ["R"], "tx": "rollback"},
                {"topic": topic, "body": b64("checked-commit"), "keys": ["KC"], "tx": "none"},
                {"topic": topic, "body": b64("checked-rollback"), "keys": ["KR"], "tx": "none"}]
        sent = produce(ep, msgs, topics=[topic], check={"KC": "COMMIT", "KR": "ROLLBACK"},
                       awaitChecks=["KC", "KR"], maxSeconds=60)
        got = simple_consume(ep, topic, 2, lingerMs=3000)
        print(f"{ep.name}: checks {[(c['key'], c['answer']) for c in sent['checks']]}")
        tx_ids[ep.name] = {key(r): r["props"].pop("__transactionId__", None) == r["messageId"]
                           for r in got["records"]}
        return {"sent": sent_ok(sent),
                # the undecided ones; RocketMQ may also check the one rolled back (op messages in batches)
                "checks": sorted({(c["key"], c["answer"]) for c in sent["checks"]
                                  if c["key"] in ("KC", "KR")}),
                "received": sorted((key(r), text(r), r["deliveryAttempt"], visible_props(r))
                                   for r in got["records"])}

    tx_ids: dict[str, dict[str, bool]] = {}
    assert_same(each(brokers, scenario), "transactional messages")
    # known difference: RocketMQ's broker adds __transactionId__ (the message id) to a committed message
    # (TransactionalMessageUtil), which the 5.x client sees as a user property; chronomq does not
    assert tx_ids == {"chronomq": {"C": False, "KC": False}, "rocketmq5": {"C": True, "KC": True}}


def test_push_consumer_failure_comes_back_as_attempt_2(brokers: dict[str, Endpoint]) -> None:
    def scenario(ep: Endpoint) -> dict[str, Any]:
        topic = create_topic(ep, "NORMAL")
        sent = produce(ep, [{"topic": topic, "body": b64(k), "keys": [k], "tag": "P"} for k in ("K0", "K1")],
                       topics=[topic])
        args = {"endpoint": ep.endpoint, "group": uniq("PG"), "topic": topic, "expect": 2, "fail": ["K0"],
                "maxSeconds": 90, "lingerMs": 1000}
        got = run_driver("java5:push_consume", args, timeout=200)
        assert not got.get("startError"), f"{ep.name}: {got['startError']}"
        per_key: dict[str, list[tuple[str, int, str]]] = {}
        for r in got["records"]:
            per_key.setdefault(key(r), []).append((r["answer"], r["deliveryAttempt"], text(r)))
        k0 = [r["receivedAt"] for r in got["records"] if key(r) == "K0"]
        print(f"{ep.name}: the failed message came back after {k0[-1] - k0[0]} ms")  # broker-specific
        return {"sent": sent_ok(sent), "per key": dict(sorted(per_key.items()))}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["per key"]["K0"] == [("FAILURE", 1, "K0"), ("SUCCESS", 2, "K0")]
    assert_same(observed, "PushConsumer FAILURE then SUCCESS")


def test_bad_input_is_refused_with_the_same_status(brokers: dict[str, Endpoint]) -> None:
    def scenario(ep: Endpoint) -> dict[str, Any]:
        topic = create_topic(ep, "NORMAL")
        cases = {
            "illegal topic name": {"topic": "bad topic!", "body": b64("x")},
            "topic longer than 127": {"topic": "T" * 128, "body": b64("x")},
            "system topic": {"topic": "TBW102", "body": b64("x")},
            "body over 4 MiB": {"topic": topic, "bodySize": 4 * 1024 * 1024 + 1},
            "reserved property": {"topic": topic, "body": b64("x"), "props": {"UNIQ_KEY": "mine"}},
            "empty body": {"topic": topic, "body": ""},
        }
        return {name: error_of(produce(ep, [msg], topics=[topic])) for name, msg in cases.items()}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["topic longer than 127"] == ("BadRequestException", 40002)
    assert_same(observed, "refused sends")


def test_a_missing_topic_is_refused_alike_and_message_types_still_differ(
        brokers: dict[str, Endpoint]) -> None:
    # Both answer QueryRoute of a missing topic with TOPIC_NOT_FOUND (whatever autoCreateTopicEnable says).
    # Known difference: every chronomq route accepts all four message types; RocketMQ's routes carry the
    # topic's message.type, which the client checks before sending (docs/compat.md).
    def scenario(ep: Endpoint) -> dict[str, Any]:
        normal = create_topic(ep, "NORMAL")
        missing = uniq("J5Missing")
        return {"missing topic": error_of(produce(ep, [{"topic": missing, "body": b64("x")}])),
                "FIFO message on a NORMAL topic": error_of(produce(
                    ep, [{"topic": normal, "body": b64("x"), "group": "g"}], topics=[normal]))}

    observed = each(brokers, scenario)
    assert observed["chronomq"]["missing topic"] == ("NotFoundException", 40402)
    assert_same({name: {"missing topic": obs["missing topic"]} for name, obs in observed.items()},
                "a send to a missing topic")
    assert observed["chronomq"]["FIFO message on a NORMAL topic"] == "ok"
    assert observed["rocketmq5"]["FIFO message on a NORMAL topic"] == ("IllegalArgumentException", -1)
