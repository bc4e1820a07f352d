"""The unmodified official 4.x client (PyPI rocketmq==0.4.4, rocketmq-client-cpp 1.2.x)
produces and consumes against chronomq.

Every client runs as a subprocess in its own venv (tests/compat/harness.py). Waiting is always polling
with a deadline; the deadlines are generous because the C++ client rebalances every 10 s and refreshes
routes every 30 s.
"""

from __future__ import annotations

import base64
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chronomq.message import create_offset_msg_id, decode_offset_msg_id, decode_record
from tests.compat.harness import ChronomqProcess, DriverProcess, RawClient, run_driver, start_driver
from tests.conftest import wait_for

pytestmark = pytest.mark.compat

QUEUES = 4  # defaultTopicQueueNums


def uniq(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(s: str) -> bytes:
    return base64.b64decode(s)


def produce(
    server: ChronomqProcess, mode: str, messages: list[dict[str, Any]], timeout: float = 90, **kw: Any
) -> dict[str, Any]:
    args = {
        "namesrv": server.namesrv_addr,
        "group": kw.pop("group", uniq("PG")),
        "mode": mode,
        "messages": messages,
        **kw,
    }
    res = run_driver("produce", args, timeout=timeout)
    assert not res["errors"], f"{mode} sends failed: {res['errors'][:5]}\n{server.log_tail()}"
    return res


def pull_all(
    server: ChronomqProcess,
    topic: str,
    expect: int,
    expression: str = "*",
    props: list[str] | None = None,
    deadline_s: float = 40,
) -> list[dict[str, Any]]:
    res = run_driver(
        "pull_consume",
        {
            "namesrv": server.namesrv_addr,
            "group": uniq("CG_pull"),
            "topic": topic,
            "expression": expression,
            "expect": expect,
            "props": props or [],
            "deadline_s": deadline_s,
        },
        timeout=deadline_s + 30,
    )
    return res["messages"]


def push_consume(
    server: ChronomqProcess, topic: str, group: str, expect: int, deadline_s: float = 60, **kw: Any
) -> dict[str, Any]:
    args = {
        "namesrv": server.namesrv_addr,
        "group": group,
        "topic": topic,
        "expect": expect,
        "deadline_s": deadline_s,
        **kw,
    }
    return run_driver("push_consume", args, timeout=deadline_s + 30)


def varied_bodies(n: int, seed: int) -> list[bytes]:
    """Binary bodies without NUL (the wrapper's getter is a char*), including UTF-8 text, bytes >= 0x80,
    control bytes, and one > 4 KiB body that the client sends zlib-compressed."""
    rnd = random.Random(seed)
    bodies = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            bodies.append(f"héllo wörld ✓ {i}".encode())
        elif kind == 1:
            bodies.append(bytes(rnd.randrange(1, 256) for _ in range(rnd.randrange(1, 600))))
        elif kind == 2:
            bodies.append(bytes(range(1, 256)) + str(i).encode())
        else:
            bodies.append(
                (f"{i}:" + "A" * 9000 + "".join(chr(rnd.randrange(65, 90)) for _ in range(200))).encode()
            )
    return bodies


def by_id(msgs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in msgs}


def consumed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") is None and r.get("consumed", True)]


# --- sends + push consumer + VIEW_MESSAGE_BY_ID ------------------------------------------------------------
def test_sync_send_push_consume_exact_and_view_by_id(chronomq_server: ChronomqProcess) -> None:
    server = chronomq_server
    topic, group = uniq("CompatSync"), uniq("CG_sync")
    bodies = varied_bodies(20, seed=1)
    specs = [
        {
            "topic": topic,
            "body_b64": b64(b),
            "keys": f"key{i} biz{i}",
            "tags": f"Tag{i % 3}",
            "props": {"color": random.Random(i).choice(["red", "green"]), "seq": str(i), "uni": "ü∂"},
        }
        for i, b in enumerate(bodies)
    ]
    res = produce(server, "sync", specs)
    results = res["results"]
    assert [r["index"] for r in results] == list(range(20))
    assert all(r["status"] == 0 for r in results), results
    ids = [r["msg_id"] for r in results]
    assert len(set(ids)) == 20 and all(len(i) == 32 for i in ids), ids  # UNIQ_KEY ids, all distinct
    # round-robin over the topic's queues: each queue's offsets go 0, 1, 2, ... (string ext values!)
    assert sorted(r["offset"] for r in results) == sorted(i // QUEUES for i in range(20))

    out = push_consume(server, topic, group, expect=20, props=["color", "seq", "uni"])
    got = out["messages"]
    assert out["reason"] == "expect", out["reason"]
    assert len(got) == 20, f"duplicates or extras: {Counter(m['id'] for m in got)}"
    rec = by_id(got)
    assert set(rec) == set(ids)
    for i, msg_id in enumerate(ids):
        m = rec[msg_id]
        assert m["topic"] == topic
        assert unb64(m["body_b64"]) == bodies[i], f"body of message {i} differs"
        assert m["keys"] == f"key{i} biz{i}"
        assert m["tags"] == f"Tag{i % 3}"
        assert m["properties"]["color"] == specs[i]["props"]["color"]
        assert m["properties"]["seq"] == str(i)
        assert m["properties"]["uni"] == "ü∂"
        assert m["properties"]["UNIQ_KEY"] == msg_id
        assert m["reconsume_times"] == 0
        assert 0 <= m["queue_id"] < QUEUES
        assert m["store_timestamp"] >= m["born_timestamp"] > 0
    # per queue, the offsets are exactly 0..n-1
    per_queue: dict[int, list[int]] = {}
    for m in got:
        per_queue.setdefault(m["queue_id"], []).append(m["queue_offset"])
    for q, offs in per_queue.items():
        assert sorted(offs) == list(range(len(offs))), (q, offs)

    # VIEW_MESSAGE_BY_ID (code 33) with the offset msgId a Java tool would decode (storeHost + offset)
    host, port = server.broker_addr.rsplit(":", 1)
    with RawClient(server.broker_addr) as raw:
        for msg_id in ids:
            m = rec[msg_id]
            offset_msg_id = create_offset_msg_id((host, int(port)), m["commit_log_offset"])
            (addr, phy) = decode_offset_msg_id(offset_msg_id)
            assert addr == (host, int(port)) and phy == m["commit_log_offset"]
            r = raw.view_message(phy)
            assert r.code == 0, f"VIEW_MESSAGE_BY_ID offset={phy}: code {r.code} {r.remark}"
            stored = decode_record(r.body)
            assert stored.uniq_key == msg_id
            assert stored.topic == topic
            assert stored.commit_log_offset == phy
            assert stored.queue_offset == m["queue_offset"] and stored.queue_id == m["queue_id"]
            assert stored.inflated_body() == unb64(m["body_b64"])
            assert stored.store_host == (host, int(port)), "storeHost must be the broker's own address"
        missing = raw.view_message(10**12)
        assert missing.code != 0, "VIEW_MESSAGE_BY_ID for an offset beyond the log must be an error"


def test_async_send_then_pull_consumer(chronomq_server: ChronomqProcess) -> None:
    server = chronomq_server
    topic = uniq("CompatAsync")
    specs = [{"topic": topic, "body": f"async-{i}", "keys": f"ak{i}", "tags": "A"} for i in range(60)]
    res = produce(server, "async", specs)
    assert res["acked"] == 60 and all(r["status"] == 0 for r in res["results"])
    ids = {r["msg_id"] for r in res["results"]}
    assert len(ids) == 60
    got = pull_all(server, topic, expect=60)
    assert Counter(m["id"] for m in got) == Counter(ids)
    assert {m["body_b64"] for m in got} == {b64(f"async-{i}".encode()) for i in range(60)}
    assert all(m["tags"] == "A" for m in got)


def test_oneway_send(chronomq_server: ChronomqProcess) -> None:
    server = chronomq_server
    topic = uniq("CompatOneway")
    # a sync send first, so the route exists before the fire-and-forget sends
    produce(server, "sync", [{"topic": topic, "body": "first"}])
    # then a sync send on the same connection: its answer means the broker has read every oneway frame
    res = produce(
        server,
        "oneway",
        [{"topic": topic, "body": f"ow-{i}", "keys": f"ow{i}"} for i in range(30)],
        barrier={"topic": topic, "body": "last"},
    )
    assert res["sent"] == 30 and [r.get("barrier") for r in res["results"]] == [True]
    got = pull_all(server, topic, expect=32)
    bodies = Counter(unb64(m["body_b64"]).decode() for m in got)
    assert bodies == Counter(["first", "last", *(f"ow-{i}" for i in range(30))]), bodies
    assert {m["keys"] for m in got if m["keys"]} == {f"ow{i}" for i in range(30)}


def test_orderly_send_and_orderly_push_consumer(chronomq_server: ChronomqProcess) -> None:
    server = chronomq_server
    topic, group = uniq("CompatOrder"), uniq("CG_order")
    n = 40
    specs = [{"topic": topic, "body": f"order-{i % 4}-{i // 4}", "arg": i % 4} for i in range(n)]
    res = produce(server, "orderly", specs)
    for r in res["results"]:
        assert r["status"] == 0
        assert r["offset"] == r["index"] // 4, f"arg {r['index'] % 4}: offsets must be 0,1,2,... {r}"
    out = push_consume(server, topic, group, expect=n, orderly=True)
    got = out["messages"]
    assert len(got) == n, Counter(m["id"] for m in got)
    for q in range(4):
        seq = [unb64(m["body_b64"]).decode() for m in got if m["queue_id"] == q]
        # send_orderly picks queue = arg % writeQueueNums; each queue is consumed in order
        assert seq == [f"order-{q}-{k}" for k in range(n // 4)], (q, seq)


def test_batch_send(chronomq_server: ChronomqProcess) -> None:
    server = chronomq_server
    topic = uniq("CompatBatch")
    specs = [
        {
            "topic": topic,
            "body": f"batch-{i}",
            "keys": f"bk{i}",
            "tags": f"T{i % 2}",
            "props": {"item": str(i)},
        }
        for i in range(30)
    ]
    res = produce(server, "batch", specs, batch_size=10)
    assert [r["count"] for r in res["results"]] == [10, 10, 10]
    assert all(r["status"] == 0 for r in res["results"])
    got = pull_all(server, topic, expect=30, props=["item"])
    assert len(got) == 30
    assert len({m["id"] for m in got}) == 30, "every batch item keeps its own UNIQ_KEY"
    items = {m["properties"]["item"]: m for m in got}
    assert set(items) == {str(i) for i in range(30)}
    for batch in res["results"]:
        first = batch["index"]
        members = [items[str(first + j)] for j in range(10)]
        assert len({m["queue_id"] for m in members}) == 1, "a batch goes to one queue"
        assert [m["queue_offset"] for m in members] == list(range(batch["offset"], batch["offset"] + 10))
        for j, m in enumerate(members):
            i = first + j
            assert unb64(m["body_b64"]) == f"batch-{i}".encode()
            assert m["keys"] == f"bk{i}" and m["tags"] == f"T{i % 2}"


def test_batch_send_larger_than_4k_is_compressed_whole(chronomq_server: ChronomqProcess) -> None:
    # 16 x 1 KiB: the C++ client zlib-deflates the *whole* batch body and sets sysFlag bit 0
    server = chronomq_server
    topic = uniq("CompatBigBatch")
    bodies = [(f"{i:04d}" + chr(65 + i) * 1020).encode() for i in range(16)]
    res = produce(
        server,
        "batch",
        [{"topic": topic, "body_b64": b64(b), "keys": f"bb{i}"} for i, b in enumerate(bodies)],
        batch_size=16,
    )
    assert res["acked"] == 1 and res["results"][0]["status"] == 0
    got = pull_all(server, topic, expect=16)
    assert sorted(unb64(m["body_b64"]) for m in got) == bodies
    assert {m["keys"] for m in got} == {f"bb{i}" for i in range(16)}
    assert len({m["id"] for m in got}) == 16


def test_pull_consumer_with_tag_filter(chronomq_server: ChronomqProcess) -> None:
    server = chronomq_server
    topic = uniq("CompatPull")
    specs = [{"topic": topic, "body": f"p-{i}", "tags": "TagA" if i % 2 else "TagB"} for i in range(24)]
    produce(server, "sync", specs)
    only_a = run_driver(
        "pull_consume",
        {"namesrv": server.namesrv_addr, "group": uniq("CG_pa"), "topic": topic, "expression": "TagA"},
        timeout=60,
    )["messages"]
    assert sorted(unb64(m["body_b64"]).decode() for m in only_a) == sorted(f"p-{i}" for i in range(1, 24, 2))
    everything = pull_all(server, topic, expect=24)
    assert len(everything) == 24
    # a second pass of the same pull consumer finds nothing new
    again = run_driver(
        "pull_consume",
        {"namesrv": server.namesrv_addr, "group": uniq("CG_pb"), "topic": topic, "max_num": 5},
        timeout=60,
    )["messages"]
    assert len(again) == 24, "max_num 5: several FOUND pulls per queue, then NO_NEW_MSG"


def test_push_consumer_tag_expression(chronomq_server: ChronomqProcess) -> None:
    server = chronomq_server
    topic, group = uniq("CompatPushTags"), uniq("CG_tags")
    tags = ["TagA", "TagB", "TagC"]
    specs = [{"topic": topic, "body": f"t-{i}", "tags": tags[i % 3]} for i in range(30)]
    produce(server, "sync", specs)
    out = push_consume(server, topic, group, expect=20, expression="TagA || TagC")
    got = sorted(unb64(m["body_b64"]).decode() for m in out["messages"])
    assert got == sorted(f"t-{i}" for i in range(30) if i % 3 != 1)
    assert {m["tags"] for m in out["messages"]} == {"TagA", "TagC"}


# --- consumer groups ---------------------------------------------------------------------------------------
def _queues_since(proc: DriverProcess, since_ms: int) -> set[int]:
    return {r["queue_id"] for r in consumed(proc.records()) if r["receipt_ms"] >= since_ms}


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_two_push_consumers_split_queues_and_survivor_takes_over(
    chronomq_server: ChronomqProcess, tmp_path: Path, how: str
) -> None:
    # "stop": a clean shutdown (UNREGISTER_CLIENT); "kill": SIGKILL, the broker only sees the
    # connection close. Either way the survivor must get every queue; at-least-once allows the
    # killed consumer's uncommitted messages to be delivered again.
    server = chronomq_server
    topic, group = uniq("CompatSplit"), uniq("CG_split")
    produce(server, "sync", [{"topic": topic, "body": "init"}])  # create the topic (4 queues)
    work = tmp_path / "drivers"
    common = {"namesrv": server.namesrv_addr, "group": group, "topic": topic, "deadline_s": 240}
    a = start_driver("push_consume", {**common, "out": str(tmp_path / "a.jsonl")}, work)
    b = start_driver("push_consume", {**common, "out": str(tmp_path / "b.jsonl")}, work)
    producer = start_driver(
        "produce",
        {
            "namesrv": server.namesrv_addr,
            "group": uniq("PG_split"),
            "mode": "sync",
            "interval_ms": 40,
            "deadline_s": 200,
            "generate": {"topic": topic, "count": 5000, "prefix": "s"},
            "out": str(tmp_path / "p.jsonl"),
        },
        work,
    )
    try:

        def split() -> bool:
            since = int(time.time() * 1000) - 2000
            qa, qb = _queues_since(a, since), _queues_since(b, since)
            return bool(qa and qb and not qa & qb and qa | qb == set(range(QUEUES)))

        wait_for(
            split, timeout=75, interval=0.2, message="both consumers of the group to own disjoint queues"
        )
        assert consumed(b.records()), "the second consumer consumed nothing"
        if how == "stop":
            b.stop(timeout=60)
        else:
            b.kill()
        stopped_ms = int(time.time() * 1000)
        wait_for(
            lambda: _queues_since(a, stopped_ms + 500) == set(range(QUEUES)),
            timeout=75,
            interval=0.2,
            message="the survivor to take over every queue",
        )
        p_result = producer.stop(timeout=60)
        assert p_result["acked"] > 0 and not p_result["errors"], p_result["errors"][:3]
        sent_ids = {r["msg_id"] for r in p_result["results"]}

        def all_seen() -> bool:
            seen = {r["id"] for r in consumed(a.records())} | {r["id"] for r in consumed(b.records())}
            return sent_ids <= seen

        wait_for(all_seen, timeout=60, interval=0.2, message="every acknowledged message to be consumed")
    finally:
        for proc in (producer, a, b):
            if proc.alive():
                proc.kill()


def test_consumer_restart_resumes_from_committed_offset(chronomq_server: ChronomqProcess) -> None:
    server = chronomq_server
    topic, group = uniq("CompatResume"), uniq("CG_resume")
    first = produce(server, "sync", [{"topic": topic, "body": f"r1-{i}"} for i in range(20)])
    first_ids = {r["msg_id"] for r in first["results"]}
    out1 = push_consume(server, topic, group, expect=20)
    assert {m["id"] for m in out1["messages"]} == first_ids
    # the clean shutdown committed the offsets: the broker now reports the queue ends
    with RawClient(server.broker_addr) as raw:
        for q in range(QUEUES):
            r = raw.query_consumer_offset(group, topic, q)
            assert r.code == 0, f"QUERY_CONSUMER_OFFSET {q}: {r.code} {r.remark}"
            assert int(r.ext_fields["offset"]) == raw.max_offset(topic, q), (q, r.ext_fields)
    second = produce(server, "sync", [{"topic": topic, "body": f"r2-{i}"} for i in range(12)])
    second_ids = {r["msg_id"] for r in second["results"]}
    out2 = push_consume(server, topic, group, expect=12)
    got = [m["id"] for m in out2["messages"]]
    # a re-delivered old message would come first in its queue and take one of the 12 places
    assert not set(got) & first_ids, "committed messages were delivered again"
    assert Counter(got) == Counter(second_ids)


# --- broker restarts ---------------------------------------------------------------------------------------
def test_clean_broker_restart_loses_nothing(chronomq_server: ChronomqProcess) -> None:
    server = chronomq_server
    topic = uniq("CompatRestart")
    before = produce(server, "sync", [{"topic": topic, "body": f"b-{i}", "keys": f"b{i}"} for i in range(30)])
    assert server.stop(timeout=30) == 0, "SIGTERM must shut chronomq down with exit code 0"
    server.start()
    after = produce(server, "sync", [{"topic": topic, "body": f"a-{i}"} for i in range(8)])
    # queue offsets continue after the restart (each queue already held at least 30 // 4 messages)
    assert min(r["offset"] for r in after["results"]) >= 30 // QUEUES, after["results"]
    ids = {r["msg_id"] for r in before["results"]} | {r["msg_id"] for r in after["results"]}
    got = pull_all(server, topic, expect=38)
    assert Counter(m["id"] for m in got) == Counter(ids)
    bodies = {unb64(m["body_b64"]).decode() for m in got}
    assert bodies == {f"b-{i}" for i in range(30)} | {f"a-{i}" for i in range(8)}


def test_sigkill_under_sync_flush_loses_no_acknowledged_message(
    official_client: str, chronomq_factory: Callable[..., ChronomqProcess], tmp_path: Path
) -> None:
    server = chronomq_factory({"flushDiskType": "SYNC_FLUSH"})
    topic = uniq("CompatKill")
    produce(server, "sync", [{"topic": topic, "body": "warmup"}])
    producer = start_driver(
        "produce",
        {
            "namesrv": server.namesrv_addr,
            "group": uniq("PG_kill"),
            "mode": "sync",
            "generate": {"topic": topic, "count": 20000, "prefix": "k", "body_size": 200, "keys": True},
            "deadline_s": 120,
            "stop_on_error": True,
            # the C++ client sends again after a timeout, a second copy with the same UNIQ_KEY (at least
            # once, not a recovery's duplicate): long enough for an fsync stall on a loaded machine; the
            # killed broker refuses connections at once
            "timeout_ms": 10000,
            "out": str(tmp_path / "acks.jsonl"),
        },
        tmp_path / "drivers",
    )
    try:
        wait_for(
            lambda: len(producer.records()) >= 300 or not producer.alive(),
            timeout=60,
            interval=0.02,
            message="300 acknowledged sends",
        )
        assert producer.alive(), f"producer ended early: {producer.stderr()}"
        server.stop(kill=True)
        result = producer.stop(timeout=90)
    finally:
        if producer.alive():
            producer.kill()
    acked = {r["msg_id"]: r for r in result["results"]}
    assert len(acked) >= 300
    server.start()
    got = pull_all(server, topic, expect=len(acked) + 1, props=[], deadline_s=60)
    got_ids = {m["id"] for m in got}
    lost = set(acked) - got_ids
    assert not lost, f"{len(lost)} acknowledged messages lost after SIGKILL (of {len(acked)})"
    dup = [i for i, c in Counter(m["id"] for m in got).items() if c > 1]
    assert not dup, f"messages stored twice after recovery: {dup[:5]}"
    for m in got:
        body = unb64(m["body_b64"]).decode()
        if m["id"] in acked:
            assert body.startswith(f"k-{acked[m['id']]['index']}x") or body == f"k-{acked[m['id']]['index']}"


# --- retry -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fail_mode", ["reconsume_later", "raise"])
def test_reconsume_later_lands_in_retry_topic(
    official_client: str, chronomq_factory: Callable[..., ChronomqProcess], fail_mode: str
) -> None:
    # "reconsume_later": the listener returns RECONSUME_LATER (raw ctypes callback);
    # "raise": the wrapper's own path, the Python callback raises
    # short delay levels so the send-back (level 3 + reconsume times) comes back quickly
    server = chronomq_factory({"messageDelayLevel": "1s 1s 1s 1s 1s 1s"})
    topic, group = uniq("CompatRetry"), uniq("CG_retry")
    res = produce(
        server,
        "sync",
        [
            {"topic": topic, "body": f"retry-{i}", "keys": f"rk{i}", "tags": "R", "props": {"p": str(i)}}
            for i in range(3)
        ],
    )
    ids = {r["msg_id"] for r in res["results"]}
    out = push_consume(
        server,
        topic,
        group,
        expect=3,
        deadline_s=90,
        props=["p"],
        fail={"mode": fail_mode, "times": 1},
    )
    assert out["reason"] == "expect", f"retried copies did not come back: {out}"
    firsts = [m for m in out["messages"] if not m["consumed"]]
    retried = [m for m in out["messages"] if m["consumed"]]
    assert {m["id"] for m in firsts} == ids and all(m["reconsume_times"] == 0 for m in firsts)
    assert {m["id"] for m in retried} == ids
    for m in retried:
        assert m["reconsume_times"] == 1
        assert m["topic"] == topic, "the client shows a retried message under its original topic"
        assert m["properties"]["RETRY_TOPIC"] == topic
        assert unb64(m["body_b64"]).decode() == f"retry-{m['properties']['p']}"
    # the copies are in %RETRY%<group>: read that topic directly
    retry_topic = f"%RETRY%{group}"
    in_retry = pull_all(server, retry_topic, expect=3, props=["p"])
    assert {m["id"] for m in in_retry} == ids
    for m in in_retry:
        assert m["reconsume_times"] == 1
        assert m["properties"]["RETRY_TOPIC"] == topic
        assert m["keys"] == f"rk{m['properties']['p']}" and m["tags"] == "R"
    with RawClient(server.broker_addr) as raw:
        stored = list(raw.pull_all(uniq("CG_raw"), retry_topic, 0))
    assert {m.uniq_key for m in stored} == ids
    assert all(m.topic == retry_topic and m.reconsume_times == 1 for m in stored)
