"""The soak's smoke run (bench/soak.py): 20 seconds of the mixed load, sampled every 4 s; the ledger's
invariants must hold, the broker's heap, files and threads must not grow, and the CSV and plot appear."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_soak_smoke_run_holds_its_invariants(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "soak.py"), "--minutes", "0.34",
                           "--interval", "4", "--rate", "200", "--max-delay", "4", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("soak ok: ") and " lost=0 " in last and " early=0 " in last, last
    rows = list(csv.DictReader(next(tmp_path.glob("soak-*.csv")).open()))
    assert len(rows) >= 4 and int(rows[-1]["acked"]) > 2000
    assert next(tmp_path.glob("soak-*.png")).stat().st_size > 10_000
