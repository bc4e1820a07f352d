"""The delay service inside a real `chronomq start` process: SIGKILL in the middle of deliveries, with
delayOffset.json older than every delivery, then restart: every message reaches its topic exactly once,
never before its deliver time."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from chronomq.client import Message, Producer, SendStatus
from chronomq.remoting.codes import RequestCode
from tests.compat.harness import ChronomqProcess, RawClient
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(180)

TOPIC = "DelayKill"
LEVELS_MS = [1000, 2000, 3000, 4000]


def delay_stats(addr: str) -> dict:
    with RawClient(addr) as c:
        r = c.call(int(RequestCode.CHRONOMQ_DELAY_STATS))
        assert r.code == 0, r.remark
        return json.loads(r.body)


def pull_everything(addr: str) -> list:
    out = []
    with RawClient(addr) as c:
        for q in range(4):
            out.extend(c.pull_all("CG_check", TOPIC, q))
    return out


def test_sigkill_mid_delivery_then_restart_exactly_once(tmp_path: Path) -> None:
    levels = " ".join(f"{ms // 1000}s" for ms in LEVELS_MS)
    proc = ChronomqProcess(tmp_path / "data", {"messageDelayLevel": levels,
                                               "flushDelayOffsetInterval": "600000"})
    proc.start()
    try:
        n = 400
        with Producer("PG_kill", proc.namesrv_addr) as producer:
            for i in range(n):
                res = producer.send(Message(TOPIC, f"k{i}", keys=f"k{i}", delay_level=1 + i % 4))
                assert res.status is SendStatus.OK, res
        born_floor = {f"k{i}": (1 + i % 4) for i in range(n)}

        # let the first levels deliver (at least a quarter), then kill -9 without any offset persist
        wait_for(lambda: sum(lv["delivered"] for lv in delay_stats(proc.broker_addr)["levels"]) >= n // 4,
                 timeout=30, message="first deliveries")
        proc.stop(kill=True)
        offsets_file = tmp_path / "data" / "config" / "delayOffset.json"
        if offsets_file.exists():  # written at start at most: it must not cover any delivery
            table = json.loads(offsets_file.read_text())["offsetTable"]
            assert all(v == 0 for v in table.values()), table

        proc.start()
        def settled() -> dict | None:
            s = delay_stats(proc.broker_addr)
            return s if all(lv["pending"] == 0 for lv in s["levels"]) else None

        stats = wait_for(settled, timeout=60, message="nothing pending")
        assert stats["early_deliveries"] == 0
        assert stats["recovered_skips"] > 0  # deliveries before the kill were found in the log
        def all_there() -> list | None:
            msgs = pull_everything(proc.broker_addr)
            return msgs if len(msgs) >= n else None

        got = wait_for(all_there, timeout=30, message="all messages on the topic")
        counts = Counter(m.body.decode() for m in got)
        assert sorted(counts) == sorted(born_floor)
        dups = {k: v for k, v in counts.items() if v > 1}
        assert not dups, f"{len(dups)} delivered twice"
        for m in got:
            level = born_floor[m.body.decode()]
            assert m.store_timestamp >= m.born_timestamp + LEVELS_MS[level - 1]
            assert m.properties["DELAY"] == str(level) and m.properties["REAL_TOPIC"] == TOPIC
        # the restarted broker keeps delivering new delayed messages
        with Producer("PG_kill", proc.namesrv_addr) as producer:
            sent_at = int(time.time() * 1000)
            producer.send(Message(TOPIC, "after", delay_level=1))
        late = wait_for(lambda: [m for m in pull_everything(proc.broker_addr) if m.body == b"after"],
                        timeout=30, message="a message sent after the restart")
        assert len(late) == 1 and late[0].store_timestamp >= sent_at + 1000
    finally:
        if proc.running:
            proc.stop()
