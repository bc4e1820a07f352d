"""The Java drivers' serve mode (``harness.DriverServer``: one JVM per official Java client and process,
running ``run_driver`` calls side by side): a timeout kills the JVM and the next call starts another; a JVM
that died fails the calls in flight and is replaced; an op's error leaves it serving; and the ops shut down
every client they started (the JVM outlives them), on the 4.x and the 5.x client.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.compat.harness import (
    ChronomqProcess,
    CompatUnavailable,
    DriverError,
    RawClient,
    driver_server,
    free_port,
    run_driver,
)
from tests.compat.observe import b64, uniq
from tests.conftest import wait_for

pytestmark = pytest.mark.compat

# threads of the JVM, or kept by the JVM or a library once started and shared by every client (idle
# pools keep theirs up to 60 s; the 4.x client's logger and the 5.x client's logback one async appender)
JVM_THREADS = re.compile(r"^(main|Reference Handler|Finalizer|Signal Dispatcher|Common-Cleaner|Notification"
                         r" Thread|Attach Listener|process reaper|ForkJoinPool\.commonPool-worker-\d+"
                         r"|AsyncAppender-Dispatcher-Thread-\d+|AsyncAppender-Worker-DefaultAppender"
                         r"|grpc-default-executor-\d+"
                         r"|grpc-shared-destroyer-\d+)$")


@pytest.fixture(autouse=True)
def serve_mode(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("CHRONOMQ_JAVA_DRIVER_SERVER", raising=False)
    from tests.compat.jvm import java_driver

    try:
        java_driver("java4")
    except CompatUnavailable as e:
        pytest.skip(str(e))
    yield


def idle_consumer(broker: ChronomqProcess, tmp_path: Path) -> dict[str, Any]:
    """A push consumer of a topic nobody sends to: it waits maxSeconds for a message."""
    return {"namesrv": broker.namesrv_addr, "group": uniq("CG"), "topic": uniq("T"), "expect": 1,
            "out": str(tmp_path / "deliveries.jsonl"), "maxSeconds": 300}


def test_a_timeout_kills_the_jvm_and_the_next_call_starts_another(
        chronomq_factory: Callable[..., ChronomqProcess], tmp_path: Path) -> None:
    broker = chronomq_factory()
    first = driver_server("java4")
    with pytest.raises(DriverError, match=r"driver java4:push_consume timed out after 5s; stderr:"):
        run_driver("java4:push_consume", idle_consumer(broker, tmp_path), timeout=5)
    assert first.proc.poll() is not None and not first.alive()
    assert "main" in run_driver("java4:status", {}, timeout=60)["threads"]
    assert driver_server("java4").pid != first.pid


def test_a_jvm_that_died_fails_its_calls_in_flight_and_is_replaced(
        chronomq_factory: Callable[..., ChronomqProcess], tmp_path: Path) -> None:
    broker = chronomq_factory()
    server = driver_server("java4")
    run_driver("java4:status", {}, timeout=60)  # started and answering
    errors: list[BaseException] = []

    def call() -> None:
        try:
            run_driver("java4:push_consume", idle_consumer(broker, tmp_path), timeout=300)
        except DriverError as e:
            errors.append(e)

    caller = threading.Thread(target=call)
    caller.start()
    wait_for(lambda: server.in_flight() == 1, message="the call in flight")
    os.kill(server.pid, signal.SIGKILL)
    caller.join(60)
    assert not caller.is_alive()
    assert len(errors) == 1
    assert f"its java4 driver JVM (pid {server.pid}) exited with code -9" in str(errors[0])
    assert "main" in run_driver("java4:status", {}, timeout=60)["threads"]
    assert driver_server("java4").pid != server.pid


def test_an_op_that_fails_answers_an_error_and_the_jvm_keeps_serving() -> None:
    server = driver_server("java4")
    with pytest.raises(DriverError, match=r"driver java4:no_such_op failed: IllegalArgumentException:"
                                          r" unknown op no_such_op\n"):
        run_driver("java4:no_such_op", {}, timeout=60)
    assert driver_server("java4") is server and server.alive()
    assert "main" in run_driver("java4:status", {}, timeout=60)["threads"]


def leftover_threads(client: str, timeout: float = 20) -> list[str]:
    """The driver JVM's threads but those, polled until there are none or ``timeout`` passed
    (netty and gRPC end their event loops a moment after a client's shutdown)."""
    deadline = time.monotonic() + timeout
    while True:
        threads = run_driver(f"{client}:status", {}, timeout=60)["threads"]
        names = [n for n in threads if not JVM_THREADS.match(n)]
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.5)


def test_the_4x_client_ops_leave_no_thread_behind(
        chronomq_factory: Callable[..., ChronomqProcess], tmp_path: Path) -> None:
    broker = chronomq_factory({"enablePropertyFilter": "true"})
    ns = broker.namesrv_addr
    topic = uniq("JServe")
    request_topic = uniq("JReq")  # made by a send first: a request needs the topic's route
    msgs = [*({"topic": topic, "body": b64(f"m{i}"), "keys": f"K{i}"} for i in range(4)),
            {"topic": request_topic, "body": b64("warm-up")}]
    assert all(r["ok"] for r in run_driver("java4:produce", {"namesrv": ns, "group": uniq("PG"),
                                                             "messages": msgs, "trace": True},
                                           timeout=120)["results"])
    ops = [("push_consume", {"namesrv": ns, "group": uniq("CG"), "topic": topic, "expect": 4, "trace": True,
                             "out": str(tmp_path / "c.jsonl"), "maxSeconds": 60}),
           # no seek: the 4.x client's seek races with the pull task that assign() started (Driver.java)
           ("lite_pull", {"namesrv": ns, "group": uniq("LG"), "topic": topic, "expect": 4, "commit": True}),
           ("admin", {"namesrv": ns, "steps": [{"do": "clusterInfo"}, {"do": "queryByKey", "topic": topic,
                                                                       "key": "K1"}]}),
           ("transaction", {"namesrv": ns, "group": uniq("TG"), "outcomes": {"X": "COMMIT_MESSAGE"},
                            "checks": {}, "messages": [{"topic": uniq("JTx"), "body": b64("t"),
                                                        "keys": "X"}]}),
           ("request_reply", {"namesrv": ns, "group": uniq("RG"), "topic": request_topic, "bodies": ["q"]}),
           # a consumer whose start fails after its client instance started (the broker refuses the filter)
           ("refused", {"namesrv": ns, "group": uniq("CG"), "topic": topic, "expect": 1, "type": "SQL92",
                        "expression": "n >", "out": str(tmp_path / "r.jsonl"), "maxSeconds": 10})]
    results: dict[str, Any] = {}

    def run(op: str, args: dict[str, Any]) -> None:  # side by side, as the differential tests run them
        results[op] = run_driver(f"java4:{'push_consume' if op == 'refused' else op}", args, timeout=120)

    workers = [threading.Thread(target=run, args=op) for op in ops]
    for w in workers:
        w.start()
    for w in workers:
        w.join(150)
    assert sorted(results) == sorted(op for op, _ in ops)
    assert results["push_consume"]["consumed"] == 4
    assert len(results["lite_pull"]["messages"]) == 4
    assert all(s["ok"] for s in results["admin"]["steps"])
    assert [r["ok"] for r in results["transaction"]["results"]] == [True]
    assert [r["ok"] for r in results["request_reply"]["results"]] == [True]
    assert results["refused"]["started"] is False
    assert leftover_threads("java4") == []


def test_the_5x_client_ops_leave_no_thread_behind(chronomq_factory: Callable[..., ChronomqProcess]) -> None:
    from tests.compat.jvm import java_driver

    try:
        java_driver("java5")
    except CompatUnavailable as e:
        pytest.skip(str(e))
    port = free_port()
    broker = chronomq_factory({"grpcListenPort": str(port)})
    ep = f"127.0.0.1:{port}"
    topic = uniq("J5Serve")
    with RawClient(broker.broker_addr) as c:  # UPDATE_AND_CREATE_TOPIC: the 5.x client creates none
        r = c.call(17, {"topic": topic, "defaultTopic": "TBW102", "readQueueNums": "4", "writeQueueNums": "4",
                        "perm": "6", "topicFilterType": "SINGLE_TAG", "topicSysFlag": "0", "order": "false",
                        "attributes": "+message.type=NORMAL"})
    assert r.code == 0, r.remark
    sent = run_driver("java5:produce", {"endpoint": ep, "messages": [
        {"topic": topic, "body": b64(f"m{i}"), "keys": [f"K{i}"]} for i in range(4)]}, timeout=120)
    assert [r["ok"] for r in sent["results"]] == [True] * 4
    got = run_driver("java5:simple_consume", {"endpoint": ep, "group": uniq("SG"), "topic": topic,
                                              "expect": 2, "maxSeconds": 60}, timeout=120)
    assert got["acked"] >= 2
    pushed = run_driver("java5:push_consume", {"endpoint": ep, "group": uniq("PG"), "topic": topic,
                                               "expect": 4, "maxSeconds": 60}, timeout=120)
    assert len(pushed["records"]) >= 4
    assert leftover_threads("java5") == []
