"""The official RocketMQ 5.x Node.js client (npm rocketmq-client-nodejs, installed by the harness in
.node-grpc5/) against chronomq's gRPC endpoint, unchanged: Producer (normal, FIFO, timed with recall,
transactions) and SimpleConsumer (receive, ack, changeInvisibleDuration, redelivery after the invisible
time)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.compat.harness import ChronomqProcess, RawClient, free_port, grpc5_node, run_driver
from tests.compat.test_grpc_compat import create_topic

pytestmark = pytest.mark.compat

INVALID_RECEIPT_HANDLE = 40013


def uniq(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def grpc_server(chronomq_factory: Callable[..., ChronomqProcess]) -> ChronomqProcess:
    """A fresh chronomq whose gRPC endpoint is on a free port, with the Node.js client installed."""
    grpc5_node()
    port = free_port()
    # invisible durations from 1 s (RocketMQ's proxy: 10 s): the redelivery test waits for them
    server = chronomq_factory({"grpcListenPort": str(port), "minInvisibleTimeMillsForRecv": "1000"})
    server.grpc_endpoint = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
    return server


def node(server: ChronomqProcess, mode: str, **args: Any) -> dict[str, Any]:
    endpoint = server.grpc_endpoint  # type: ignore[attr-defined]
    create_topic(server, args["topic"])  # the endpoint routes only topics that exist, as RocketMQ's proxy
    timeout = float(args.get("deadline_s", 60)) + 45  # the driver's own deadline, startup and shutdown
    return run_driver("v5_client.mjs", {"endpoint": endpoint, "mode": mode, **args}, timeout=timeout)


def test_node_producer_and_simple_consumer(grpc_server: ChronomqProcess) -> None:
    """Normal messages with tag, keys and properties and FIFO ones of one message group; the
    SimpleConsumer (which only ever names queue 0 in its receives) gets and acks all of them."""
    topic, group = uniq("N5T"), uniq("N5G")
    specs: list[dict[str, Any]] = [
        {"body": f"plain-{i}", "tag": "a", "keys": ["k1", f"k-{i}"], "props": {"color": "red"}}
        for i in range(6)]
    specs += [{"body": f"fifo-{i}", "group": "order-7"} for i in range(4)]
    sent = node(grpc_server, "produce", topic=topic, messages=specs)
    assert sent["errors"] == [] and len(sent["results"]) == len(specs)
    got = node(grpc_server, "receive", group=group, topic=topic, expect=len(specs), deadline_s=30)
    assert got["errors"] == []
    assert sorted(m["body"] for m in got["messages"]) == sorted(s["body"] for s in specs)  # each once
    assert all(m["acked"] and m["attempt"] == 1 for m in got["messages"])
    by_body = {m["body"]: m for m in got["messages"]}
    assert {m["message_id"] for m in got["messages"]} == {r["message_id"] for r in sent["results"]}
    plain = by_body["plain-3"]
    assert (plain["tag"], plain["keys"], plain["props"]) == ("a", ["k-3", "k1"], {"color": "red"})
    fifo = [m["body"] for m in got["messages"] if m["group"] == "order-7"]
    assert fifo == [f"fifo-{i}" for i in range(4)]  # one message group: one queue, in send order
    again = node(grpc_server, "receive", group=group, topic=topic, expect=1, deadline_s=2)
    assert again["messages"] == []  # acked: nothing comes back


def test_node_timed_message_is_never_early_and_recall_cancels(grpc_server: ChronomqProcess) -> None:
    """deliveryTimestamp (milliseconds) on chronomq's timer; the Node.js client supports recall
    (Producer.recallMessage): the recalled message, due before the other one, is never delivered."""
    topic, group = uniq("N5D"), uniq("N5DG")
    sent = node(grpc_server, "produce", topic=topic, messages=[
        {"body": "recalled", "delay_ms": 3000, "recall": True},
        {"body": "timed", "delay_ms": 5000},
    ])
    assert sent["errors"] == []
    recalled, timed = sent["results"]
    assert recalled["recalled"] == recalled["message_id"] and recalled["recall_handle"]
    got = node(grpc_server, "receive", group=group, topic=topic, expect=1, deadline_s=40)
    assert got["errors"] == []
    # the recalled one was due 2 s before "timed": had it not been recalled it would have come first
    [m] = got["messages"]
    assert m["body"] == "timed" and m["message_id"] == timed["message_id"]
    assert m["delivery_ms"] == timed["deliver_ms"]  # the client's delivery time, to the millisecond
    assert m["received_ms"] >= timed["deliver_ms"]  # never early
    later = node(grpc_server, "receive", group=group, topic=topic, expect=1, deadline_s=2)
    assert later["messages"] == []


def test_node_change_invisible_duration_and_redelivery_after_expiry(grpc_server: ChronomqProcess) -> None:
    """Both received with 8 s of invisibility: one's is changed to 2 s (changeInvisibleDuration) and it
    comes back after those 2 s, long before the 8 s, and the handle from before the change is refused;
    the other is never acked and comes back after its 8 s with delivery attempt 2."""
    topic, group = uniq("N5C"), uniq("N5CG")
    assert node(grpc_server, "produce", topic=topic, messages=[{"body": "changed"}, {"body": "expired"}])[
        "errors"] == []
    got = node(grpc_server, "receive", group=group, topic=topic, expect=2, invisible_ms=8000,
               change_first={"changed": 2000}, hold_first=True, deadline_s=40)
    assert got["errors"] == []
    rows = {(m["body"], m["attempt"]): m for m in got["messages"]}
    assert sorted(rows) == [("changed", 1), ("changed", 2), ("expired", 1), ("expired", 2)]
    first, back = rows["changed", 1], rows["changed", 2]
    assert first["changed_to_ms"] == 2000
    assert f"response-code={INVALID_RECEIPT_HANDLE}" in first["stale_ack"]
    assert back["received_ms"] >= first["change_ms"] + 2000  # not before the new duration
    # the broker started the 8 s after the receive was asked for: its end is after asked_ms + 8000
    assert back["received_ms"] < first["asked_ms"] + 8000  # the change, not the first duration
    assert back["acked"]
    held, expired = rows["expired", 1], rows["expired", 2]
    assert not held["acked"] and expired["acked"]
    assert expired["received_ms"] >= held["asked_ms"] + 8000


def test_node_transaction_commit_and_rollback(grpc_server: ChronomqProcess) -> None:
    """Producer with a TransactionChecker: the committed message is received, the rolled-back one never
    reaches the topic."""
    topic, group = uniq("N5X"), uniq("N5XG")
    res = node(grpc_server, "transaction", topic=topic, messages=[
        {"body": "tx-commit", "decision": "commit"},
        {"body": "tx-rollback", "decision": "rollback"},
    ])
    assert res["errors"] == [] and all(r["transaction_id"] for r in res["results"])
    got = node(grpc_server, "receive", group=group, topic=topic, expect=1, deadline_s=30)
    assert [m["body"] for m in got["messages"]] == ["tx-commit"]
    assert got["messages"][0]["message_id"] == res["results"][0]["message_id"]
    with RawClient(grpc_server.broker_addr) as raw:  # the rolled-back one never reached the topic
        assert sum(raw.max_offset(topic, q) for q in range(4)) == 1
