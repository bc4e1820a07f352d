"""What each console page shows, gathered through ``chronomq.client.Admin`` (plain dicts for the
templates). Rules: only the client's API, never the broker's internals; bounded work per page (at most
MAX_ROWS topics or groups are looked into); rates come from two readings of the same counter taken by
this console (TpsSampler), so they need no support from the broker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from chronomq import message as m
from chronomq.client import Admin, ClientError

MAX_ROWS = 200
SYSTEM_PREFIXES = (m.RETRY_GROUP_TOPIC_PREFIX, m.DLQ_GROUP_TOPIC_PREFIX)
SYSTEM_TOPICS = {m.SCHEDULE_TOPIC, m.DEFAULT_TOPIC, "RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRANS_OP_HALF_TOPIC",
                 "CHRONOMQ_SYS_TIMER_JOURNAL", "SELF_TEST_TOPIC", "OFFSET_MOVED_EVENT"}


def is_system_topic(topic: str) -> bool:
    return topic in SYSTEM_TOPICS or topic.startswith(SYSTEM_PREFIXES) or topic.startswith("rmq_sys_")


class TpsSampler:
    """Messages per second of a counter (a topic's total max offset, a group's consumed offsets): the
    change since the reading kept from at least ``min_gap_ms`` earlier. None until two readings exist."""

    def __init__(self, now_ms: Callable[[], int], min_gap_ms: int = 1_000, max_keys: int = 10_000) -> None:
        self.now_ms = now_ms
        self.min_gap_ms = min_gap_ms
        self.max_keys = max_keys
        self._last: dict[str, tuple[int, int]] = {}  # key -> (time ms, value)
        self._rate: dict[str, float] = {}

    def rate(self, key: str, value: int) -> float | None:
        now = self.now_ms()
        prev = self._last.get(key)
        if prev is None or value < prev[1]:  # first reading, or the counter went back (store cleaned)
            if len(self._last) >= self.max_keys:
                self._last.clear()
                self._rate.clear()
            self._last[key] = (now, value)
            self._rate.pop(key, None)
            return None
        if now - prev[0] >= self.min_gap_ms:
            self._rate[key] = (value - prev[1]) * 1000 / (now - prev[0])
            self._last[key] = (now, value)
        return self._rate.get(key)


class ClusterView:
    def __init__(self, admin: Admin, tps: TpsSampler) -> None:
        self.admin = admin
        self.tps = tps

    async def brokers(self) -> list[dict[str, Any]]:
        rows = []
        for cluster, names in sorted((await self.admin.cluster()).items()):
            for name, addrs in sorted(names.items()):
                for broker_id, addr in sorted(addrs.items()):
                    row: dict[str, Any] = {"cluster": cluster, "name": name, "id": broker_id, "addr": addr}
                    try:
                        info = await self.admin.broker_runtime_info(addr)
                    except (ClientError, OSError) as e:
                        row["error"] = str(e)
                        rows.append(row)
                        continue
                    puts = int(info.get("putMessageTimesTotal", "0") or 0)
                    row.update(
                        role=info.get("brokerRole", "?"), version=info.get("brokerVersionDesc", "?"),
                        disk=float(info.get("commitLogDiskRatio", "nan") or "nan"),
                        flush=info.get("flushDiskType", "?"),
                        uptime_s=int(info.get("uptimeSeconds", "0") or 0),
                        puts=puts, put_tps=self.tps.rate(f"broker-put:{addr}", puts),
                        topics=info.get("topics", "?"), groups=info.get("consumerGroups", "?"),
                        connections=info.get("connections", "?"), ha_lag=info.get("haLagBytes"),
                        commitlog_bytes=int(info.get("commitLogMaxOffset", "0") or 0)
                        - int(info.get("commitLogMinOffset", "0") or 0))
                    rows.append(row)
        return rows

    async def topics(self, show_system: bool) -> list[dict[str, Any]]:
        hidden: set[str] = set()
        if not show_system:  # brokers register topics named after their cluster and themselves
            for cluster, brokers in (await self.admin.cluster()).items():
                hidden.add(cluster)
                hidden.update(brokers)
        names = [t for t in await self.admin.list_topics()
                 if show_system or not (is_system_topic(t) or t in hidden)][:MAX_ROWS]

        async def one(topic: str) -> dict[str, Any]:
            try:
                offsets = await self.admin.topic_offsets(topic)
            except (ClientError, OSError) as e:
                return {"topic": topic, "queues": 0, "messages": 0, "max_total": 0, "tps": None,
                        "error": str(e)}
            total = sum(hi for _mq, _lo, hi in offsets)
            return {"topic": topic, "queues": len(offsets),
                    "messages": sum(hi - lo for _mq, lo, hi in offsets),
                    "max_total": total, "tps": self.tps.rate(f"topic:{topic}", total)}

        return list(await asyncio.gather(*(one(t) for t in names)))

    async def topic(self, topic: str) -> dict[str, Any]:
        route = await self.admin.route(topic)
        offsets = await self.admin.topic_offsets(topic)
        queues = [{"broker": mq.broker_name, "queue_id": mq.queue_id, "min": lo, "max": hi}
                  for mq, lo, hi in sorted(offsets, key=lambda x: (x[0].broker_name, x[0].queue_id))]
        total = sum(hi for _mq, _lo, hi in offsets)
        return {"queues": queues, "brokers": sorted(route.broker_addrs),
                "messages": sum(hi - lo for _mq, lo, hi in offsets),
                "tps": self.tps.rate(f"topic:{topic}", total)}

    async def _clients(self, group: str) -> list[str]:
        ids: set[str] = set()
        for _name, addr in await self.admin.masters():
            ids.update(await self.admin.broker_consumer_ids(addr, group))
        return sorted(ids)

    async def groups(self) -> list[dict[str, Any]]:
        groups = list((await self.admin.consumer_groups()).items())[:MAX_ROWS]

        async def one(group: str, topics: list[str]) -> dict[str, Any]:
            real = [t for t in topics if not t.startswith(m.RETRY_GROUP_TOPIC_PREFIX)]
            progress = await self.admin.group_progress(group, real)
            consumed = sum(max(p.consumer_offset, 0) for p in progress)
            return {"group": group, "topics": real, "lag": sum(p.lag for p in progress),
                    "clients": len(await self._clients(group)),
                    "tps": self.tps.rate(f"group:{group}", consumed)}

        return list(await asyncio.gather(*(one(g, t) for g, t in groups)))

    async def group(self, group: str) -> dict[str, Any]:
        topics = (await self.admin.consumer_groups()).get(group)
        if topics is None:
            raise ClientError(f"no consumer group {group!r} has committed an offset on any broker")
        real = [t for t in topics if not t.startswith(m.RETRY_GROUP_TOPIC_PREFIX)]
        progress = await self.admin.group_progress(group, real)
        queues = [{"topic": p.queue.topic, "broker": p.queue.broker_name, "queue_id": p.queue.queue_id,
                   "broker_offset": p.broker_offset, "consumer_offset": p.consumer_offset, "lag": p.lag}
                  for p in progress]
        return {"queues": queues, "lag": sum(q["lag"] for q in queues), "clients": await self._clients(group),
                "topics": real}

    async def delay(self) -> dict[str, Any]:
        """Delay levels and the timer, summed over the master brokers."""
        levels: dict[int, dict[str, Any]] = {}
        timer: dict[str, Any] = {"pending": 0, "delivered": 0, "cancelled": 0, "rescheduled": 0, "early": 0,
                                 "next_due": None, "due_undelivered": 0}
        by_topic: dict[str, int] = {}
        buckets: dict[int, int] = {}
        lateness_count = 0
        p99 = 0
        level_early = 0
        for _name, stats in (await self.admin.delay_stats()).items():
            level_early += int(stats.get("early_deliveries") or 0)
            for lv in stats.get("levels") or []:
                row = levels.setdefault(lv["level"], {
                    "level": lv["level"], "delay": _delay_text(lv["delay_ms"]), "pending": 0, "delivered": 0,
                    "oldest_due": None, "p99": 0})
                row["pending"] += lv.get("pending") or 0
                row["delivered"] += lv.get("delivered") or 0
                due = lv.get("oldest_pending_deliver_ms")
                if due and (row["oldest_due"] is None or due < row["oldest_due"]):
                    row["oldest_due"] = due
                row["p99"] = max(row["p99"], (lv.get("lateness_ms") or {}).get("p99") or 0)
            t = stats.get("timer") or {}
            for k_out, k_in in (("pending", "pending"), ("delivered", "delivered"),
                                ("cancelled", "cancelled"), ("rescheduled", "rescheduled"),
                                ("early", "early_deliveries"), ("due_undelivered", "due_undelivered")):
                timer[k_out] += int(t.get(k_in) or 0)
            nd = t.get("next_due_ms")
            if nd and (timer["next_due"] is None or nd < timer["next_due"]):
                timer["next_due"] = nd
            for topic, n in (t.get("pending_by_topic") or {}).items():
                by_topic[topic] = by_topic.get(topic, 0) + int(n)
            for bound, count in t.get("lateness_buckets_ms") or []:
                buckets[int(bound)] = buckets.get(int(bound), 0) + int(count)
            lat = t.get("lateness_ms") or {}
            lateness_count += int(lat.get("count") or 0)
            p99 = max(p99, int(lat.get("p99") or 0))
        timer["lateness_p99"] = p99
        # the soonest pending message of each broker (the timer's own figure covers only what it has loaded)
        for _name, addr in await self.admin.masters():
            page = await self.admin.pending(limit=1, broker_addr=addr)
            if page.items and (timer["next_due"] is None or page.items[0].deliver_ms < timer["next_due"]):
                timer["next_due"] = page.items[0].deliver_ms
        return {"levels": [levels[k] for k in sorted(levels)], "timer": timer, "timer_by_topic": by_topic,
                "lateness_buckets": sorted(buckets.items()), "lateness_count": lateness_count,
                "level_early": level_early}

    async def dead_letters(self) -> list[dict[str, Any]]:
        names = [t for t in await self.admin.list_topics()
                 if t.startswith(m.DLQ_GROUP_TOPIC_PREFIX)][:MAX_ROWS]
        rows = []
        for topic in names:
            try:
                offsets = await self.admin.topic_offsets(topic)
            except (ClientError, OSError):
                continue
            rows.append({"group": topic[len(m.DLQ_GROUP_TOPIC_PREFIX):], "topic": topic,
                         "messages": sum(hi - lo for _mq, lo, hi in offsets)})
        return sorted(rows, key=lambda r: -r["messages"])


def _delay_text(ms: int) -> str:
    if ms % 3_600_000 == 0:
        return f"{ms // 3_600_000}h"
    if ms % 60_000 == 0:
        return f"{ms // 60_000}m"
    if ms % 1000 == 0:
        return f"{ms // 1000}s"
    return f"{ms}ms"
