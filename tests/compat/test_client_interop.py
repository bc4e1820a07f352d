"""Interop both ways between chronomq.client and the official 4.x client (PyPI rocketmq==0.4.4, the
C++ client) on one chronomq: ours produces and theirs consumes, theirs produces and ours consumes."""

from __future__ import annotations

import asyncio
import base64
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from chronomq.client import (
    Admin,
    Message,
    Producer,
    PushConsumer,
    ReceivedMessage,
    SimpleConsumer,
    TimerOutcome,
)
from tests.compat.harness import ChronomqProcess, run_driver, start_driver
from tests.conftest import async_wait_for

pytestmark = pytest.mark.compat


async def test_ours_produces_theirs_consumes(chronomq_server: ChronomqProcess) -> None:
    ns = chronomq_server.namesrv_addr
    # 12 KB: we compress it (sysFlag 1), their consumer must inflate it (no NUL bytes: the wrapper
    # reads bodies as C strings)
    big = b"interop-big-body-" * 700
    expected: dict[str, tuple[bytes, str | None, str | None, dict[str, str]]] = {}
    async with Producer("PG_ours", ns) as p:
        for i in range(10):
            body = f"ours-{i}".encode()
            r = await p.send(Message("InteropA", body, keys=f"key-{i}", tags="TA",
                                     properties={"u1": f"v{i}"}))
            expected[r.msg_id] = (body, f"key-{i}", "TA", {"u1": f"v{i}"})
        rb = await p.send_batch([Message("InteropA", f"batch-{i}", keys=f"bk-{i}", tags="TB")
                                 for i in range(5)])
        for i, mid in enumerate(rb.msg_ids):
            expected[mid] = (f"batch-{i}".encode(), f"bk-{i}", "TB", {})
        r = await p.send(Message("InteropA", big, tags="BIG"))
        expected[r.msg_id] = (big, None, "BIG", {})
    res = await asyncio.to_thread(run_driver, "push_consume",
                                  {"namesrv": ns, "group": "CG_theirs", "topic": "InteropA",
                                   "expect": len(expected), "deadline_s": 60, "props": ["u1"]}, 90)
    got = {d["id"]: d for d in res["messages"] if d["consumed"]}
    assert set(got) == set(expected)
    for mid, (body, keys, tags, props) in expected.items():
        d = got[mid]
        assert base64.b64decode(d["body_b64"]) == body
        assert (d["keys"] or None) == keys and d["tags"] == tags and d["topic"] == "InteropA"
        for k, v in props.items():
            assert d["properties"][k] == v


async def _collect(ns: str, group: str, topic: str, n: int) -> list[ReceivedMessage]:
    got: list[ReceivedMessage] = []
    async with PushConsumer(group, topic, got.append, ns, consume_from="first", rebalance_interval=1,
                            long_poll_timeout=2):
        await async_wait_for(lambda: len(got) >= n, timeout=60, message=f"{n} messages from {topic}")
    return got


@pytest.mark.parametrize("mode", ["sync", "batch"])
async def test_theirs_produces_ours_consumes(chronomq_server: ChronomqProcess, mode: str) -> None:
    ns = chronomq_server.namesrv_addr
    topic = f"InteropB{mode}"
    specs = [{"topic": topic, "body": f"theirs-{i}", "keys": f"tk-{i}", "tags": "T",
              "props": {"p1": f"x{i}"}} for i in range(10)]
    if mode == "sync":
        specs.append({"topic": topic, "body_b64": base64.b64encode(b"z" * 9000).decode(), "tags": "BIG"})
    res = await asyncio.to_thread(run_driver, "produce", {"namesrv": ns, "mode": mode, "messages": specs,
                                                          "batch_size": 5}, 60)
    assert not res["errors"], res["errors"]
    got = await _collect(ns, f"CG_ours_{mode}", topic, len(specs))
    by_body = {x.body: x for x in got}
    assert len(got) == len(specs)
    for i in range(10):
        x = by_body[f"theirs-{i}".encode()]
        assert x.keys == [f"tk-{i}"] and x.tags == "T" and x.user_properties() == {"p1": f"x{i}"}
        assert x.topic == topic
    if mode == "sync":
        assert b"z" * 9000 in by_body  # their zlib-compressed body, inflated by us
        ids = {r["msg_id"] for r in res["results"]}
        assert ids == {x.id for x in got}  # the same message ids on both sides
    # and through the pull API
    async with SimpleConsumer("SC_interop", ns) as c:
        pulled: list[ReceivedMessage] = []
        for q in await c.queues(topic):
            pulled += (await c.pull(q, 0, 64)).messages
    assert sorted(x.body for x in pulled) == sorted(x.body for x in got)


async def test_mixed_group_theirs_and_ours_share_queues(chronomq_server: ChronomqProcess,
                                                        tmp_path: Path) -> None:
    """One consumer group with an official consumer and one of ours: they split the queues (the same
    average allocation over the same sorted client-id list) and together get every message."""
    ns = chronomq_server.namesrv_addr
    async with Producer("PG_mixed", ns) as p:
        await p.send(Message("InteropC", b"warmup"))  # creates the topic (4 queues)
        theirs = start_driver("push_consume", {"namesrv": ns, "group": "CG_mixed", "topic": "InteropC",
                                               "deadline_s": 90, "out": str(tmp_path / "theirs.jsonl")},
                              tmp_path)
        try:
            await async_wait_for(lambda: theirs.records(), timeout=30, message="official consumer started")
            ours: list[bytes] = []
            c = PushConsumer("CG_mixed", "InteropC", lambda m: ours.append(m.body), ns, rebalance_interval=1,
                             long_poll_timeout=2)
            async with c:
                await async_wait_for(lambda: len([q for q in c.assigned_queues()
                                                  if q.topic == "InteropC"]) == 2,
                                     timeout=30, message="our consumer holds 2 of the 4 queues")
                # the official client rebalances on NOTIFY_CONSUMER_IDS_CHANGED or within 10 s; give it
                # the time to release our two queues before producing
                await asyncio.sleep(12)
                for i in range(40):
                    await p.send(Message("InteropC", f"mx-{i}"))

                def theirs_bodies() -> list[bytes]:
                    return [base64.b64decode(d["body_b64"]) for d in theirs.records()
                            if d.get("consumed") and "body_b64" in d]

                want = {f"mx-{i}".encode() for i in range(40)}
                await async_wait_for(lambda: want <= set(ours) | set(theirs_bodies()), timeout=30,
                                     message="all 40 consumed by the group")
        finally:
            result = await asyncio.to_thread(theirs.stop)
    theirs_mx = [base64.b64decode(d["body_b64"]) for d in result["messages"] if d["consumed"]]
    theirs_mx = [b for b in theirs_mx if b.startswith(b"mx-")]
    mine = [b for b in ours if b.startswith(b"mx-")]
    assert mine and theirs_mx, (len(mine), len(theirs_mx))
    # every message consumed by the group (a late rebalance of the C++ client under load may deliver a
    # few twice: at least once is the contract)
    assert set(mine) | set(theirs_mx) == want


async def test_ours_schedules_theirs_consumes_at_the_time(chronomq_server: ChronomqProcess) -> None:
    """Messages we send with delay=/deliver_at= reach the official consumer not before their deliver
    time, with TIMER_DELIVER_MS and our ids; the one we cancel never does."""
    ns = chronomq_server.namesrv_addr
    topic = "InteropTimer"
    async with Admin(ns) as a:
        await a.create_topic(topic, 2)
    async with Producer("PG_timer_interop", ns) as p, Admin(ns) as a:
        sent = [await p.send(Message(topic, f"t{i}", keys=f"tk{i}", delay=1.5 + i * 0.5)) for i in range(2)]
        sent.append(await p.send(Message(topic, b"at", uniq_key="interop-at-1",
                                         deliver_at=datetime.now(UTC) + timedelta(milliseconds=2500))))
        # sent last, right before its cancel: its second is the cancel's round trip alone
        doomed = await p.send(Message(topic, b"doomed", delay=1.0))
        [c] = await a.cancel(doomed.uniq_key)
        assert c.outcome == TimerOutcome.CANCELLED
    res = await asyncio.to_thread(run_driver, "push_consume",
                                  {"namesrv": ns, "group": "CG_theirs_timer", "topic": topic,
                                   "expect": len(sent), "deadline_s": 60, "props": ["TIMER_DELIVER_MS"]}, 90)
    got = {d["id"]: d for d in res["messages"] if d["consumed"]}
    assert set(got) == {r.msg_id for r in sent}
    assert "interop-at-1" in got
    for r in sent:
        d = got[r.msg_id]
        assert r.deliver_ms is not None
        assert d["store_timestamp"] >= r.deliver_ms and d["receipt_ms"] >= r.deliver_ms, "delivered early"
        assert d["properties"]["TIMER_DELIVER_MS"] == str(r.deliver_ms)
    async with SimpleConsumer("SC_timer_interop", ns) as sc:
        stored = [x for q in await sc.queues(topic) for x in (await sc.pull(q, 0, 64)).messages]
    assert sorted(x.id for x in stored) == sorted(r.msg_id for r in sent)
