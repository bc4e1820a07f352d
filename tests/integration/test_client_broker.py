"""chronomq.client against a real `chronomq start` on loopback (tests/compat/harness.ChronomqProcess):
every client API, consumer-group failover, and a broker restart during sends and consumption."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from chronomq.client import (
    LATER,
    Admin,
    BrokerError,
    ClientError,
    InvalidMessage,
    Message,
    MessageTooLarge,
    Producer,
    PullStatus,
    PushConsumer,
    ReceivedMessage,
    SimpleConsumer,
    TimerOutcome,
)
from chronomq.remoting.codes import ResponseCode
from tests.compat.harness import ChronomqProcess
from tests.conftest import async_wait_for

FAST = {"messageDelayLevel": "300ms 300ms 300ms 300ms 300ms 300ms 300ms 300ms", "maxReconsumeTimes": "2"}
CONSUMER_OPTS = dict(rebalance_interval=0.5, offset_commit_interval=0.5, long_poll_timeout=2.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChronomqProcess]:
    p = ChronomqProcess(tmp_path_factory.mktemp("client") / "data", FAST)
    p.start()
    try:
        yield p
    finally:
        p.stop()


async def test_producer_every_send_kind(server: ChronomqProcess) -> None:
    ns = server.namesrv_addr
    async with Producer("PG_all", ns) as p:
        r = await p.send(Message("CliSend", b"one", keys=["k1", "k2"], tags="A", properties={"u": "1"}))
        batch = await p.send_batch([Message("CliSend", f"b{i}", tags="B") for i in range(4)])
        await p.send_oneway(Message("CliSend", b"oneway", tags="O"))
        many = await asyncio.gather(*(p.send(Message("CliSend", f"c{i}", tags="C")) for i in range(200)))
        ordered = [await p.send_ordered(Message("CliSend", f"o{i}", tags="O2"), key="acct-7")
                   for i in range(10)]
        big = os.urandom(64) * 2000  # compressible, > 4 KiB
        rbig = await p.send(Message("CliSend", big, tags="BIG"))
        delayed = await p.send(Message("CliSend", b"later", tags="D", delay_level=1))
        with pytest.raises(MessageTooLarge):
            await p.send(Message("CliSend", os.urandom(5 * 1024 * 1024)))
        with pytest.raises(InvalidMessage):
            await p.send(Message("bad topic", b"x"))
    assert len({x.msg_id for x in many}) == 200
    assert len({x.queue_id for x in ordered}) == 1
    first = ordered[0].queue_offset
    assert [x.queue_offset for x in ordered] == list(range(first, first + 10))
    assert len(batch.msg_ids) == 4
    async with SimpleConsumer("SC_all", ns) as c:
        got: dict[str, ReceivedMessage] = {}
        deadline = time.monotonic() + 15
        while len(got) < 218 and time.monotonic() < deadline:
            for q in await c.queues("CliSend", refresh=True):
                offset = 0
                while True:  # an answer holds at most 32 (maxTransferCountOnMessageInMemory): page on
                    res = await c.pull(q, offset, 512)
                    for x in res.messages:
                        got[x.id] = x
                    if not res.messages or res.next_offset <= offset:
                        break
                    offset = res.next_offset
    assert got[r.msg_id].body == b"one" and got[r.msg_id].keys == ["k1", "k2"]
    # the broker stamps CLUSTER, MSG_REGION and TRACE_ON on every message, as RocketMQ's does: system
    # properties, not the user's
    assert {"CLUSTER", "MSG_REGION", "TRACE_ON"} <= set(got[r.msg_id].properties)
    assert got[r.msg_id].tags == "A" and got[r.msg_id].user_properties() == {"u": "1"}
    assert got[rbig.msg_id].body == big
    assert [got[i].body for i in batch.msg_ids] == [f"b{i}".encode() for i in range(4)]
    assert {got[x.msg_id].body for x in many} == {f"c{i}".encode() for i in range(200)}
    assert any(x.body == b"oneway" for x in got.values())
    d = got[delayed.msg_id]  # delivered by the schedule service on the real topic
    assert d.topic == "CliSend" and d.store_timestamp - d.born_timestamp >= 250


async def test_push_consumer_retry_dlq_and_redrive(server: ChronomqProcess) -> None:
    ns = server.namesrv_addr
    deliveries: list[tuple[bytes, int, str]] = []
    redriven = asyncio.Event()

    def listener(msg: ReceivedMessage):
        deliveries.append((msg.body, msg.reconsume_times, msg.topic))
        if msg.body == b"poison" and msg.get_property("DLQ_REDRIVE_FROM") is None:
            return LATER
        if msg.body == b"poison":
            redriven.set()
        if msg.body == b"raises" and msg.reconsume_times == 0:
            raise RuntimeError("boom")
        return None

    async with Producer("PG_retry", ns) as p:
        await p.send(Message("CliRetry", b"poison", keys="poison-key"))
        await p.send(Message("CliRetry", b"raises"))
        await p.send(Message("CliRetry", b"fine"))
    async with PushConsumer("CG_retry", {"CliRetry": "*"}, listener, ns, consume_from="first",
                            **CONSUMER_OPTS):
        await async_wait_for(lambda: [r for b, r, _ in deliveries if b == b"poison"] == [0, 1, 2],
                             timeout=30, message="poison delivered 3 times (reconsume 0, 1, 2)")
        await async_wait_for(lambda: (b"raises", 1, "CliRetry") in deliveries, timeout=20)
        assert all(t == "CliRetry" for _, _, t in deliveries)  # retried copies show the original topic
        async with Admin(ns) as a:
            await async_wait_for(lambda: _dlq_size(a), timeout=20, message="poison in %DLQ%CG_retry")
            assert await a.redrive_dlq("CG_retry") == 1
            assert await a.redrive_dlq("CG_retry") == 0
        await asyncio.wait_for(redriven.wait(), 20)
    assert [b for b, _, _ in deliveries].count(b"fine") == 1


async def test_push_consumer_drains_a_backlog_once_with_big_pulls(server: ChronomqProcess) -> None:
    """A backlog of 3000 in 2 queues: the consumer asks for more than pull_batch_size per request, as bulk
    reads (chronomq answers them past maxTransferCountOnMessageInMemory, the 32 an official client gets;
    tests/unit/test_pull_cap.py holds that cap), delivers every message once with its own body, and
    commits the end of both queues."""
    ns = server.namesrv_addr
    async with Admin(ns) as a:
        await a.create_topic("CliBacklog", 2)
    async with Producer("PG_backlog", ns) as p:
        for start in range(0, 3000, 100):
            await p.send_batch([Message("CliBacklog", f"b{i}") for i in range(start, start + 100)])
    seen: dict[bytes, int] = {}
    pulls: list[tuple[int, int, bool]] = []  # (asked, answered, as a bulk read)

    async def listener(msg: ReceivedMessage) -> None:
        seen[msg.body] = seen.get(msg.body, 0) + 1

    c = PushConsumer("CG_backlog", {"CliBacklog": "*"}, listener, ns, consume_from="first",
                     concurrency=16, pull_batch_size=32, **CONSUMER_OPTS)
    real_pull = c._pull

    async def counting_pull(pq, count, commit, bulk=False):  # type: ignore[no-untyped-def]
        res = await real_pull(pq, count, commit, bulk)
        if pq.mq.topic == "CliBacklog":
            pulls.append((count, len(res.messages), bulk))
        return res

    c._pull = counting_pull  # type: ignore[method-assign]
    async with c:
        await async_wait_for(lambda: len(seen) == 3000, timeout=60, message="3000 distinct messages")
        async with Admin(ns) as a:

            async def committed() -> bool:
                await c.commit_offsets()
                rows = await a.group_progress("CG_backlog", "CliBacklog")
                return sum(r.consumer_offset for r in rows if r.queue.topic == "CliBacklog") == 3000

            await async_wait_for(committed, timeout=20, message="offsets committed at the end of both queues")
    assert set(seen) == {f"b{i}".encode() for i in range(3000)}
    assert set(seen.values()) == {1}
    assert all(bulk and asked > 32 for asked, _, bulk in pulls)  # every pull a bulk read of more than 32
    assert max(answered for _, answered, _ in pulls) > 32  # and got more in one answer


async def _count(coro: Awaitable[list[ReceivedMessage]], n: int = 6) -> bool:
    return len(await coro) >= n


async def _dlq_size(a: Admin) -> int:
    try:
        rows = await a.group_progress("CG_retry", "%DLQ%CG_retry")
    except ClientError:
        return 0
    return sum(r.broker_offset for r in rows if r.queue.topic.startswith("%DLQ%"))


async def test_simple_consumer_offsets_and_long_poll(server: ChronomqProcess) -> None:
    ns = server.namesrv_addr
    async with Admin(ns) as a:
        await a.create_topic("CliPull", 1)
    async with Producer("PG_pull", ns) as p, SimpleConsumer("SC_pull", ns) as c:
        first = await p.send(Message("CliPull", b"m0", tags="X"))
        for i in range(1, 5):
            await p.send(Message("CliPull", f"m{i}", tags="Y" if i % 2 else "X"))
        (q,) = await c.queues("CliPull")

        async def dispatched() -> bool:
            return await c.max_offset(q) == 5

        # a send is answered once the commit log has the message; its consume-queue entry (what
        # max_offset counts) follows from the dispatcher thread, which a loaded host can delay
        await async_wait_for(dispatched, message="the 5 messages in the consume queue")
        assert await c.min_offset(q) == 0 and await c.max_offset(q) == 5
        res = await c.pull(q, 0, 2)
        assert [x.body for x in res.messages] == [b"m0", b"m1"] and res.next_offset == 2
        res = await c.pull(q, 0, 32, expression="X")
        assert [x.body for x in res.messages] == [b"m0", b"m2", b"m4"]
        assert (await c.pull(q, 5, 32)).status == PullStatus.NO_NEW_MSG
        assert (await c.pull(q, 99, 32)).status == PullStatus.OFFSET_ILLEGAL
        assert await c.offset_for_timestamp(q, 0) == 0
        assert await c.offset_for_timestamp(q, int(time.time() * 1000) + 60_000) == 5
        assert await c.earliest_store_time(q) >= first.queue_offset
        assert await c.committed_offset(q) in (None, 0)
        await c.commit_offset(q, 3)
        assert await c.committed_offset(q) == 3
        waiter = asyncio.ensure_future(c.pull(q, 5, 32, timeout=10))
        await asyncio.sleep(0.2)
        assert not waiter.done()  # held by the broker (long polling)
        t0 = time.monotonic()
        await p.send(Message("CliPull", b"wake"))
        res = await asyncio.wait_for(waiter, 10)
        assert [x.body for x in res.messages] == [b"wake"] and time.monotonic() - t0 < 5


async def test_admin_every_call(server: ChronomqProcess) -> None:
    ns = server.namesrv_addr
    async with Admin(ns) as a:
        assert await a.create_topic("CliAdmin", 3)
        assert "CliAdmin" in await a.list_topics()
        route = await a.route("CliAdmin")
        assert len(route.read_queues()) == 3 and route.master_addr("broker-a") == server.broker_addr
        async with Producer("PG_admin", ns) as p:
            sent = [await p.send(Message("CliAdmin", f"a{i}", keys=f"order-{i} shared")) for i in range(6)]
        assert (await a.get_message(sent[2].offset_msg_id)).body == b"a2"
        # the key index is built asynchronously by the broker's dispatcher: wait until it has them all
        await async_wait_for(lambda: _count(a.query_messages("CliAdmin", "shared")), timeout=15,
                             message="the key index covers the 6 messages")
        assert (await a.get_message(sent[3].msg_id, topic="CliAdmin")).body == b"a3"
        assert [x.body for x in await a.query_messages("CliAdmin", "order-4")] == [b"a4"]
        assert len(await a.query_messages("CliAdmin", "shared")) == 6
        seen: list[bytes] = []
        async with PushConsumer("CG_admin", "CliAdmin", lambda m: seen.append(m.body), ns,
                                consume_from="first", **CONSUMER_OPTS):
            await async_wait_for(lambda: len(seen) == 6)
        rows = [r for r in await a.group_progress("CG_admin", "CliAdmin") if r.queue.topic == "CliAdmin"]
        assert len(rows) == 3 and sum(r.lag for r in rows) == 0 and sum(r.consumer_offset for r in rows) == 6
        reset = await a.reset_offsets("CG_admin", "CliAdmin", 0)
        assert set(reset.values()) == {0}
        rows = [r for r in await a.group_progress("CG_admin", "CliAdmin") if r.queue.topic == "CliAdmin"]
        assert sum(r.lag for r in rows) == 6
        again: list[bytes] = []
        async with PushConsumer("CG_admin", "CliAdmin", lambda m: again.append(m.body), ns, **CONSUMER_OPTS):
            await async_wait_for(lambda: len(again) == 6, message="re-consumed after the reset")
        stats = await a.delay_stats()
        assert stats["broker-a"]["levels"][0]["delay_ms"] == 300


async def test_consumer_group_failover(server: ChronomqProcess) -> None:
    ns = server.namesrv_addr
    async with Admin(ns) as a:
        await a.create_topic("CliFail", 4)
    got: dict[str, list[bytes]] = {"a": [], "b": []}

    def consumer(name: str) -> PushConsumer:
        return PushConsumer("CG_fail", "CliFail", lambda m: got[name].append(m.body), ns, **CONSUMER_OPTS)

    def mine(c: PushConsumer) -> int:
        return len([q for q in c.assigned_queues() if q.topic == "CliFail"])

    a, b = consumer("a"), consumer("b")
    await a.start()
    await b.start()
    try:
        await async_wait_for(lambda: mine(a) == 2 and mine(b) == 2, timeout=20, message="2+2 split")
        async with Producer("PG_fail", ns) as p:
            for i in range(40):
                await p.send(Message("CliFail", f"x{i}"))
            await async_wait_for(lambda: len(got["a"]) + len(got["b"]) == 40, timeout=20)
            assert got["a"] and got["b"]
            await b.close()  # b leaves: a takes its queues over
            await async_wait_for(lambda: mine(a) == 4, timeout=20, message="takeover")
            for i in range(40, 80):
                await p.send(Message("CliFail", f"x{i}"))
        await async_wait_for(lambda: len(set(got["a"]) | set(got["b"])) == 80, timeout=20)
    finally:
        await a.close()
        await b.close()


async def test_orderly_and_broadcasting(server: ChronomqProcess) -> None:
    ns = server.namesrv_addr
    async with Admin(ns) as a:
        await a.create_topic("CliOrder", 2)
    order: dict[str, list[int]] = {}
    failed = set()

    def listener(m: ReceivedMessage):
        key, n = m.keys[0], int(m.body)
        if n == 3 and key not in failed:
            failed.add(key)
            return LATER  # orderly: retried locally, before the next message of the queue
        order.setdefault(key, []).append(n)

    bc: dict[str, list[bytes]] = {"x": [], "y": []}
    async with PushConsumer("CG_order", "CliOrder", listener, ns, orderly=True, orderly_retry_delay=0.05,
                            consume_from="first", **CONSUMER_OPTS), \
            PushConsumer("CG_bc", "CliOrder", lambda m: bc["x"].append(m.body), ns, broadcasting=True,
                         **CONSUMER_OPTS), \
            PushConsumer("CG_bc", "CliOrder", lambda m: bc["y"].append(m.body), ns, broadcasting=True,
                         **CONSUMER_OPTS):
        async with Producer("PG_order", ns) as p:
            for n in range(10):
                for key in ("k1", "k2"):
                    await p.send_ordered(Message("CliOrder", str(n), keys=key), key=key)
        await async_wait_for(lambda: all(len(order.get(k, [])) == 10 for k in ("k1", "k2")), timeout=20)
        await async_wait_for(lambda: len(bc["x"]) == 20 and len(bc["y"]) == 20, timeout=20)
    assert order == {"k1": list(range(10)), "k2": list(range(10))}


def test_blocking_facade_against_broker(server: ChronomqProcess) -> None:
    ns = server.namesrv_addr
    got: list[bytes] = []
    with Producer("PG_block", ns) as p:
        r = p.send(Message("CliBlock", b"sync"))
        assert r.queue_offset >= 0
        with PushConsumer("CG_block", "CliBlock", lambda m: got.append(m.body), ns, consume_from="first",
                          **CONSUMER_OPTS):
            deadline = time.monotonic() + 20
            while not got and time.monotonic() < deadline:
                time.sleep(0.02)
    assert got == [b"sync"]
    assert not [t for t in threading.enumerate() if t.name.startswith("chronomq")]


@pytest.mark.parametrize("kill", [False, True], ids=["clean-restart", "sigkill-restart"])
async def test_broker_restart_during_sends_and_consumption(tmp_path: Path, kill: bool) -> None:
    server = ChronomqProcess(tmp_path / "data", {"flushDiskType": "SYNC_FLUSH"})
    server.start()
    ns = server.namesrv_addr
    acked: set[str] = set()
    consumed: set[str] = set()
    stop = asyncio.Event()
    failures: list[ClientError] = []

    async def produce(p: Producer) -> None:
        i = 0
        while not stop.is_set() and i < 5000:
            try:
                r = await p.send(Message("CliRestart", f"r{i}"), timeout=2)
                acked.add(r.msg_id)
            except ClientError as e:
                failures.append(e)
                await asyncio.sleep(0.05)  # broker down: keep trying (only acked sends count)
            i += 1

    try:
        async with Producer("PG_restart", ns, retries=1) as p, \
                PushConsumer("CG_restart", "CliRestart", lambda m: consumed.add(m.id), ns,
                             consume_from="first", **CONSUMER_OPTS):
            task = asyncio.ensure_future(produce(p))
            await async_wait_for(lambda: len(consumed) >= 50, timeout=20, message="traffic before restart")
            await asyncio.to_thread(server.stop, kill)
            n_before = len(acked)
            await asyncio.to_thread(server.start)
            await async_wait_for(lambda: len(acked) >= n_before + 50, timeout=30, message="sends resume")
            stop.set()
            await task
            await async_wait_for(lambda: acked <= consumed, timeout=40,
                                 message="every acknowledged message consumed after the restart")
            assert failures, "the restart should have made some sends fail"
    finally:
        stop.set()
        server.stop()


_KILLABLE_CONSUMER = """
import asyncio, sys
from chronomq.client import PushConsumer

async def main():
    out = open(sys.argv[2], "a", buffering=1)
    def listener(m):
        out.write(m.body.decode() + "\\n")
    async with PushConsumer("CG_kill", "CliKill", listener, sys.argv[1], rebalance_interval=0.5,
                            offset_commit_interval=0.5, long_poll_timeout=2.0):
        print("started", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_consumer_process_killed_survivor_takes_over(server: ChronomqProcess, tmp_path: Path) -> None:
    """A consumer process dies without a goodbye (SIGKILL): the broker drops it when its connection
    closes, the survivor's rebalance takes its queues from the committed offsets, nothing is lost."""
    import subprocess
    import sys

    ns = server.namesrv_addr
    async with Admin(ns) as a:
        await a.create_topic("CliKill", 4)
    out = tmp_path / "victim.txt"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    victim = subprocess.Popen([sys.executable, "-c", _KILLABLE_CONSUMER, ns, str(out)], env=env,
                              stdout=subprocess.PIPE, text=True)
    survivor_got: list[str] = []
    try:
        assert victim.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(victim.stdout.readline), 30)
        assert line.strip() == "started"
        c = PushConsumer("CG_kill", "CliKill", lambda m: survivor_got.append(m.body.decode()), ns,
                         **CONSUMER_OPTS)
        async with c, Producer("PG_kill", ns) as p:
            await async_wait_for(lambda: len([q for q in c.assigned_queues() if q.topic == "CliKill"]) == 2,
                                 timeout=20, message="2+2 split with the victim process")
            for i in range(40):
                await p.send(Message("CliKill", f"k{i}"))

            def victim_got() -> list[str]:
                return out.read_text().split() if out.exists() else []

            await async_wait_for(lambda: len(set(victim_got()) | set(survivor_got)) == 40, timeout=20)
            assert victim_got(), "the victim consumed nothing before being killed"
            victim.kill()
            victim.wait(10)
            await async_wait_for(lambda: len([q for q in c.assigned_queues() if q.topic == "CliKill"]) == 4,
                                 timeout=30, message="takeover after SIGKILL")
            for i in range(40, 80):
                await p.send(Message("CliKill", f"k{i}"))
            await async_wait_for(lambda: {f"k{i}" for i in range(40, 80)} <= set(survivor_got), timeout=20)
        assert {f"k{i}" for i in range(80)} <= set(victim_got()) | set(survivor_got)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)


# --- deliver times through the timer store -------------------------------------------------------------
def _now_ms() -> int:
    return int(time.time() * 1000)


async def test_deliver_time_cancel_reschedule_pending(server: ChronomqProcess) -> None:
    """delay=1.5 s arrives not before its deliver time; a cancelled message never arrives; a rescheduled
    one arrives at its new time; pending lists by key/topic/tag/window, paged; outcomes are definite."""
    ns = server.namesrv_addr
    topic = "CliTimer"
    async with Admin(ns) as a:
        await a.create_topic(topic, 2)
    arrivals: dict[str, tuple[ReceivedMessage, int]] = {}

    async def listener(msg: ReceivedMessage) -> None:
        arrivals.setdefault(msg.id, (msg, _now_ms()))

    async with Producer("PG_timer", ns) as p, Admin(ns) as a, \
            PushConsumer("CG_timer", topic, listener, ns, consume_from="first", **CONSUMER_OPTS):
        moved = await p.send(Message(topic, b"moved", keys="t-moved", tags="T", delay=timedelta(hours=1)))
        far_at = datetime.now(UTC) + timedelta(days=7)
        far = [await p.send(Message(topic, f"far{i}", keys="t-far", tags="F", deliver_at=far_at + timedelta(
            milliseconds=i))) for i in range(3)]
        mine = await p.send(Message(topic, b"mine", uniq_key="client-chosen-id-1", delay=timedelta(days=1)))
        # the two 4 s messages last: their 4 s are the calls below alone, not the sends above
        due = await p.send(Message(topic, b"due", keys="t-due", tags="T", delay=4))
        doomed = await p.send(Message(topic, b"doomed", keys="t-doomed", tags="T", delay=4))
        for r in (due, doomed, moved, *far, mine):
            assert r.scheduled and r.uniq_key == r.msg_id and r.deliver_ms is not None
        assert mine.msg_id == "client-chosen-id-1"
        assert far[1].deliver_ms == int(far_at.timestamp() * 1000) + 1
        # cancel before due (4 s leave a slow machine time for the calls below), then move the one-hour
        # message to 4 s from now
        [c] = await a.cancel(doomed.uniq_key)
        assert (c.outcome, c.msg_id, c.deliver_ms, c.topic) == (TimerOutcome.CANCELLED, doomed.msg_id,
                                                                 doomed.deliver_ms, topic)
        assert (await a.cancel(doomed.uniq_key))[0].outcome == TimerOutcome.ALREADY_CANCELLED
        new_ms = _now_ms() + 4000
        [r] = await a.reschedule(moved.uniq_key, new_ms)
        assert (r.outcome, r.deliver_ms) == (TimerOutcome.RESCHEDULED, new_ms)
        # the pending index: by key, by topic (paged), by tag and window, counts
        [hit] = (await a.pending(key="t-moved")).items
        assert (hit.msg_id, hit.deliver_ms, hit.topic) == (moved.msg_id, new_ms, topic)
        assert (hit.tags, hit.keys) == ("T", ["t-moved"])
        assert [x.msg_id for x in (await a.pending(key="t-far")).items] == [x.msg_id for x in far]
        assert await a.pending_count(topic=topic) == 6
        assert await a.pending_count(tag="F", start=far[1].deliver_ms, end=far[2].deliver_ms) == 2
        seen, cursor = [], None
        for _ in range(10):
            page = await a.pending(topic=topic, limit=2, cursor=cursor)
            assert len(page.items) <= 2
            seen += [x.msg_id for x in page.items]
            cursor = page.next_cursor
            if cursor is None:
                break
        assert sorted(seen) == sorted([due.msg_id, moved.msg_id, mine.msg_id, *(x.msg_id for x in far)])
        # a marker due after everything above: once it has arrived the timer has released everything due
        # before it (oldest-due-first), so "doomed" would have arrived by then if the cancel had failed
        marker = await p.send(Message(topic, b"marker", delay=5.0))
        await async_wait_for(lambda: {due.msg_id, moved.msg_id, marker.msg_id} <= set(arrivals), timeout=30,
                             message="the due, rescheduled and marker messages")
        for r_, deliver_ms in ((due, due.deliver_ms), (moved, new_ms), (marker, marker.deliver_ms)):
            msg, arrival = arrivals[r_.msg_id]
            assert msg.store_timestamp >= deliver_ms, "delivered early"
            assert arrival >= deliver_ms
            assert msg.get_property("TIMER_DELIVER_MS") == str(deliver_ms)
            print(f"{msg.body!r}: stored {msg.store_timestamp - deliver_ms} ms, consumed "
                  f"{arrival - deliver_ms} ms after its deliver time")
        assert arrivals[due.msg_id][0].body == b"due" and arrivals[due.msg_id][0].keys == ["t-due"]
        assert doomed.msg_id not in arrivals
        async with SimpleConsumer("SC_timer", ns) as sc:
            stored = [x for q in await sc.queues(topic) for x in (await sc.pull(q, 0, 64)).messages]
        assert doomed.msg_id not in {x.id for x in stored} and len(stored) == 3
        # after delivery: definite answers
        for call in (a.cancel(due.uniq_key), a.reschedule(due.uniq_key, delay=60)):
            [d] = await call
            assert d.outcome == TimerOutcome.ALREADY_DELIVERED and d.deliver_ms is not None
        [u] = await a.cancel("no-such-message-id")
        assert u.outcome == TimerOutcome.UNKNOWN
        # cancel by key: every pending message with it; by a caller-chosen id
        res = await a.cancel("t-far", by_key=True)
        assert sorted(x.msg_id for x in res) == sorted(x.msg_id for x in far)
        assert {x.outcome for x in res} == {TimerOutcome.CANCELLED}
        assert (await a.cancel("client-chosen-id-1"))[0].outcome == TimerOutcome.CANCELLED
        assert await a.pending_count(topic=topic) == 0
        # beyond the maximum delay (40 days by default): refused at once, not retried elsewhere
        with pytest.raises(BrokerError) as ei:
            await p.send(Message(topic, b"too far", delay=timedelta(days=41)))
        assert ei.value.code == ResponseCode.MESSAGE_ILLEGAL
        assert "timer" in (await a.delay_stats())["broker-a"]


def test_timer_admin_blocking(server: ChronomqProcess) -> None:
    ns = server.namesrv_addr
    with Producer("PG_timer_b", ns) as p, Admin(ns) as a:
        r = p.send(Message("CliTimerB", b"x", keys="blocking-key", delay=timedelta(minutes=10)))
        assert r.scheduled and a.pending_count(key="blocking-key") == 1
        [res] = a.reschedule("blocking-key", r.deliver_ms + 5000, by_key=True)
        assert res.outcome == TimerOutcome.RESCHEDULED and res.deliver_ms == r.deliver_ms + 5000
        assert a.pending(topic="CliTimerB").items[0].deliver_ms == r.deliver_ms + 5000
        [res] = a.cancel(r.offset_msg_id)   # the offset msg id is a handle too
        assert res.outcome == TimerOutcome.CANCELLED and res.msg_id == r.msg_id
        assert a.pending_count(topic="CliTimerB") == 0
        # a timed batch: scheduled as a whole, one deliver time per message
        at = int(time.time() * 1000) + 600_000
        b = p.send_batch([Message("CliTimerB", f"b{i}", keys="batch-key", deliver_at=at + i)
                          for i in range(3)])
        assert b.deliver_times_ms == (at, at + 1, at + 2) and b.scheduled
        listed = a.pending(key="batch-key").items
        assert [(x.msg_id, x.deliver_ms) for x in listed] == list(zip(b.msg_ids, b.deliver_times_ms,
                                                                          strict=True))
        assert {x.outcome for x in a.cancel("batch-key", by_key=True)} == {TimerOutcome.CANCELLED}
        assert a.pending_count(topic="CliTimerB") == 0


async def test_cancel_by_a_uniq_key_shaped_like_a_timer_handle(server: ChronomqProcess) -> None:
    """A 32-hex UNIQ_KEY whose "offset" bit 62 is set (ids of the official 4.x clients and Spark row ids
    have this shape a quarter of the time) is found by the key index, not taken for a timer handle."""
    ns = server.namesrv_addr
    uid = "7F000001ABCD12344000000000000123"  # 17th hex char '4': bits 63..62 of the "offset" = 01
    async with Producer("PG_timer_shape", ns) as p, Admin(ns) as a:
        r = await p.send(Message("CliTimerShape", b"x", uniq_key=uid, delay=timedelta(hours=1)))
        assert r.scheduled and r.uniq_key == uid
        [c] = await a.cancel(uid)
        if c.outcome != TimerOutcome.CANCELLED:
            await a.cancel(r.offset_msg_id)  # clean up either way: nothing of this test stays pending
        assert c.outcome == TimerOutcome.CANCELLED
