"""A slave promoted after its SYNC_MASTER is SIGKILLed while delayed messages fall due (three processes on
loopback, chronomq.client): every acknowledged one, deliver-at and delay level alike, reaches the consumer
and none before its time; duplicates are counted (the master's last deliveries that had not reached the
slave), not forbidden."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.ha import promotion

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


async def test_a_promoted_slave_delivers_what_its_killed_master_had_pending(tmp_path: Path) -> None:
    r = await promotion(tmp_path, 2000, kill_after_s=1.5, spread_s=6.0, lead_s=5.0)
    assert r["acked"] == 2000, r
    assert r["lost"] == [] and r["early"] == [], {k: r[k] for k in ("lost", "early")}
    assert 0 < r["received_before_kill"] < 2000  # the kill fell among the deliveries
    print(f"promotion: duplicates {r['duplicates']}, promoted in {r['promote_s']:.2f} s")
