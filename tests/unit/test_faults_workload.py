"""Fault points (chronomq.store.faults) and the ledger the kill loop and the soak judge by
(bench/workload.py): each check must catch what it is there to catch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from bench.workload import Ledger, make_body, parse_body

from chronomq.store import faults

SRC = Path(__file__).resolve().parents[2] / "src"


def test_fault_spec_is_parsed_strictly() -> None:
    assert faults.parse("") == {}
    assert faults.parse("commitlog.roll=3, atomic.topics.json=1") == {"commitlog.roll": 3,
                                                                     "atomic.topics.json": 1}
    for bad in ("commitlog.roll", "x=0", "x=-1", "=2", "x=two"):
        with pytest.raises(ValueError, match="name=count"):
            faults.parse(bad)


def test_an_armed_point_kills_the_process_on_its_nth_pass_only() -> None:
    code = ("from chronomq.store import faults\n"
            "faults.point('other'); faults.point('here'); print('first pass', flush=True)\n"
            "faults.point('here'); print('survived', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(SRC), faults.ENV: "here=2"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert p.stdout.splitlines() == ["first pass"]
    env.pop(faults.ENV)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and p.stdout.splitlines() == ["first pass", "survived"]


def test_bodies_name_themselves_and_any_damage_shows() -> None:
    body = make_body("ours", 7, "timed", 1_700_000_000_000, 200)
    assert len(body) == 200 and parse_body(body) == ("ours", 7, "timed", 1_700_000_000_000)
    for i in (0, 10, 100, 199):
        damaged = bytearray(body)
        damaged[i] ^= 0x01
        assert parse_body(bytes(damaged)) is None
    assert parse_body(body[:-1]) is None


def test_the_ledger_catches_loss_corruption_early_and_cancelled_deliveries() -> None:
    led = Ledger()
    due = 1_000_000
    good, early, _, cancelled = (make_body("t", i, "timed", due, 64) for i in range(4))
    for mid in ("good", "early", "lost", "cancelled"):
        led.ack(mid, "T", due)
    led.cancel("cancelled")
    assert led.lag(due) == 3
    led.receive("good", "T", 0, 5, good, due + 3)
    led.receive("good", "T", 0, 5, good, due + 9)        # the same copy read again
    led.receive("good", "T", 1, 8, good, due + 9)        # a second stored copy
    led.receive("early", "T", 0, 6, early, due - 1)
    led.receive("cancelled", "T", 2, 1, cancelled, due)
    led.receive("junk", "T", 3, 1, b"not ours", due)
    v = led.verdict()
    assert (v.lost, v.early, v.cancelled_delivered, v.corrupt) == (1, 1, 1, 1)
    assert (v.rereads, v.restored, v.restored_by_kind) == (1, 1, {"timed": 1})
    assert not v.ok and v.examples["lost"] == ["lost"]
    assert led.lag(due) == 1
    only = led.verdict({"good"})
    assert only.ok and only.acknowledged == 1 and only.restored == 1


def test_an_undecided_cancel_is_judged_by_its_answer_when_asked_again() -> None:
    led = Ledger()
    due = 1_000_000
    for mid in ("was-cancelled", "was-delivered", "delivered-not-received", "still-unanswered"):
        led.ack(mid, "T", due)
        led.cancel_undecided(mid)  # a kill cut each cancel's answer
    led.receive("was-delivered", "T", 0, 1, make_body("t", 2, "timed", due, 64), due)
    v = led.verdict()
    assert (v.undecided, v.settled, v.unsettled) == (4, {}, 3) and not v.ok
    led.settle("was-cancelled", "ALREADY_CANCELLED")
    led.settle("was-delivered", "ALREADY_DELIVERED")
    led.settle("delivered-not-received", "ALREADY_DELIVERED")
    v = led.verdict()
    assert v.settled == {"ALREADY_CANCELLED": 1, "ALREADY_DELIVERED": 2} and v.cancelled == 1
    assert (v.unsettled, v.lost, v.examples["lost"]) == (1, 1, ["delivered-not-received"])
    assert v.examples["unsettled"] == ["still-unanswered"]
    led.settle("still-unanswered", "CANCELLED")  # still pending at the second ask: cancelled now
    led.receive("delivered-not-received", "T", 0, 2, make_body("t", 3, "timed", due, 64), due)
    v = led.verdict()
    assert v.ok and (v.undecided, v.unsettled, v.cancelled, v.lost) == (4, 0, 2, 0)
    assert "undecided=4 settled=ALREADY_CANCELLED:1,ALREADY_DELIVERED:2,CANCELLED:1 unsettled=0" in v.line()
    led.receive("was-cancelled", "T", 0, 3, make_body("t", 1, "timed", due, 64), due)
    assert led.verdict().cancelled_delivered == 1  # a cancel that took effect is still held to it


def test_a_reschedule_holds_the_message_to_its_new_time_and_an_undecided_one_to_its_answer() -> None:
    led = Ledger()
    due, later = 1_000_000, 1_002_000
    for mid in ("moved", "cut-moved", "cut-delivered", "cut-unanswered"):
        led.ack(mid, "T", due)
    led.reschedule("moved", later)
    for mid in ("cut-moved", "cut-delivered", "cut-unanswered"):
        led.reschedule_undecided(mid, later)  # a kill cut each reschedule's answer
    assert led.lag(due) == 3  # the moved one is not due yet
    names = ("moved", "cut-moved", "cut-delivered", "cut-unanswered")
    body = {m: make_body("t", i, "timed", due, 64) for i, m in enumerate(names)}  # bodies say the first time
    led.receive("moved", "T", 0, 1, body["moved"], later - 1)  # after its first time, 1 ms before its new one
    led.receive("cut-delivered", "T", 0, 2, body["cut-delivered"], due + 1)
    led.receive("cut-unanswered", "T", 0, 3, body["cut-unanswered"], due + 1)  # its first time bounds it
    led.settle_reschedule("cut-moved", "RESCHEDULED")  # still pending at the second ask: the new time holds
    led.settle_reschedule("cut-delivered", "ALREADY_DELIVERED")
    led.receive("cut-moved", "T", 0, 4, body["cut-moved"], later - 5)
    v = led.verdict()
    assert (v.early, sorted(x.split()[0] for x in v.examples["early"])) == (2, ["cut-moved", "moved"])
    assert "(rescheduled)" in v.examples["early"][0]
    assert (v.rescheduled, v.reschedules_undecided, v.reschedules_settled, v.lost) == (
        2, 3, {"ALREADY_DELIVERED": 1, "RESCHEDULED": 1}, 0)
    assert "rescheduled=2 reschedules_undecided=3 reschedules_settled=ALREADY_DELIVERED:1,RESCHEDULED:1" \
        in v.line()
    on_time = Ledger()
    on_time.ack("m", "T", due)
    on_time.reschedule("m", later)
    on_time.receive("m", "T", 0, 1, make_body("t", 1, "timed", due, 64), later)
    assert on_time.verdict().ok
    missing = Ledger()
    missing.ack("m", "T", due)
    missing.reschedule_undecided("m", later)  # a reschedule never removes the message: no answer, no excuse
    assert missing.verdict().lost == 1


def test_a_send_whose_answer_was_lost_is_neither_lost_nor_a_duplicate_when_delivered() -> None:
    led = Ledger()
    led.ack("acked", "T", 0)
    body = make_body("t", 1, "now", 0, 64)
    led.receive("acked", "T", 0, 1, make_body("t", 0, "now", 0, 64), 5)
    for offset in (2, 3, 3):  # never acknowledged; stored twice (a retry after a cut answer), read again
        led.receive("unanswered", "T", 0, offset, body, 5)
    v = led.verdict()
    assert v.ok and (v.acknowledged, v.received, v.lost, v.unacknowledged) == (1, 1, 0, 1)
    assert (v.rereads, v.restored) == (0, 0)
    led.receive("unanswered-timed", "T", 0, 4, make_body("t", 2, "timed", 1_000, 64), 999)
    v = led.verdict()
    assert (v.unacknowledged, v.early) == (2, 1) and not v.ok  # delivered early all the same
