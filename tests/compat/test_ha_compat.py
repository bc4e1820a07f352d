"""Master-slave with three real processes (name server, SYNC_MASTER, slave) and the official 4.x client: the
master acknowledges only what the slave holds; with the slave stopped no send is SEND_OK; with the master
SIGKILLed a pull consumer reads every acknowledged message, byte for byte, from the slave; the master
restarts on its data and replication resumes.
"""

from __future__ import annotations

import base64
import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bench.ha import Cluster

from chronomq.remoting.codes import RequestCode, ResponseCode
from tests.compat.harness import RawClient, run_driver
from tests.conftest import wait_for
from tests.integration.rawclient import send_ext

pytestmark = [pytest.mark.compat, pytest.mark.timeout(300)]

SEND_OK = 0  # the client's SendStatus value


def runtime(addr: str) -> dict[str, str]:
    with RawClient(addr) as c:
        resp = c.call(RequestCode.GET_BROKER_RUNTIME_INFO)
    assert resp.code == 0, resp.remark
    return json.loads(resp.body)["table"]


@pytest.fixture
def cluster(tmp_path: Path, official_client: str) -> Iterator[dict[str, Any]]:
    with Cluster(tmp_path, ["brokerRole=SYNC_MASTER", "syncFlushTimeout=3000"], slave=True) as c:
        yield {"ns": c.ns, "master": c.master_addr, "slave": c.slave_addr, "master_proc": c.procs[1],
               "slave_proc": c.procs[2]}


def produce(ns: str, topic: str, count: int, prefix: str) -> dict[str, Any]:
    return run_driver("produce", {"namesrv": ns, "group": f"PG_{uuid.uuid4().hex[:8]}", "mode": "sync",
                                  "generate": {"topic": topic, "count": count, "body_size": 700,
                                               "prefix": prefix},
                                  "timeout_ms": 6000, "deadline_s": 90}, timeout=120)


def body(prefix: str, i: int) -> bytes:
    head = f"{prefix}-{i}"
    return (head + "x" * (700 - len(head))).encode()


def stored(addr: str, topic: str) -> int:
    """How many messages the broker at ``addr`` holds in ``topic`` (its queues' max offsets); -1 while it
    does not know the topic (a slave learns it from its master's topic config within seconds)."""
    with RawClient(addr) as c:
        resp = c.call(RequestCode.GET_TOPIC_STATS_INFO, {"topic": topic})
    if resp.code == ResponseCode.TOPIC_NOT_EXIST:
        return -1
    assert resp.code == 0, resp.remark
    return sum(q["maxOffset"] for q in json.loads(resp.body)["offsetTable"].values())


def test_sync_master_failover_to_the_slave_with_the_official_client(cluster: dict[str, Any]) -> None:
    master, slave, ns = cluster["master"], cluster["slave"], cluster["ns"]
    wait_for(lambda: runtime(master).get("haSlaves") == "1", timeout=30, message="the slave is connected")

    # the slave holds each message before its send is acknowledged
    res = produce(ns, "HACompat", 300, "a")
    assert not res["errors"] and {r["status"] for r in res["results"]} == {SEND_OK}, res["errors"][:3]
    acked = res["results"]
    assert int(runtime(slave)["commitLogMaxOffset"]) >= max(int(r["offset"]) for r in acked)

    # no slave: the master stores each send but never answers SEND_OK. It answers SLAVE_NOT_AVAILABLE; the
    # C++ client retries such an answer and then raises (with the text "No route info of this topic")
    cluster["slave_proc"].stop()
    wait_for(lambda: runtime(master).get("haSlaves") == "0", timeout=30, message="the master saw it go")
    with RawClient(master) as c:
        answer = c.call(RequestCode.SEND_MESSAGE, send_ext("HACompat", 0), body("raw", 0))
    assert answer.code == ResponseCode.SLAVE_NOT_AVAILABLE and answer.ext_fields.get("msgId")
    alone = produce(ns, "HACompat", 3, "alone")
    assert not [r for r in alone["results"] if r["status"] == SEND_OK] and len(alone["errors"]) == 3
    cluster["slave_proc"].start()
    wait_for(lambda: runtime(master)["haLagBytes"] == "0", timeout=30, message="the slave caught up")
    total = stored(master, "HACompat")
    wait_for(lambda: stored(slave, "HACompat") == total, timeout=30, message="the slave dispatched it all")

    # the master dies; every acknowledged message is read from the slave, byte for byte
    cluster["master_proc"].stop(signal.SIGKILL)
    got = run_driver("pull_consume", {"namesrv": ns, "group": f"CG_{uuid.uuid4().hex[:8]}",
                                      "topic": "HACompat", "expect": total, "deadline_s": 90}, timeout=150)
    assert len(got["messages"]) == total, (got["reason"], got["errors"][:3])
    by_id = {m["id"]: base64.b64decode(m["body_b64"]) for m in got["messages"]}
    assert all(by_id[r["msg_id"]] == body("a", r["index"]) for r in acked)
    stray = {b for b in by_id.values()} - {body("a", i) for i in range(300)}
    assert stray <= {body("raw", 0)} | {body("alone", i) for i in range(3)}  # stored, never acknowledged

    # the master restarts on its data; the slave reconnects where it was and replication goes on
    cluster["master_proc"].start()
    wait_for(lambda: runtime(master).get("haSlaves") == "1", timeout=40, message="the slave reconnected")
    more = produce(ns, "HACompat", 50, "b")
    assert not more["errors"] and {r["status"] for r in more["results"]} == {SEND_OK}
    m_info, s_info = runtime(master), runtime(slave)
    assert s_info["commitLogMaxOffset"] == m_info["commitLogMaxOffset"]
    assert s_info["brokerRole"] == "SLAVE" and m_info["brokerRole"] == "SYNC_MASTER"
