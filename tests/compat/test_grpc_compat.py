"""The official RocketMQ 5.x Python client (rocketmq-python-client, gRPC) against chronomq's gRPC endpoint,
unchanged: Producer (normal, FIFO, delay, recall, transactions and the orphan check) and SimpleConsumer
(receive, ack, change_invisible_duration, redelivery after the invisible time), and both directions
between a 5.x and a 4.x client on the same topic."""

from __future__ import annotations

import base64
import itertools
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.compat.harness import ChronomqProcess, RawClient, free_port, grpc5_python, run_driver, start_driver
from tests.conftest import wait_for

pytestmark = pytest.mark.compat


def uniq(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def start_grpc_server(factory: Callable[..., ChronomqProcess], **overrides: str) -> ChronomqProcess:
    """A fresh chronomq whose gRPC endpoint is on a free port, with the 5.x client available."""
    grpc5_python()
    port = free_port()
    # invisible durations from 1 s (RocketMQ's proxy: 10 s): the redelivery tests wait for them
    server = factory({"grpcListenPort": str(port), "minInvisibleTimeMillsForRecv": "1000", **overrides})
    server.grpc_endpoint = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
    return server


@pytest.fixture
def grpc_server(chronomq_factory: Callable[..., ChronomqProcess]) -> ChronomqProcess:
    return start_grpc_server(chronomq_factory)


def create_topic(server: ChronomqProcess, topic: str) -> None:
    """The topic, made on the broker (UPDATE_AND_CREATE_TOPIC; an existing one keeps its 4 queues): as
    RocketMQ's proxy, the endpoint routes only topics that exist, so a 5.x client started on another
    fails to start."""
    with RawClient(server.broker_addr) as c:
        r = c.call(17, {"topic": topic, "defaultTopic": "TBW102", "readQueueNums": "4", "writeQueueNums": "4",
                        "perm": "6", "topicFilterType": "SINGLE_TAG", "topicSysFlag": "0", "order": "false"})
    assert r.code == 0, f"creating {topic}: {r.code} {r.remark}"


def v5(server: ChronomqProcess, mode: str, timeout: float = 90, **args: Any) -> dict[str, Any]:
    """The Python driver's ``mode`` on ``args["topic"]``, created first."""
    endpoint = server.grpc_endpoint  # type: ignore[attr-defined]
    create_topic(server, args["topic"])
    return run_driver("v5_client", {"endpoint": endpoint, "mode": mode, **args}, timeout=timeout)


def test_5x_producer_and_simple_consumer(grpc_server: ChronomqProcess) -> None:
    topic, group = uniq("V5T"), uniq("V5G")
    sent = v5(grpc_server, "produce", topic=topic, messages=[
        {"body": "plain", "tag": "a", "keys": ["k1", "k2"], "props": {"color": "red"}},
        {"body": "fifo-1", "group": "order-7"},
        {"body": "fifo-2", "group": "order-7"},
    ])
    assert sent["errors"] == [] and len(sent["results"]) == 3
    got = v5(grpc_server, "receive", group=group, topic=topic, expect=3)
    assert got["errors"] == []
    by_body = {m["body"]: m for m in got["messages"]}
    assert set(by_body) == {"plain", "fifo-1", "fifo-2"}
    plain = by_body["plain"]
    assert (plain["tag"], plain["keys"], plain["props"], plain["attempt"]) == ("a", ["k1", "k2"],
                                                                              {"color": "red"}, 1)
    assert plain["message_id"] == sent["results"][0]["message_id"]
    assert by_body["fifo-1"]["group"] == "order-7"
    fifo = [m["body"] for m in got["messages"] if m["group"] == "order-7"]
    assert fifo == ["fifo-1", "fifo-2"]  # one group, one queue, in order


def test_5x_delay_is_not_delivered_early_and_recall_cancels(grpc_server: ChronomqProcess) -> None:
    topic, group = uniq("V5D"), uniq("V5DG")
    before = int(time.time() * 1000)
    sent = v5(grpc_server, "produce", topic=topic, messages=[
        {"body": "in-3s", "delay_s": 3},
        {"body": "recalled", "delay_s": 30, "recall": True},
    ])
    assert sent["errors"] == []
    assert sent["results"][1]["recalled"] == sent["results"][1]["message_id"]
    got = v5(grpc_server, "receive", group=group, topic=topic, expect=1, deadline_s=60)
    [m] = got["messages"]
    assert m["body"] == "in-3s"
    assert m["delivery_ms"] >= before + 1000  # whole seconds: now + 3 s, rounded down
    assert m["received_ms"] >= m["delivery_ms"]  # never early


def test_5x_redelivery_after_invisible_time(grpc_server: ChronomqProcess) -> None:
    topic, group = uniq("V5R"), uniq("V5RG")
    assert v5(grpc_server, "produce", topic=topic, messages=[{"body": "again"}])["errors"] == []
    got = v5(grpc_server, "receive", group=group, topic=topic, expect=1, invisible_s=2, hold_first=True,
             deadline_s=40)
    attempts = [(m["body"], m["attempt"], m["acked"]) for m in got["messages"]]
    assert attempts == [("again", 1, False), ("again", 2, True)]


def test_5x_simple_consumer_change_invisible_duration(grpc_server: ChronomqProcess) -> None:
    """Received with 20 s of invisibility, changed to 2 s by change_invisible_duration: it comes back
    after the 2 s (not before, and long before the 20 s) with attempt 2, and the handle from before the
    change is refused."""
    topic, group = uniq("V5C"), uniq("V5CG")
    assert v5(grpc_server, "produce", topic=topic, messages=[{"body": "changed"}])["errors"] == []
    got = v5(grpc_server, "receive", group=group, topic=topic, expect=1, invisible_s=20,
             change_first={"changed": 2}, deadline_s=40)
    assert got["errors"] == []
    first, back = got["messages"]
    assert (first["attempt"], first["acked"], back["attempt"], back["acked"]) == (1, False, 2, True)
    assert "40013" in first["stale_ack"], first  # INVALID_RECEIPT_HANDLE
    assert back["received_ms"] >= first["change_ms"] + 2000  # not before the new duration
    assert back["received_ms"] < first["asked_ms"] + 20_000  # the change, not the first duration


def test_4x_producer_to_5x_simple_consumer(grpc_server: ChronomqProcess) -> None:
    topic, group = uniq("X45"), uniq("X45G")
    specs = [{"topic": topic, "body": f"from-4x-{i}", "tags": "t4", "keys": f"key{i}"} for i in range(5)]
    res = run_driver("produce", {"namesrv": grpc_server.namesrv_addr, "messages": specs}, timeout=60)
    assert res["acked"] == 5
    got = v5(grpc_server, "receive", group=group, topic=topic, expect=5)
    assert sorted(m["body"] for m in got["messages"]) == [f"from-4x-{i}" for i in range(5)]
    assert {m["tag"] for m in got["messages"]} == {"t4"}
    assert sorted(k for m in got["messages"] for k in m["keys"]) == [f"key{i}" for i in range(5)]


def test_5x_producer_to_4x_push_consumer(grpc_server: ChronomqProcess) -> None:
    topic, group = uniq("X54"), uniq("X54G")
    sent = v5(grpc_server, "produce", topic=topic, messages=[
        {"body": f"from-5x-{i}", "tag": "t5", "keys": [f"k{i}"]} for i in range(5)])
    assert sent["errors"] == []
    res = run_driver("push_consume", {"namesrv": grpc_server.namesrv_addr, "group": group, "topic": topic,
                                      "expect": 5, "deadline_s": 60}, timeout=90)
    bodies = sorted(base64.b64decode(m["body_b64"]).decode() for m in res["messages"])
    assert bodies == [f"from-5x-{i}" for i in range(5)]
    assert {m["tags"] for m in res["messages"]} == {"t5"}
    ids = {m["properties"].get("UNIQ_KEY") for m in res["messages"]}
    assert ids == {r["message_id"] for r in sent["results"]}  # the 5.x message id is the 4.x UNIQ_KEY


def test_5x_transactions_commit_rollback_and_orphan_check(
    chronomq_factory: Callable[..., ChronomqProcess],
) -> None:
    # checks every second of half messages undecided for a second
    server = start_grpc_server(chronomq_factory, transactionTimeOut="1000", transactionCheckInterval="1000")
    topic, group = uniq("V5X"), uniq("V5XG")
    # await_s 1: the 5.x client's SimpleConsumer picks a random queue for each receive, so short long polls
    # let it come round to the one queue holding the orphan's commit in time
    res = v5(server, "transaction", topic=topic, check_answer="commit", verify_group=uniq("V5XV"), expect=2,
             await_s=1, deadline_s=60, messages=[
                 {"body": "tx-commit", "decision": "commit"},
                 {"body": "tx-rollback", "decision": "rollback"},
                 {"body": "tx-orphan", "decision": "orphan"},
             ])
    assert res["errors"] == [] and all(r["transaction_id"] for r in res["results"])
    orphan = res["results"][2]["message_id"]
    assert orphan in res["checked"]  # RecoverOrphanedTransactionCommand reached the TransactionChecker
    assert sorted(m["body"] for m in res["received"]["messages"]) == ["tx-commit", "tx-orphan"]
    got = v5(server, "receive", group=group, topic=topic, expect=2, await_s=1)
    assert sorted(m["body"] for m in got["messages"]) == ["tx-commit", "tx-orphan"]
    assert {m["message_id"] for m in got["messages"]} == {res["results"][0]["message_id"], orphan}
    with RawClient(server.broker_addr) as raw:  # the rolled-back one never reached the topic
        assert sum(raw.max_offset(topic, q) for q in range(4)) == 2


def test_5x_fifo_group_two_simple_consumers_keep_each_message_groups_order(
    chronomq_factory: Callable[..., ChronomqProcess], tmp_path: Path,
) -> None:
    group, topic = uniq("V5FG"), uniq("V5F")
    server = start_grpc_server(chronomq_factory, grpcFifoGroups=group)
    names = ("g-a", "g-b", "g-c")
    specs = [{"body": f"{g}:{i}", "group": g} for i in range(4) for g in names]
    assert v5(server, "produce", topic=topic, messages=specs)["errors"] == []
    endpoint = server.grpc_endpoint  # type: ignore[attr-defined]
    consumers = [start_driver("v5_client", {
        "endpoint": endpoint, "mode": "receive", "group": group, "topic": topic, "expect": len(specs),
        "batch": 1, "process_ms": 300, "await_s": 2, "deadline_s": 120, "out": str(tmp_path / f"c{i}.jsonl"),
    }, tmp_path) for i in range(2)]
    try:
        wait_for(lambda: sum(len(c.records()) for c in consumers) >= len(specs)
                 or not all(c.alive() for c in consumers), timeout=120, interval=0.2,
                 message="every message acked by one of the two consumers")
    finally:
        for c in consumers:
            c.stop()
    rows = [r for c in consumers for r in c.records()]
    assert sorted(r["body"] for r in rows) == sorted(s["body"] for s in specs)  # each once
    for g in names:
        mine = sorted((r for r in rows if r["group"] == g), key=lambda r: (r["received_ms"], r["ack_ms"]))
        assert [r["body"] for r in mine] == [f"{g}:{i}" for i in range(4)]
        for prev, nxt in itertools.pairwise(mine):  # the next one handed out only after this one's ack
            assert nxt["received_ms"] >= prev["ack_ms"], (prev, nxt)


def test_5x_push_consumer_receives_acks_and_retries_a_failure(grpc_server: ChronomqProcess) -> None:
    topic, group = uniq("V5P"), uniq("V5PG")
    assert v5(grpc_server, "produce", topic=topic, messages=[{"body": f"push-{i}"} for i in range(5)])[
        "errors"] == []
    got = v5(grpc_server, "push", group=group, topic=topic, expect=5, fail_first=["push-2"], deadline_s=60)
    done = sorted(m["body"] for m in got["messages"] if m["result"] == "SUCCESS")
    assert done == [f"push-{i}" for i in range(5)]  # QueryAssignment + receives from every queue
    retried = [(m["attempt"], m["result"]) for m in got["messages"] if m["body"] == "push-2"]
    assert retried == [(1, "FAILURE"), (2, "SUCCESS")]  # the failure came back with attempt 2


def test_5x_producer_on_a_missing_topic_gets_no_route(grpc_server: ChronomqProcess) -> None:
    """As with RocketMQ's proxy: the route of a topic that does not exist is TOPIC_NOT_FOUND, with
    autoCreateTopicEnable on (chronomq's default) too, and nothing is created (the Java client fails to
    start so: RocketMQ's e2e ProducerInitTest.testSetNotExistTopic)."""
    missing = uniq("V5Missing")
    endpoint = grpc_server.grpc_endpoint  # type: ignore[attr-defined]
    res = run_driver("v5_client", {"endpoint": endpoint, "mode": "produce", "topic": missing,
                                   "messages": [{"body": "x"}]}, timeout=90)
    # the Python client (unlike the Java one) starts all the same; its send finds no route
    assert res["results"] == [] and [e["index"] for e in res["errors"]] == [0]
    assert f"failed to fetch topic:{missing} route" in res["errors"][0]["error"]
    with RawClient(grpc_server.broker_addr) as raw:
        assert raw.max_offset(missing, 0) <= 0
