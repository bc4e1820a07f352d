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
