"""One tiny end-to-end run of bench/compare against chronomq only (a real ``chronomq start`` on loopback,
driven with chronomq.client): all six workloads produce figures and the report assembles them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from bench.compare import report
from bench.compare.__main__ import run as compare_run
from bench.compare.chronomq_peer import ChronomqPeer
from bench.compare.procs import PeerUnavailable
from bench.compare.runner import WORKLOADS


@pytest.mark.timeout(180)
def test_tiny_run_against_chronomq(tmp_path: Path) -> None:
    try:
        ChronomqPeer(tmp_path / "probe").check()
    except PeerUnavailable as e:
        pytest.skip(f"chronomq client/harness not available yet: {e}")
    logs: list[str] = []
    args = argparse.Namespace(mode="tiny", pending=None, systems="chronomq_async",
                              workloads=",".join(WORKLOADS), workdir=tmp_path, keep=False)
    res = compare_run(args, logs.append)
    cmq = res["systems"]["chronomq_async"]
    assert cmq["status"] == "ok", cmq.get("reason")
    w = cmq["workloads"]
    # the broker was asked whether it honours deliver_at; the bench uses it only if it does
    probe = cmq["system"]["timer_probe"]
    assert cmq["system"]["delay_mode"] == ("deliver_at (timer)" if probe.get("honoured")
                                           else "delay levels (messageDelayLevel)")
    errors = {k: v["error"] for k, v in w.items() if "error" in v}
    assert not errors, (errors, "\n".join(logs))
    plan = res["meta"]["plan"]
    assert w["schedule"]["count"] == plan["schedule_count"] and w["schedule"]["msgs_per_s"] > 0
    assert w["spread"]["received"] == w["spread"]["sent"] == plan["spread_count"]
    assert w["spread"]["early_receipts"] == 0 and w["spread"]["p99_ms"] is not None
    assert w["burst"]["received"] == plan["burst_count"] and w["burst"]["drain_ms"] is not None
    assert w["hol"]["received"] == plan["hol_short_count"]
    # the 1 s messages do not wait behind the long one (separate delay levels)
    assert w["hol"]["max_ms"] < plan["hol_long_ms"] - plan["hol_short_ms"]
    r = w["restart"]
    assert r["received"] + r["lost"] == r["sent"] == plan["restart_count"] and r["restart_s"] > 0
    assert r["early_receipts"] == 0
    assert w["pending"]["pending"] == plan["pending_count"] and w["pending"]["rss_bytes"] > 0
    assert w["pending"]["disk_bytes"] > 0
    # the report: every workload row has a figure in the chronomq column, no peer column, no ratio
    header, rows = report.table_rows(res)
    col = header.index("chronomq ASYNC")
    assert len(header) == 4  # workload, figure, chronomq, ratio
    for row in rows:
        assert row[col] not in ("-", "error"), row
        assert row[col + 1] == "-"  # no peer ran: no ratio
    # everything it started is gone: the temporary data dir was removed after the run
    assert not any(p.name.startswith("chronomq-compare-") for p in tmp_path.iterdir())
