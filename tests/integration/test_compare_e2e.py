"""Tiny end-to-end runs of bench/compare: chronomq only (a real ``chronomq start`` on loopback, driven with
chronomq.client): all six workloads produce figures and the report assembles them; and chronomq beside
Apache RocketMQ 5 (from Maven Central jars; skipped with the reason without Java or Maven), both also
driven by the official Java client."""

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
    six = [w for w in WORKLOADS if w != "java"]  # the official Java client's runs: the test below
    args = argparse.Namespace(mode="tiny", pending=None, systems="chronomq_async",
                              workloads=",".join(six), workdir=tmp_path, keep=False)
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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_run_against_rocketmq5_and_the_official_java_client(tmp_path: Path) -> None:
    from bench.compare.rocketmq_peer import RocketMQPeer

    try:
        ChronomqPeer(tmp_path / "probe").check()
        RocketMQPeer(tmp_path / "probe5").check()
    except PeerUnavailable as e:
        pytest.skip(str(e))
    logs: list[str] = []
    args = argparse.Namespace(mode="tiny", pending=None, systems="chronomq_async,rocketmq5_async",
                              workloads="schedule,spread,java", workdir=tmp_path, keep=False)
    res = compare_run(args, logs.append)
    rmq = res["systems"]["rocketmq5_async"]
    assert rmq["status"] == "ok", (rmq.get("reason"), "\n".join(logs))
    # RocketMQ 5 honours TIMER_DELIVER_MS on one message and not in a batch: timed single sends
    probe = rmq["system"]["timer_probe"]
    assert probe["honoured"] and not probe["batch_honoured"], probe
    assert rmq["system"]["delay_mode"] == "deliver_at (timer)"
    assert "one timed message" in rmq["system"]["client"]
    for name in ("chronomq_async", "rocketmq5_async"):
        w = res["systems"][name]["workloads"]
        assert w["startup"]["first_ack_s"] > 0 and w["startup"]["rss_idle_bytes"] > 0, name
        # /proc counts CPU in clock ticks (10 ms): a tiny run's schedule step may take less than one
        cpu = w["schedule"]["cpu_s_per_1k_scheduled"]
        assert isinstance(cpu, float) and cpu >= 0, (name, cpu)
        assert w["spread"]["received"] == res["meta"]["plan"]["spread_count"], (name, w["spread"])
        java = w["java"]
        if "skipped" in java:
            pytest.skip(java["skipped"])
        for mode in ("timed", "levels"):
            assert "error" not in java[mode], (name, mode, java[mode])
            assert java[mode]["received"] == java[mode]["sent"] == res["meta"]["plan"]["java_count"]
    header, _rows = report.table_rows(res)
    assert header[-1] == "chronomq ASYNC / RocketMQ 5.3.3 ASYNC"
    jheader, jrows = report.table_rows(res, java=True)
    assert jheader[2:4] == ["chronomq ASYNC", "RocketMQ 5.3.3 ASYNC"]
    assert all(r[2] not in ("-", "error", "n/a") for r in jrows), jrows
