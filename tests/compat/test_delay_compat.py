"""Delayed delivery, the retry ladder and the DLQ with the official 4.x client (rocketmq==0.4.4)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.compat.harness import ChronomqProcess, RawClient, run_driver, start_driver
from tests.conftest import wait_for

pytestmark = [pytest.mark.compat, pytest.mark.timeout(180)]


def _consumer(tmp_path: Path, server: ChronomqProcess, group: str, topic: str, **extra: object):
    out = tmp_path / f"{group}.jsonl"
    d = start_driver("push_consume", {"namesrv": server.namesrv_addr, "group": group, "topic": topic,
                                      "deadline_s": 120, "out": str(out), **extra}, tmp_path)
    return d


def _deliveries(d) -> list[dict]:
    return [r for r in d.records() if "event" not in r]


def test_levels_1_2_3_arrive_after_1_5_10_seconds(
        official_client: str, chronomq_factory: Callable[..., ChronomqProcess], tmp_path: Path) -> None:
    server = chronomq_factory()
    topic, group = "DelayTopic", "CG_delay"
    # create the topic and make sure the consumer is up before the clock matters
    run_driver("produce", {"namesrv": server.namesrv_addr, "messages": [{"topic": topic, "body": "warm"}]})
    consumer = _consumer(tmp_path, server, group, topic)
    try:
        wait_for(lambda: any(r.get("body_b64") == "d2FybQ==" for r in _deliveries(consumer)), timeout=60,
                 message="the push consumer received the warm-up message")
        specs = [{"topic": topic, "body": f"L{lv}-{i}", "delay_level": lv, "keys": f"k{lv}-{i}"}
                 for i in range(2) for lv in (1, 2, 3)]
        sent = run_driver("produce", {"namesrv": server.namesrv_addr, "messages": specs})
        assert sent["acked"] == len(specs), sent
        delays = {1: 1000, 2: 5000, 3: 10000}

        def delayed() -> list[dict]:
            return [r for r in _deliveries(consumer) if r["keys"] and r["keys"].startswith("k")]

        wait_for(lambda: len(delayed()) >= len(specs), timeout=40, message="all delayed messages")
        got = delayed()
        assert sorted(r["keys"] for r in got) == sorted(s["keys"] for s in specs)  # once each
        lateness = []
        for r in got:
            level = int(r["keys"][1])
            due_floor = r["born_timestamp"] + delays[level]  # parked no earlier than born
            assert r["receipt_ms"] >= due_floor, f"early by {due_floor - r['receipt_ms']} ms: {r}"
            assert r["store_timestamp"] >= due_floor, r
            # the delivered copy keeps its DELAY (the level), as RocketMQ's level service leaves it
            assert r["delay_time_level"] == level
            assert r["properties"].get("REAL_TOPIC") == topic and r["properties"].get("DELAY") == str(level)
            late = r["receipt_ms"] - due_floor
            lateness.append((level, late))
            assert late < 3000, f"level {level} arrived {late} ms late"  # a functional bound, not a benchmark
        print("lateness (receipt - (born + delay)) ms:", sorted(lateness))
    finally:
        consumer.stop()


def test_reconsume_later_ladder_then_dlq(
        official_client: str, chronomq_factory: Callable[..., ChronomqProcess], tmp_path: Path) -> None:
    levels = "100ms 200ms 300ms 400ms 500ms 600ms 700ms"
    server = chronomq_factory({"messageDelayLevel": levels, "maxReconsumeTimes": "2"})
    topic, group = "RetryTopic", "CG_retry"
    sent = run_driver("produce", {"namesrv": server.namesrv_addr,
                                  "messages": [{"topic": topic, "body": "R-1", "keys": "r1"}]})
    assert sent["acked"] == 1, sent
    consumer = _consumer(tmp_path, server, group, topic, fail={"mode": "reconsume_later", "times": 100})
    try:
        with RawClient(server.broker_addr) as raw:
            def in_dlq() -> bool:
                try:
                    return raw.max_offset(f"%DLQ%{group}", 0) >= 1
                except RuntimeError:
                    return False

            wait_for(in_dlq, timeout=60, message="the message in %DLQ%CG_retry")
            dead = list(raw.pull_all("CG_dlq_reader", f"%DLQ%{group}", 0))
        deliveries = _deliveries(consumer)
    finally:
        consumer.stop()
    assert [d["reconsume_times"] for d in deliveries] == [0, 1, 2], deliveries
    assert all(not d["consumed"] for d in deliveries)
    assert len({d["id"] for d in deliveries}) == 1  # the same UNIQ_KEY on every delivery
    assert all(d["topic"] == topic for d in deliveries)  # the client maps %RETRY% back
    assert deliveries[1]["properties"].get("RETRY_TOPIC") == topic
    assert deliveries[1]["properties"].get("ORIGIN_MESSAGE_ID")
    # the ladder: 2nd delivery waits level 3 (300 ms) after the 1st, the 3rd waits level 4 (400 ms)
    gaps = [b["receipt_ms"] - a["receipt_ms"] for a, b in itertools.pairwise(deliveries)]
    assert gaps[0] >= 300 and gaps[1] >= 400, gaps
    # broker side: each retry copy was stored (re-put from the schedule queue) no earlier than its level
    stored = [b["store_timestamp"] - a["receipt_ms"] for a, b in itertools.pairwise(deliveries)]
    assert stored[0] >= 300 and stored[1] >= 400, stored
    print("retry gaps ms (receipt to receipt):", gaps, "(receipt to re-put):", stored)
    assert len(dead) == 1
    d = dead[0]
    assert d.body == b"R-1" and d.reconsume_times == 3
    assert d.properties.get("RETRY_TOPIC") == topic
    assert d.properties.get("ORIGIN_MESSAGE_ID") == deliveries[1]["properties"]["ORIGIN_MESSAGE_ID"]
    # and an official pull consumer can read the dead letter
    pulled = run_driver("pull_consume", {"namesrv": server.namesrv_addr, "group": "CG_dlq_pull",
                                         "topic": f"%DLQ%{group}", "expect": 1, "deadline_s": 30})
    assert [m["body_b64"] for m in pulled["messages"]] == ["Ui0x"], pulled
