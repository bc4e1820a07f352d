"""The kill loop's quick mode (bench/chaos.py --quick): 10 SIGKILLs of a loaded SYNC_FLUSH broker, half of
them at fault points, then a clean restart; it exits non-zero when an invariant breaks. Cancels whose
answer a kill cut are asked again after the kills, and every one must get a definite answer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.compat.harness import official_python

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.compat]


def test_chaos_quick_keeps_every_acknowledged_message() -> None:
    official_python()  # skips with the exact reason when the official client cannot run here
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chaos.py"), "--quick"], capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert last.startswith("chaos ok: kills=10 "), last
    figures = dict(f.split("=", 1) for f in last.split() if "=" in f)
    assert int(figures["acknowledged"]) > 1000 and figures["lost"] == "0" and figures["early"] == "0"
    assert figures["cancelled_delivered"] == "0" and int(figures["cancelled"]) > 0
    # every cancel a kill left without an answer got a definite one when asked again, and each is counted
    settled = {} if figures["settled"] == "none" else \
        {k: int(n) for k, n in (x.split(":") for x in figures["settled"].split(","))}
    assert figures["unsettled"] == "0" and sum(settled.values()) == int(figures["undecided"]), last
    # the armed restarts reached the fault points (a roll reached while recovering counts, under its own name)
    reached = next(line for line in proc.stdout.splitlines() if line.startswith("fault points reached: "))
    assert "'commitlog.roll" in reached.split("; not reached")[0], proc.stdout[-2000:]
