"""/metrics of a real broker (in process, loopback) after known traffic: stored and consumed counts, a
group's lag, delay-level and timer pending counts, the lateness histogram and role, parsed with
prometheus-client's own parser."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from tests.conftest import async_wait_for, free_port

from chronomq.broker.controller import BrokerController
from chronomq.client import Message, Producer, SimpleConsumer
from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig
from chronomq.delay.histogram import Histogram
from chronomq.namesrv.server import NameServer


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("cluster", "broker")))
            out[(s.name, labels)] = s.value
    return out


async def test_metrics_after_known_traffic(tmp_path: Path) -> None:
    ns = NameServer("127.0.0.1", free_port(), SystemClock())
    await ns.start()
    mport = free_port()
    values = {"storePathRootDir": str(tmp_path), "listenPort": str(free_port()),
              "haListenPort": str(free_port()), "namesrvAddr": ns.address, "metricsPort": str(mport),
              "messageDelayLevel": "1s 1h"}
    config, _ = BrokerConfig.load(None, values)
    b = BrokerController(config, SystemClock())
    await b.start()
    try:
        async with Producer("PG_m", ns.address) as p:
            for i in range(10):
                await p.send(Message("MetT", f"m{i}".encode()))
            await p.send(Message("MetT", b"parked", delay_level=2))  # 1 h: pending under level 2
            now = SystemClock().now_ms()
            for _ in range(3):
                await p.send(Message("MetT", b"much later", deliver_at=now + 3_600_000))
            for _ in range(2):  # a deliver time already past on arrival is put at once, not through the
                # timer: each is 1 s ahead of its own send (not of the sends before it, which a loaded
                # machine can make take longer than that)
                await p.send(Message("MetT", b"soon", deliver_at=SystemClock().now_ms() + 1_000))
        await async_wait_for(lambda: b.timer.stats()["delivered"] == 2, 10, message="the two soon ones")
        async with SimpleConsumer("CG_m", ns.address) as c:
            got = 0
            pulled = []
            for q in await c.queues("MetT"):
                res = await c.pull(q, 0, 2)
                got += len(res.messages)
                pulled += res.messages
                if res.messages:
                    await c.commit_offset(q, res.next_offset)
        assert got > 0
        timed_in_partial = sum(1 for msg in pulled if "TIMER_DELIVER_MS" in msg.properties)
        async with SimpleConsumer("CG_all", ns.address) as c:  # reads everything, commits nothing
            everything = [msg for q in await c.queues("MetT") for msg in (await c.pull(q, 0, 32)).messages]
        assert len(everything) == 12

        def flushed() -> bool:  # the commit log's periodic flush has run since the sends
            return scrape(mport).get(("chronomq_commitlog_flush_ms_count", ()), 0) >= 1

        await async_wait_for(lambda: asyncio.to_thread(flushed), 10, message="a commit-log flush")
        m = await asyncio.to_thread(scrape, mport)  # the endpoint reads the broker on its loop
        stored = m[("rocketmq_producer_offset", (("topic", "MetT"),))]
        assert stored == 12  # 10 plain + 2 delivered by the timer (the parked ones are elsewhere)
        offset = m[("rocketmq_consumer_offset", (("group", "CG_m"), ("topic", "MetT")))]
        lag = m[("rocketmq_group_diff", (("group", "CG_m"), ("topic", "MetT")))]
        assert offset == got and lag == 12 - got
        assert m[("chronomq_delay_level_pending", (("level", "2"),))] == 1
        assert m[("chronomq_timer_pending", (("topic", "MetT"),))] == 3
        assert m[("chronomq_timer_delivered_total", ())] == 2
        assert m[("chronomq_early_deliveries_total", ())] == 0
        assert m[("chronomq_timer_lateness_ms_count", ())] == 2
        assert m[("chronomq_timer_lateness_ms_bucket", (("le", "+Inf"),))] == 2
        assert m[("chronomq_timer_lateness_ms_bucket", (("le", "60000"),))] == 2
        assert m[("chronomq_put_messages_total", ())] >= 10
        assert m[("chronomq_broker_role", (("role", "ASYNC_MASTER"),))] == 1
        # traffic: in by message type (bodies' bytes), out by group (records' bytes)
        assert m[("rocketmq_messages_in_total", (("message_type", "Normal"), ("topic", "MetT")))] == 10
        assert m[("rocketmq_throughput_in_total", (("message_type", "Normal"), ("topic", "MetT")))] == 20
        assert m[("rocketmq_messages_in_total", (("message_type", "Delay"), ("topic", "MetT")))] == 6
        assert m[("rocketmq_throughput_in_total", (("message_type", "Delay"), ("topic", "MetT")))] == \
            len(b"parked") + 3 * len(b"much later") + 2 * len(b"soon")
        assert m[("rocketmq_messages_out_total", (("group", "CG_m"), ("topic", "MetT")))] == got
        assert m[("rocketmq_messages_out_total", (("group", "CG_all"), ("topic", "MetT")))] == 12
        assert m[("rocketmq_throughput_out_total", (("group", "CG_all"), ("topic", "MetT")))] == \
            sum(msg.store_size for msg in everything)
        # the two timed messages at the pulls that handed them out: CG_all's, and CG_m's if it got one
        assert m[("chronomq_pull_lateness_ms_count", ())] == 2 + timed_in_partial
        assert m[("chronomq_pull_lateness_ms_bucket", (("le", "60000"),))] == 2 + timed_in_partial
        # storage
        assert 0 < m[("rocketmq_brokeruntime_commitlog_disk_ratio", ())] < 1
        assert m[("chronomq_commitlog_flush_ms_count", ())] >= 1
        flushes = m[("chronomq_commitlog_flush_ms_count", ())]
        assert m[("chronomq_commitlog_flush_ms_bucket", (("le", "+Inf"),))] == flushes
        assert m[("rocketmq_storage_dispatch_behind_bytes", ())] == 0
        assert m[("rocketmq_storage_flush_behind_bytes", ())] >= 0
    finally:
        await b.shutdown()
        await ns.stop()


def test_histogram_buckets_never_count_above_the_truth() -> None:
    h = Histogram()
    for v in (0, 3, 31, 40, 100, 1000):
        h.record(v)
    got = h.cumulative([0, 3, 31, 39, 100, 10_000])
    # 100 lies in the bucket 96..103, which is not wholly within 100: left out, never counted too high
    assert got == [(0, 1), (3, 2), (31, 3), (39, 3), (100, 4), (10_000, 6)]


async def test_name_server_metrics(tmp_path: Path) -> None:
    from chronomq.metrics import MetricsServer, namesrv_families

    ns = NameServer("127.0.0.1", free_port(), SystemClock())
    await ns.start()
    values = {"storePathRootDir": str(tmp_path), "listenPort": str(free_port()), "metricsPort": "-1",
              "haListenPort": str(free_port()), "namesrvAddr": ns.address, "brokerName": "nb"}
    config, _ = BrokerConfig.load(None, values)
    b = BrokerController(config, SystemClock())
    await b.start()  # registers over TCP
    server = MetricsServer(ns.metrics_snapshot, "127.0.0.1", 0, namesrv_families)
    try:
        assert b.metrics is None  # metricsPort -1: no endpoint
        m = await asyncio.to_thread(scrape, server.port)
        assert m[("chronomq_namesrv_broker", (("addr", b.broker_addr), ("id", "0")))] == 1
        assert m[("chronomq_namesrv_topics", ())] >= 1 and m[("chronomq_namesrv_requests_total", ())] >= 1
    finally:
        server.stop()
        await b.shutdown()
        await ns.stop()


def test_the_grafana_dashboard_uses_only_exported_metrics() -> None:
    import json
    import re

    from chronomq.metrics import families, namesrv_families

    snap = {"cluster": "c", "broker": "b", "role": "ASYNC_MASTER", "put_messages": 1, "put_failures": 0,
            "topics": {"T": 1}, "groups": [{"topic": "T", "group": "G", "offset": 1, "diff": 0}],
            "commitlog": {"max": 1, "min": 0}, "delay_levels": {1: 0},
            "timer": {"pending": {}, "delivered": 0, "cancelled": 0, "rescheduled": 0, "early": 0,
                      "lateness": {"buckets": [(1, 0)], "count": 0, "sum": 0}},
            "traffic": {"in": [("T", "Normal", 1, 1)], "out": [("T", "G", 1, 1)],
                        "pull_lateness": {"buckets": [(1, 0)], "count": 0, "sum": 0}},
            "storage": {"disk_ratio": 0.5, "flush": {"buckets": [(1, 0)], "count": 0, "sum": 0},
                        "flush_behind": 0, "dispatch_behind": 0},
            "replication": {"lag_bytes": 0, "lag_ms": 0}}
    names = set()
    for fam in [*families(snap), *namesrv_families({"brokers": [], "topics": 0, "requests": 0})]:
        names.add(fam.name)  # a family with no sample in this snapshot still exists
        names.update(s.name for s in fam.samples)
    dash = json.loads((Path(__file__).resolve().parents[2] / "dashboards" / "chronomq.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"]
            for m in re.findall(r"\b(?:chronomq|rocketmq)_[a-z_]+\b", t["expr"])}
    assert used and used <= names, used - names
