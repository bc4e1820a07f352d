"""The timer with the official 4.x client (rocketmq==0.4.4): a message sent with TIMER_DELIVER_MS
(or TIMER_DELAY_SEC) set as a user property is parked by the broker and reaches an official push consumer
at that time, not before; the message id the official producer reports cancels it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C
from tests.compat.harness import ChronomqProcess, RawClient, run_driver, start_driver
from tests.conftest import wait_for

pytestmark = [pytest.mark.compat, pytest.mark.timeout(180)]

LATE_BOUND_MS = 3000  # a functional bound on the loaded box, not a benchmark


def _deliveries(d) -> list[dict]:  # type: ignore[no-untyped-def]
    return [r for r in d.records() if "event" not in r]


def test_official_producer_timer_deliver_ms_reaches_push_consumer_at_that_time(
        official_client: str, chronomq_factory: Callable[..., ChronomqProcess], tmp_path: Path) -> None:
    server = chronomq_factory()
    ns = server.namesrv_addr
    topic, group = "TimerCompat", "CG_timer_compat"
    run_driver("produce", {"namesrv": ns, "messages": [{"topic": topic, "body": "warm"}]})
    consumer = start_driver("push_consume", {"namesrv": ns, "group": group, "topic": topic, "deadline_s": 120,
                                             "props": ["TIMER_DELIVER_MS"],
                                             "out": str(tmp_path / "c.jsonl")}, tmp_path)
    try:
        wait_for(lambda: any(r.get("body_b64") == "d2FybQ==" for r in _deliveries(consumer)), timeout=60,
                 message="the push consumer received the warm-up message")
        t0 = int(time.time() * 1000)
        # "at" and "in" must still be pending when the producer's process has exited and the pending list
        # is read, which the C++ client's shutdown can make take seconds on a loaded machine: due 7-8 s on
        at = t0 + 8000
        doomed_at = t0 + 14000
        specs = [
            {"topic": topic, "body": "at", "keys": "k-at", "props": {"TIMER_DELIVER_MS": str(at)}},
            {"topic": topic, "body": "in", "keys": "k-in", "props": {"TIMER_DELAY_SEC": "7"}},
            # cancelled once the producer's process has exited: due well after that
            {"topic": topic, "body": "doomed", "keys": "k-doomed",
             "props": {"TIMER_DELIVER_MS": str(doomed_at)}},
            # due after the others: once it is consumed, a delivered "doomed" would have been too
            {"topic": topic, "body": "barrier", "keys": "k-barrier",
             "props": {"TIMER_DELIVER_MS": str(doomed_at + 500)}},
        ]
        sent = run_driver("produce", {"namesrv": ns, "messages": specs})
        assert sent["acked"] == len(specs), sent
        ids = {specs[r["index"]]["keys"]: r["msg_id"] for r in sent["results"]}
        with RawClient(server.broker_addr) as raw:
            r = raw.call(R.CHRONOMQ_CANCEL_SCHEDULED, {"id": ids["k-doomed"], "byKey": "false"})
            assert r.code == C.SUCCESS, r.remark
            assert [x["outcome"] for x in json.loads(r.body)["results"]] == ["CANCELLED"]
            pending = json.loads(raw.call(R.CHRONOMQ_QUERY_PENDING, {"topic": topic}).body)["items"]
            want = sorted(ids[k] for k in ("k-at", "k-in", "k-barrier"))
            assert sorted(i["msg_id"] for i in pending) == want

        def timed() -> list[dict]:
            return [r for r in _deliveries(consumer) if r["keys"] and r["keys"].startswith("k-")]

        wait_for(lambda: len(timed()) >= 3, timeout=60, message="the three timed messages")
        got = {r["keys"]: r for r in timed()}
        assert sorted(got) == ["k-at", "k-barrier", "k-in"]  # once each, the cancelled one never
        due = {"k-at": at, "k-barrier": doomed_at + 500}
        lateness = {}
        for k, r in got.items():
            assert r["id"] == ids[k]  # the official producer's id survives the timer store
            d = int(r["properties"]["TIMER_DELIVER_MS"])
            if k in due:
                assert d == due[k]
            else:
                assert r["born_timestamp"] + 7000 <= d  # TIMER_DELAY_SEC counted from the broker's arrival
            assert r["store_timestamp"] >= d and r["receipt_ms"] >= d, f"{k} delivered early: {r}"
            assert r["delay_time_level"] == 0
            lateness[k] = r["receipt_ms"] - d
            assert lateness[k] < LATE_BOUND_MS, lateness
        print("official consumer lateness (receipt - TIMER_DELIVER_MS) ms:", lateness)
    finally:
        consumer.stop()
