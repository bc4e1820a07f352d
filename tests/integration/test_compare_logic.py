"""bench/compare harness logic, cheaply: workload math, lateness/percentiles, receipts bookkeeping,
bounded load loops, the result table/JSON/README assembly and skipping a peer whose binary is missing."""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from bench.compare import procs, report, runner
from bench.compare.__main__ import run as compare_run
from bench.compare.base import Consumer, PayloadFn, Peer, Producer, Sink
from bench.compare.procs import APT_LINE, PeerUnavailable
from bench.compare.rabbit_peer import RabbitPeer
from bench.compare.redis_peer import RedisPeer
from bench.compare.workloads import (
    TINY,
    Recorder,
    lateness_stats,
    lead_ms_for,
    make_payload,
    now_ms,
    parse_payload,
    percentile,
    quantize_to_level,
    spread_dues,
)


# --- workload math -------------------------------------------------------------------------------------
def test_payload_is_exactly_1kib_and_round_trips() -> None:
    body = make_payload("r1", "w2", 12345, 1_700_000_000_123)
    assert len(body) == 1024
    assert parse_payload(body) == ("r1", "w2", 12345, 1_700_000_000_123)
    # incompressible padding, different per message: a compressing store gains nothing from it
    import zlib

    assert len(zlib.compress(body)) > 1000
    assert make_payload("r1", "w2", 12346, 1)[-900:] != body[-900:]
    assert len(make_payload("r", "w", 1, 1, size=40_000)) == 40_000
    assert parse_payload(b"hello|world") is None
    assert parse_payload(b"cmq|r|w|notanint|5|xx") is None
    with pytest.raises(ValueError):
        make_payload("r" * 2000, "w", 1, 1)


def test_spread_dues_cover_the_window_evenly() -> None:
    dues = spread_dues(1000, 5_000, 10_000)
    assert len(dues) == 1000
    assert dues[0] == 5_000 and dues[-1] == 5_000 + 9_990
    assert all(b - a == 10 for a, b in itertools.pairwise(dues))
    assert spread_dues(0, 1, 1) == []
    assert spread_dues(1, 7, 100) == [7]


def test_quantize_picks_the_smallest_level_reaching_the_due_time() -> None:
    levels = [1_000, 2_000, 5_000, 60_000]
    assert quantize_to_level(levels, 10_000, 11_500) == (2, 12_000)
    assert quantize_to_level(levels, 10_000, 12_000) == (2, 12_000)      # exact
    assert quantize_to_level(levels, 10_000, 9_000) == (1, 11_000)       # due in the past: shortest level
    assert quantize_to_level(levels, 10_000, 500_000) == (4, 70_000)     # beyond the table: longest
    assert quantize_to_level([5_000, 1_000], 0, 800) == (2, 1_000)       # table order does not matter
    with pytest.raises(ValueError):
        quantize_to_level([], 0, 1)


def test_lead_time_grows_with_the_load_and_has_a_floor() -> None:
    assert lead_ms_for(10, 100_000) == 2_000
    assert lead_ms_for(100_000, 10_000) == 21_000           # 10 s of loading x2 + 1 s
    assert lead_ms_for(10_000, None) == lead_ms_for(10_000, 2_000.0)


def test_percentiles_are_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile(values, 0) == 1
    assert percentile([7], 99) == 7
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_lateness_stats_count_early_receipts() -> None:
    s = lateness_stats([5, -3, 0, 12, 7, -1])
    assert s["count"] == 6 and s["early"] == 2
    assert s["min_ms"] == -3 and s["max_ms"] == 12 and s["p50_ms"] == 0 and s["p99_ms"] == 12
    assert lateness_stats([])["p50_ms"] is None


def test_recorder_counts_lost_duplicates_early_and_foreign() -> None:
    rec = Recorder("run", "w6")
    sent = {i: 1_000 + i for i in range(5)}
    rec.sink(make_payload("run", "w6", 0, 1_000), 1_010)   # 10 ms late
    rec.sink(make_payload("run", "w6", 1, 1_001), 1_000)   # 1 ms early
    rec.sink(make_payload("run", "w6", 1, 1_001), 1_050)   # duplicate (late)
    rec.sink(make_payload("run", "w6", 2, 1_002), 1_002)   # on time
    rec.sink(make_payload("other", "w6", 3, 1_003), 1_003)  # another run
    rec.sink(b"not ours", 1)
    s = rec.summary(sent)
    assert s["received"] == 3 and s["sent"] == 5 and s["lost"] == 2
    assert s["duplicates"] == 1 and s["early_receipts"] == 1 and s["early"] == 1 and s["foreign"] == 2
    assert s["max_ms"] == 10 and s["min_ms"] == -1
    only = rec.summary(sent, only={0, 3})
    assert only["received"] == 1 and only["lost"] == 1 and only["sent"] == 2


def test_recorder_wait_for_is_woken_by_the_sink() -> None:
    rec = Recorder("r", "w")
    assert rec.wait_for(1, 0) is False  # deadline already passed: returns at once
    t = threading.Thread(target=lambda: [rec.sink(make_payload("r", "w", i, 0), 1) for i in range(3)])
    t.start()
    import time

    assert rec.wait_for({0, 1, 2}, time.monotonic() + 30)
    t.join()
    assert rec.wait_for(3, 0)


@pytest.mark.parametrize("goal", [set(range(1_000)), 1_000])
def test_recorder_wakes_a_waiter_once_not_per_receipt(goal: set[int] | int) -> None:
    """A wait for 100,000 messages must not wake (and rescan) on every receipt: it competed for the GIL
    with the consumer it measures, so lateness grew with the number already received."""
    import time

    rec = Recorder("r", "w")
    wakes: list[object] = []
    real_notify = rec._cond.notify_all
    rec._cond.notify_all = lambda: (wakes.append(1), real_notify())  # type: ignore[method-assign]
    rec.sink(make_payload("r", "w", 0, 0), 1)  # before the wait: already counted
    waiter = threading.Thread(target=lambda: wakes.append(rec.wait_for(goal, time.monotonic() + 30)))
    waiter.start()
    deadline = time.monotonic() + 10
    while rec._missing is None and rec._count_goal is None and time.monotonic() < deadline:
        time.sleep(0.001)  # until the waiter is registered
    for i in range(1, 1_000):
        rec.sink(make_payload("r", "w", i, 0), 1)
    waiter.join(30)
    assert wakes == [1, True]  # one notification, when the last one came


# --- bounded load loops --------------------------------------------------------------------------------
class ListProducer(Producer):
    def __init__(self, quantum: int = 0) -> None:
        self.batches: list[list[tuple[int, int]]] = []
        self.quantum = quantum

    def schedule(self, items: Sequence[tuple[int, int]]) -> list[int]:
        self.batches.append(list(items))
        return [d + self.quantum for _, d in items]


def test_load_is_bounded_by_count_and_batches() -> None:
    p = ListProducer(quantum=7)
    r = runner.load(p, range(10, 35), lambda s: s * 100, batch=10, cap_s=60)
    assert [len(b) for b in p.batches] == [10, 10, 5]
    assert r["sent"] == {s: s * 100 + 7 for s in range(10, 35)}
    assert r["capped"] is False


def test_load_stops_at_its_time_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(range(0, 10_000, 10))  # a fake monotonic clock: +10 s per reading
    monkeypatch.setattr(runner.time, "monotonic", lambda: next(ticks))
    p = ListProducer()
    r = runner.load(p, range(1_000_000), lambda s: s, batch=100, cap_s=25)
    assert r["capped"] is True
    # readings: t0=0, then 10 and 20 (under the 25 s cap: a batch each), then 30: stop
    assert len(p.batches) == 2 and len(r["sent"]) == 200


# --- the runner against an in-memory delay server ------------------------------------------------------
class MemoryServer:
    """Delivers each message to the destination's sinks at its due time (a heap and one thread).
    ``kill9`` can drop or duplicate pending messages to check the restart bookkeeping."""

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, str, bytes]] = []
        self.sinks: dict[str, list[Sink]] = {}
        self.cond = threading.Condition()
        self.n = 0
        self.stopped = False
        self.lose_on_kill = 0
        self.dup_on_kill = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, dest: str, due: int, body: bytes) -> None:
        with self.cond:
            self.n += 1
            heapq.heappush(self.heap, (due, self.n, dest, body))
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.stopped and (not self.heap or self.heap[0][0] > now_ms()):
                    wait = (self.heap[0][0] - now_ms()) / 1000 if self.heap else 1.0
                    self.cond.wait(max(0.001, min(wait, 1.0)))
                if self.stopped:
                    return
                _due, _, dest, body = heapq.heappop(self.heap)
                sinks = list(self.sinks.get(dest, []))
            for s in sinks:
                s(body, now_ms())

    def kill(self, dest_suffix: str) -> None:
        """Lose the ``lose_on_kill`` latest pending messages of the destination, duplicate the
        ``dup_on_kill`` earliest ones."""
        with self.cond:
            mine = sorted(e for e in self.heap if e[2].endswith(dest_suffix))
            lost = set(mine[len(mine) - self.lose_on_kill:]) if self.lose_on_kill else set()
            self.heap = [e for e in self.heap if e not in lost]
            for due, _n, dest, body in mine[: self.dup_on_kill]:
                self.n += 1
                self.heap.append((due, self.n, dest, body))
            heapq.heapify(self.heap)

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join(10)


class MemProducer(Producer):
    def __init__(self, server: MemoryServer, dest: str, payload: PayloadFn) -> None:
        self.server, self.dest, self.payload = server, dest, payload

    def schedule(self, items: Sequence[tuple[int, int]]) -> list[int]:
        for seq, due in items:
            self.server.put(self.dest, due, self.payload(seq, due))
        return [d for _, d in items]


class MemConsumer(Consumer):
    def __init__(self, server: MemoryServer, dest: str, sink: Sink) -> None:
        self.server, self.dest, self.sink = server, dest, sink
        with server.cond:
            server.sinks.setdefault(dest, []).append(sink)

    def close(self) -> None:
        with self.server.cond:
            self.server.sinks[self.dest].remove(self.sink)


class MemPeer(Peer):
    name = "redis"  # stands in for a peer column in the report
    label = "memory"
    durability = "none"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.server: MemoryServer | None = None
        self.events: list[str] = []

    def check(self) -> None:
        pass

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "blob").write_bytes(b"x" * 10_000)
        self.server = MemoryServer()
        self.server.lose_on_kill, self.server.dup_on_kill = 3, 2
        self.events.append("start")

    def stop(self) -> None:
        assert self.server is not None
        self.server.stop()
        self.events.append("stop")

    def kill9(self) -> None:
        assert self.server is not None
        self.server.kill("_w6")
        self.events.append("kill9")

    def restart(self) -> None:
        self.events.append("restart")

    def server_pids(self) -> list[int]:
        import os

        return [os.getpid()]

    def settle(self, timeout_s: float) -> dict[str, Any]:
        self.events.append("settle")
        return {"settled_within_s": timeout_s}

    def producer(self, dest: str, payload: PayloadFn) -> Producer:
        assert self.server is not None
        return MemProducer(self.server, dest, payload)

    def consumer(self, dest: str, sink: Sink) -> Consumer:
        assert self.server is not None
        return MemConsumer(self.server, dest, sink)


def test_run_system_measures_all_six_workloads(tmp_path: Path) -> None:
    import dataclasses

    plan = dataclasses.replace(TINY, spread_window_ms=300, hol_long_ms=1_500, hol_short_ms=100,
                               restart_window_ms=200, grace_ms=3_000, schedule_count=200, pending_count=350)
    peer = MemPeer(tmp_path / "mem")
    logs: list[str] = []
    res = runner.run_system(peer, plan, "t1", logs.append)
    assert peer.events == ["start", "kill9", "restart", "settle", "stop"]  # settled before RSS/disk
    w = res["workloads"]
    assert set(w) == {*runner.WORKLOADS, "startup"}
    assert all("error" not in v for v in w.values()), w
    # start-up: process start to the first acknowledged send, and the idle RSS of the process tree
    assert w["startup"]["first_ack_s"] >= res["start_s"] and w["startup"]["attempts"] == 1
    assert w["startup"]["rss_idle_bytes"] > 0
    # the official Java client drives RocketMQ-protocol brokers only
    assert "n/a" in w["java"]["na"]
    assert w["schedule"]["count"] == 200 and w["schedule"]["msgs_per_s"] > 0
    # server CPU from /proc (here the test process itself: it is the "server")
    assert w["schedule"]["cpu_s_per_1k_scheduled"] >= 0 and w["spread"]["cpu_s_per_1k_delivered"] >= 0
    assert w["spread"]["received"] == plan.spread_count and w["spread"]["lost"] == 0
    assert w["spread"]["early_receipts"] == 0 and w["spread"]["p99_ms"] is not None
    assert w["burst"]["received"] == plan.burst_count and w["burst"]["drain_ms"] >= 0
    assert w["hol"]["received"] == plan.hol_short_count and w["hol"]["max_ms"] < 1_400  # no HOL in memory
    # kill -9 dropped 3 pending messages and duplicated 2
    assert w["restart"]["lost"] == 3 and w["restart"]["duplicates"] == 2
    assert w["pending"]["pending"] == 350 and w["pending"]["disk_bytes"] >= 10_000
    assert w["pending"]["rss_bytes"] > 0 and w["pending"]["settled_within_s"] >= plan.settle_s



# --- several rounds ------------------------------------------------------------------------------------
def test_rounds_give_each_figure_its_median_and_the_worst_loss() -> None:
    merged = runner.merge_workload([
        {"p50_ms": 9, "max_ms": 30.0, "lost": 0, "early_receipts": 0, "complete": True, "capped": False,
         "java": {"p50_ms": 1}},
        {"p50_ms": 5, "max_ms": 10.0, "lost": 2, "early_receipts": 0, "complete": False, "capped": False,
         "java": {"p50_ms": 3}},
        {"error": "boom"},  # a failed round: left out of the medians, its error kept
        {"p50_ms": 7, "max_ms": 20.0, "lost": 0, "early_receipts": 1, "complete": True, "capped": True,
         "java": {"p50_ms": 2}},
    ])
    assert merged["p50_ms"] == 7 and merged["max_ms"] == 20.0
    assert merged["lost"] == 2 and merged["early_receipts"] == 1  # the worst round's, not a median of 0
    assert merged["complete"] is False and merged["capped"] is True
    assert merged["java"]["p50_ms"] == 2
    assert merged["per_round"]["p50_ms"] == [9, 5, 7] and merged["rounds_ok"] == 3
    assert merged["round_errors"] == ["round 3: boom"]
    assert runner.merge_workload([{"na": "n/a"}, {"na": "n/a"}]) == {"na": "n/a"}
    one = {"status": "ok", "workloads": {"hol": {"p50_ms": 4}}}
    assert runner.merge_rounds([one]) is one


def test_rounds_run_the_systems_in_turns_and_report_medians(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.compare import __main__ as cli

    order: list[str] = []
    rates = {"redis": iter([100.0, 300.0, 200.0]), "chronomq_async": iter([50.0, 10.0, 30.0])}

    def fake_run_system(peer: Peer, plan: Any, run: str, log: Any, only: Any, *cpus: Any) -> dict[str, Any]:
        order.append(f"{peer.name}:{peer.workdir.name}")
        assert not peer.workdir.exists() or peer.workdir.is_dir()
        return {"status": "ok", "system": peer.describe(), "total_s": 1.0, "start_s": 0.5,
                "workloads": {"schedule": {"msgs_per_s": next(rates[peer.name]), "lost": 0}}}

    def mem(name: str) -> Any:
        def make(d: Path) -> Peer:
            p = MemPeer(d)
            p.name = name
            return p
        return make

    monkeypatch.setattr(cli, "run_system", fake_run_system)
    monkeypatch.setitem(cli.SYSTEMS, "redis", mem("redis"))
    monkeypatch.setitem(cli.SYSTEMS, "chronomq_async", mem("chronomq_async"))
    args = argparse.Namespace(mode="tiny", pending=None, systems="chronomq_async,redis", workloads="schedule",
                              workdir=tmp_path, keep=False, rounds=3)
    res = compare_run(args, lambda _line: None)
    assert order == ["chronomq_async:chronomq_async", "redis:redis", "chronomq_async:chronomq_async.r2",
                     "redis:redis.r2", "chronomq_async:chronomq_async.r3", "redis:redis.r3"]
    assert res["meta"]["rounds"] == 3 and list(res["systems"]) == ["chronomq_async", "redis"]
    cmq, red = res["systems"]["chronomq_async"], res["systems"]["redis"]
    assert red["workloads"]["schedule"]["msgs_per_s"] == 200.0 and len(red["rounds"]) == 3
    assert cmq["workloads"]["schedule"]["per_round"]["msgs_per_s"] == [50.0, 10.0, 30.0]
    assert cmq["total_s"] == 3.0
    assert "median of 3 rounds" in report.readme_section(res)
    with pytest.raises(SystemExit, match="at least 1"):
        compare_run(argparse.Namespace(**{**vars(args), "rounds": 0}), lambda _line: None)

# --- report assembly -----------------------------------------------------------------------------------
def _results() -> dict[str, Any]:
    def sys_(name: str, label: str, **wl: dict[str, Any]) -> dict[str, Any]:
        return {"status": "ok", "system": {"name": name, "label": label, "durability": "d", "client": "c"},
                "workloads": wl}

    return {
        "meta": {"run": "r", "mode": "quick", "plan": TINY.to_dict(), "started": "now", "elapsed_s": 12.0,
                 "machine": {"cpus": 2, "cpu_model": "cpu", "mem_gib": 1, "os": "linux", "python": "3.11"}},
        "systems": {
            "chronomq_async": sys_("chronomq_async", "cmq A", schedule={"msgs_per_s": 500.0},
                                   spread={"p50_ms": 30, "lost": 0, "early_receipts": 0,
                                           "loaded_before_first_due": False},
                                   restart={"lost": 0, "duplicates": 4}),
            "chronomq_sync": {"status": "ok", "system": {"label": "cmq S"},
                              "workloads": {"schedule": {"error": "boom"}}},
            "redis": sys_("redis", "Redis", schedule={"msgs_per_s": 1000.0},
                          spread={"p50_ms": 10, "lost": 0, "early_receipts": 0}, restart={"lost": 2,
                                                                                          "duplicates": 0}),
            "rabbitmq": sys_("rabbitmq", "Rabbit", schedule={"msgs_per_s": 250.0},
                             spread={"p50_ms": 60, "lost": 0, "early_receipts": 0},
                             restart={"lost": 0, "duplicates": 1}),
        },
    }


def _metric(workload: str, field: str) -> report.Metric:
    return next(m for m in report.metrics(TINY.to_dict()) if (m.workload, m.field) == (workload, field))


def test_ratio_is_against_the_best_peer_in_the_right_direction() -> None:
    res = _results()
    rate = _metric("schedule", "msgs_per_s")
    assert report.best_peer(res, rate) == ("redis", 1000.0)             # higher is better: max
    assert report.best_peer(res, _metric("spread", "p50_ms")) == ("redis", 10.0)  # lower: min
    assert report.best_peer(res, _metric("restart", "lost")) == ("rabbitmq", 0.0)
    assert report.ratio(500.0, 1000.0) == 0.5
    assert report.ratio(0, 0) == 1.0 and math.isinf(report.ratio(4, 0) or 0)
    assert report.ratio(None, 3) is None and report.ratio(3, None) is None


def test_table_has_a_row_per_figure_and_all_six_workloads() -> None:
    header, rows = report.table_rows(_results())
    assert header[:2] == ["workload", "figure"]
    assert header[2:6] == ["cmq A", "cmq S", "Redis", "Rabbit"]
    assert header[6:] == ["cmq A / best peer", "cmq S / best peer"]
    groups = [r[0] for r in rows if r[0]]
    assert [g[0] for g in groups] == ["0", "1", "2", "3", "4", "5", "6"]
    by_figure = {(r[1], i): r for i, r in enumerate(rows)}
    sched = next(r for r in rows if r[1] == "msgs/s")
    assert sched[2:6] == ["500", "error", "1,000", "250"] and sched[6] == "x0.50 ↑" and sched[7] == "-"
    p50 = next(r for (f, _), r in by_figure.items() if f == "lateness p50")
    assert p50[2] == "30 ms *" and p50[6] == "x3.00 ↓"  # * : its load overran the first due time
    assert p50[4] == "10 ms"
    dups = next(r for r in rows if r[1] == "duplicates")
    assert dups[6] == "peer 0"  # the best peer (redis) had none: no finite ratio
    lost = next(r for r in rows if r[1] == "lost")
    assert lost[2] == "0" and lost[6] == "x1.00 ↓"  # both zero
    missing = next(r for r in rows if r[1] == "server RSS")
    assert missing[2:6] == ["-", "-", "-", "-"] and missing[6] == "-"


def test_a_load_cut_by_its_time_cap_shows_how_far_it_got() -> None:
    res = _results()
    res["systems"]["redis"]["workloads"]["pending"] = {"rss_bytes": 3 << 30, "pending": 4_321_000,
                                                       "capped": True}
    res["systems"]["rabbitmq"]["workloads"]["pending"] = {"rss_bytes": 1 << 30, "pending": 10_000,
                                                          "capped": False}
    _header, rows = report.table_rows(res)
    rss = next(r for r in rows if r[1] == "server RSS")
    assert rss[4] == "3.0 GiB † 4,321,000" and rss[5] == "1.0 GiB"
    assert "† N: the load hit its time cap" in report.footer_lines(res)[0]


def test_skipped_system_shows_its_status_and_reason() -> None:
    res = _results()
    res["systems"]["rabbitmq"] = {"status": "skipped", "reason": f"install with {APT_LINE}",
                                  "system": {"label": "Rabbit"}}
    _header, rows = report.table_rows(res)
    sched = next(r for r in rows if r[1] == "msgs/s")
    assert sched[5] == "skipped" and sched[6] == "x0.50 ↑"  # best peer is now redis only
    text = report.render_rich(res)
    assert "skipped" in text and APT_LINE in text


def test_json_readme_and_chart_are_written(tmp_path: Path) -> None:
    res = _results()
    path = report.write_json(res, tmp_path / "out" / "r.json")
    assert json.loads(path.read_text())["systems"]["redis"]["workloads"]["schedule"]["msgs_per_s"] == 1000.0
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\nintro\n")
    report.update_readme(readme, res)
    report.update_readme(readme, res)  # replaces its own section, does not append a second one
    text = readme.read_text()
    assert text.startswith("# title\n\nintro\n")
    assert text.count(report.README_START) == 1 and "tiny-mode" in text and "| workload | figure |" in text
    pytest.importorskip("matplotlib")
    png = report.write_chart(res, tmp_path / "out" / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plain_table_when_rich_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    text = report.plain_table(["a", "bb"], [["1", "2"], ["333", ""]])
    assert text.splitlines()[0].startswith("a    bb") and "333" in text

    def no_rich(name: str, what: str) -> Any:
        raise PeerUnavailable(f"the Python package {name!r} ({what}) is not installed")

    monkeypatch.setattr(report, "need_module", no_rich)
    res = _results()
    res["systems"]["rabbitmq"] = {"status": "skipped", "reason": APT_LINE, "system": {"label": "Rabbit"}}
    out = report.render_rich(res)
    assert out.startswith("workload") and "1 schedule" in out and APT_LINE in out and "ratio =" in out


# --- peers that cannot run are skipped with the install line ------------------------------------------
def test_missing_binaries_skip_the_peer_with_the_apt_line(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    monkeypatch.setattr(procs, "find_binary", lambda name, extra_dirs=(): None)
    for cls in (RedisPeer, RabbitPeer):
        with pytest.raises(PeerUnavailable, match="apt-get install -y redis-server rabbitmq-server"):
            cls(tmp_path).check()
    logs: list[str] = []
    args = argparse.Namespace(mode="tiny", pending=None, systems="redis,rabbitmq", workloads="schedule",
                              workdir=tmp_path, keep=False)
    res = compare_run(args, logs.append)
    assert {s: r["status"] for s, r in res["systems"].items()} == {"redis": "skipped", "rabbitmq": "skipped"}
    assert sum(APT_LINE in line for line in logs) >= 2
    assert not any(p.name.startswith("chronomq-compare-") for p in tmp_path.iterdir())  # temp dir removed


def test_missing_python_client_says_what_to_pip_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from bench.compare import base

    real_import = builtins.__import__

    def fake_import(name: str, *a: Any, **k: Any) -> Any:
        if name == "pika":
            raise ImportError("No module named 'pika'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.delitem(__import__("sys").modules, "pika", raising=False)
    with pytest.raises(PeerUnavailable, match="pip install"):
        base.need_module("pika", "pika")


def test_chronomq_timed_messages_go_in_batches_in_order_and_levels_stay_single() -> None:
    import asyncio

    from bench.compare.chronomq_peer import BATCH_SIZE, ChronomqProducer

    import chronomq.client as client

    class FakeAsyncProducer:
        def __init__(self) -> None:
            self.batches: list[list[Any]] = []
            self.singles: list[Any] = []

        async def send_batch(self, msgs: list[Any]) -> None:
            await asyncio.sleep(0)
            self.batches.append(msgs)

        async def send(self, msg: Any) -> None:
            self.singles.append(msg)

    def producer(levels: list[int] | None) -> tuple[ChronomqProducer, FakeAsyncProducer]:
        p = object.__new__(ChronomqProducer)
        fake = FakeAsyncProducer()
        p.client, p.topic, p.levels_ms, p.producer = client, "T", levels, fake
        p.payload = lambda seq, due: make_payload("r", "w", seq, due)
        return p, fake

    p, fake = producer(None)
    due0 = now_ms() + 60_000
    items = [(i, due0 + i) for i in range(2 * BATCH_SIZE + 7)]
    dues = asyncio.run(p._send_all(items))
    assert dues == [d for _s, d in items]
    assert [len(b) for b in fake.batches] == [BATCH_SIZE, BATCH_SIZE, 7] and not fake.singles
    sent = [m for b in fake.batches for m in b]
    assert [m.deliver_at for m in sent] == dues
    assert [parse_payload(m.body)[2] for m in sent] == list(range(len(items)))

    levels = [1_000, 5_000, 120_000]
    p, fake = producer(levels)
    wanted = [(0, now_ms() + 3_000), (1, now_ms() + 100_000)]
    dues = asyncio.run(p._send_all(wanted))
    assert not fake.batches and len(fake.singles) == 2  # RocketMQ refuses delay levels in a batch
    assert [m.delay_level for m in fake.singles] == [2, 3]
    assert all(real >= want for real, (_s, want) in zip(dues, wanted, strict=True))  # never earlier


# --- Apache RocketMQ as a peer, the start-up and CPU figures, the official Java client's table ---------
def _with_rocketmq() -> dict[str, Any]:
    res = _results()
    res["systems"]["chronomq_sync"] = {"status": "ok", "system": {"label": "cmq S"}, "workloads": {
        "schedule": {"msgs_per_s": 300.0, "cpu_s_per_1k_scheduled": 0.05},
        "java": {"jvm": "-Xmx256m", "client": "rocketmq-client 4.9.8, 4.x API",
                 "timed": {"msgs_per_s": 900.0, "p99_ms": 4, "early_receipts": 0, "lost": 0},
                 "levels": {"msgs_per_s": 800.0, "p99_ms": 30}}}}
    res["systems"]["chronomq_async"]["workloads"]["startup"] = {"first_ack_s": 1.0,
                                                                "rss_idle_bytes": 50 << 20}
    res["systems"]["rocketmq5_sync"] = {"status": "ok", "system": {"label": "RMQ5 S"}, "workloads": {
        "startup": {"first_ack_s": 30.0, "rss_idle_bytes": 500 << 20},
        "schedule": {"msgs_per_s": 200.0, "cpu_s_per_1k_scheduled": 0.5},
        "java": {"jvm": "-Xmx256m", "client": "rocketmq-client 4.9.8, 4.x API",
                 "timed": {"msgs_per_s": 600.0, "p99_ms": 120, "early_receipts": 3, "lost": 0},
                 "levels": {"error": "boom"}}}}
    res["systems"]["rocketmq4"] = {"status": "ok", "system": {"label": "RMQ4"}, "workloads": {
        "schedule": {"msgs_per_s": 400.0},
        "java": {"jvm": "-Xmx256m", "timed": {"na": "n/a: no timer"}, "levels": {"msgs_per_s": 700.0}}}}
    res["systems"]["redis"]["workloads"]["java"] = {"na": "n/a: RocketMQ protocol only"}
    return res


def test_rocketmq_columns_and_the_ratio_to_rocketmq5_in_the_same_flush_mode() -> None:
    res = _with_rocketmq()
    header, rows = report.table_rows(res)
    assert header[2:9] == ["cmq A", "cmq S", "Redis", "Rabbit", "RMQ5 S", "RMQ4", "cmq A / best peer"]
    assert header[9:] == ["cmq S / best peer", "cmq S / RMQ5 S"]  # no RocketMQ 5 ASYNC ran: no pair
    sched = next(r for r in rows if r[1] == "msgs/s")
    assert sched[6:8] == ["200", "400"] and sched[10] == "x1.50 ↑"  # 300 / 200
    assert sched[8] == "x0.50 ↑"  # best peer is still Redis (1,000)
    cpu = next(r for r in rows if r[1] == "server CPU per 1,000 scheduled")
    assert cpu[3] == "0.050 s" and cpu[6] == "0.500 s" and cpu[10] == "x0.10 ↓"
    first = next(r for r in rows if r[1] == "process start to first acknowledged send")
    assert first[0] == "0 start" and first[2] == "1.0 s" and first[6] == "30.0 s"
    idle = next(r for r in rows if r[1] == "server RSS idle")
    assert idle[2] == "50.0 MiB" and idle[6] == "500.0 MiB"


def test_java_table_has_the_remoting_brokers_and_says_n_a_where_a_figure_does_not_apply() -> None:
    res = _with_rocketmq()
    assert report.has_java(res)
    header, rows = report.table_rows(res, java=True)
    assert header[2:] == ["cmq A", "cmq S", "RMQ5 S", "RMQ4", "cmq S / RMQ5 S"]  # no Redis/RabbitMQ
    timed_rate = rows[0]
    assert timed_rate[0].startswith("timed (TIMER_DELIVER_MS)") and timed_rate[1] == "schedule msgs/s"
    assert timed_rate[2:] == ["-", "900", "600", "n/a", "x1.50 ↑"]  # 4.9.7 has no timer
    early = next(r for r in rows if r[1] == "early deliveries")
    assert early[4] == "3"
    levels_rate = next(r for r in rows if r[0].startswith("delay levels"))
    assert levels_rate[3:6] == ["800", "error", "700"]
    md = report.readme_section(res)
    assert "official Java client" in md and "JVM -Xmx256m" in md
    res["systems"]["chronomq_sync"]["workloads"]["java"] = {"skipped": "java not on PATH"}
    res["systems"]["rocketmq5_sync"]["workloads"]["java"] = {"skipped": "java not on PATH"}
    res["systems"]["rocketmq4"]["workloads"]["java"] = {"skipped": "java not on PATH"}
    assert not report.has_java(res)
    _h, rows = report.table_rows(res, java=True)
    assert rows[0][3:6] == ["skipped", "skipped", "skipped"]
    assert any("skipped: java not on PATH" in line for line in report.java_footer(res))


def test_rocketmq_systems_are_named_like_chronomqs_modes(tmp_path: Path) -> None:
    from bench.compare.__main__ import SYSTEMS

    peers = {k: SYSTEMS[k](tmp_path) for k in ("rocketmq5_async", "rocketmq5_sync", "rocketmq4")}
    assert {k: p.name for k, p in peers.items()} == {k: k for k in peers}
    assert "timerPrecisionMs=100" in peers["rocketmq5_sync"].durability
    assert "flushDiskType=SYNC_FLUSH" in peers["rocketmq5_sync"].durability
    assert all("-Xmx1g" in p.durability for p in peers.values())
    assert "delay levels only" in peers["rocketmq4"].durability
    assert report.ROCKETMQ_PAIR == {"chronomq_async": "rocketmq5_async", "chronomq_sync": "rocketmq5_sync"}


def test_missing_java_skips_rocketmq_with_the_exact_reason(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    from bench.compare.rocketmq_peer import RocketMQPeer

    import tests.compat.reference as reference

    monkeypatch.setattr(reference.shutil, "which", lambda name: None)
    with pytest.raises(PeerUnavailable, match="need java \\(17\\) on PATH: not found"):
        RocketMQPeer(tmp_path, "rocketmq5").check()
    logs: list[str] = []
    args = argparse.Namespace(mode="tiny", pending=None, systems="rocketmq5_async,rocketmq4",
                              workloads="schedule", workdir=tmp_path, keep=False)
    res = compare_run(args, logs.append)
    assert {s: r["status"] for s, r in res["systems"].items()} == {"rocketmq5_async": "skipped",
                                                                   "rocketmq4": "skipped"}
    assert all("java (17) on PATH" in r["reason"] for r in res["systems"].values())


def test_java_runs_are_described_to_the_driver_and_summarized() -> None:
    from bench.compare import java_bench

    a = java_bench.produce_args("ns:1", "T", "g", "cmq|r|java-timed|", 100, "timed", 5_000, 10_000, None,
                                60, 1024)
    assert a["op"] == "bench_produce" and a["leadMs"] == 5_000 and a["capMs"] == 60_000
    assert "levelsMs" not in a and a["window"] == java_bench.WINDOW
    table = list(range(1000, 49_000, 1000))
    lv = java_bench.produce_args("ns:1", "T", "g", "p", 100, "levels", 0, 10_000, table, 60, 1024)
    assert lv["levelsMs"] == [1000 * i for i in range(1, 11)]
    with pytest.raises(ValueError):
        java_bench.produce_args("ns:1", "T", "g", "p", 100, "levels", 0, 10_000, None, 60, 1024)
    c = java_bench.consume_args("ns:1", "T", "g", "p", 100, 90, Path("/tmp/x.ready"))
    assert c["op"] == "bench_consume" and c["expect"] == 100 and c["readyFile"] == "/tmp/x.ready"
    assert java_bench.java_lead_ms(200) == 5_000 and java_bench.java_lead_ms(100_000) == 101_000
    assert java_bench.last_json('log line\n{"a": 1}\n{"ok": 2}\n') == {"ok": 2}
    with pytest.raises(RuntimeError):
        java_bench.last_json("no json\n")
    s = java_bench.summarize({"ok": 98, "failed": 2, "msgsPerS": 1234.5, "elapsedMs": 80,
                              "firstDueMs": 100, "lastAckMs": 90},
                             {"received": 97, "duplicates": 1, "early": 0, "p50Ms": 3, "p99Ms": 9,
                              "maxMs": 12})
    assert s["lost"] == 1 and s["failed"] == 2 and s["msgs_per_s"] == 1234.5 and s["p99_ms"] == 9
    assert s["loaded_before_first_due"] is True and s["load_elapsed_s"] == 0.08
    # levels: each message is due from its own send, the load always overlaps delivery: no "*"
    assert "loaded_before_first_due" not in java_bench.summarize({"ok": 1, "firstDueMs": 5, "lastAckMs": 9},
                                                                 {"received": 1}, timed=False)


def test_java_driver_runs_with_full_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.compare import java_bench

    jvm = pytest.importorskip("tests.compat.jvm")
    monkeypatch.setattr(jvm, "java_driver", lambda client: ["java", "-Xmx256m", "-XX:TieredStopAtLevel=1",
                                                            "-cp", "x", "chronomq.compat.Driver"])
    cmd = java_bench.jvm_command()
    assert "-XX:TieredStopAtLevel=1" not in cmd and cmd[-1] == "chronomq.compat.Driver"
    assert java_bench.jvm_flags(cmd) == "-Xmx256m"


def test_first_ack_retries_until_the_server_answers(tmp_path: Path) -> None:
    import dataclasses

    class Flaky(MemPeer):
        fails = 2

        def producer(self, dest: str, payload: PayloadFn) -> Producer:
            if self.fails:
                self.fails -= 1
                raise ConnectionError("not yet")
            return super().producer(dest, payload)

    peer = Flaky(tmp_path / "m")
    peer.start()
    try:
        ctx = runner.Ctx(peer, dataclasses.replace(TINY), "r", lambda _m: None)
        out = runner.first_ack(ctx, 0.0)
        assert out["attempts"] == 3 and out["first_ack_s"] > 0
        peer.fails = 10**6
        bad = runner.first_ack(ctx, 0.0, timeout_s=0.3)
        assert "no acknowledged send" in bad["error"]
    finally:
        peer.stop()


def test_tree_cpu_counts_the_process_and_its_children() -> None:
    import os
    import subprocess
    import sys

    # the child burns 0.3 s of CPU, says so, then sleeps: on a busy machine that may take seconds of wall time
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\nprint('burnt', flush=True)\n"
                              "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "burnt\n"
        assert procs.tree_cpu_s([os.getpid()]) >= 0.25
        assert procs.tree_cpu_s([child.pid]) >= 0.25
    finally:
        child.kill()
        child.wait()


def test_timed_messages_go_one_per_request_when_the_broker_ignores_the_timer_in_batches() -> None:
    import asyncio

    from bench.compare.chronomq_peer import ChronomqProducer

    import chronomq.client as client

    sent: list[Any] = []

    class Fake:
        async def send(self, msg: Any) -> None:
            sent.append(msg)

        async def send_batch(self, msgs: list[Any]) -> None:
            raise AssertionError("no batch")

    p = object.__new__(ChronomqProducer)
    p.client, p.topic, p.levels_ms, p.producer, p.batch_timed = client, "T", None, Fake(), False
    p.payload = lambda seq, due: make_payload("r", "w", seq, due)
    due0 = now_ms() + 60_000
    dues = asyncio.run(p._send_all([(i, due0 + i) for i in range(5)]))
    assert dues == [due0 + i for i in range(5)]
    assert sorted(m.deliver_at for m in sent) == dues and all(not m.delay_level for m in sent)


def test_targets_against_rocketmq5_say_met_or_missed_and_by_how_much() -> None:
    res = _with_rocketmq()
    sync = res["systems"]["chronomq_sync"]["workloads"]
    rmq = res["systems"]["rocketmq5_sync"]["workloads"]
    sync.update(startup={"first_ack_s": 2.0, "rss_idle_bytes": 200 << 20}, spread={"p99_ms": 5},
                restart={"lost": 0, "duplicates": 0, "early_receipts": 0, "restart_s": 3.0})
    rmq.update(spread={"p99_ms": 100},
               restart={"lost": 0, "duplicates": 1, "early_receipts": 7, "restart_s": 6.0})

    def cell(wl: str, field: str, bound: float, direction: str) -> tuple[str, bool | None]:
        return report.target_cell(res, "chronomq_sync", "rocketmq5_sync", wl, field, bound, direction)

    assert cell("schedule", "msgs_per_s", 1.0, ">=") == ("300 vs 200: x1.50 (>= x1.00): met", True)
    assert cell("spread", "p99_ms", 0.1, "<=")[1] is True
    text, met = cell("startup", "rss_idle_bytes", 0.2, "<=")
    assert not met and text == "200.0 MiB vs 500.0 MiB: x0.40 (<= x0.20): missed by 100%"
    text, met = cell("restart", "restart_s", 1 / 3, "<=")
    assert not met and "missed by 50%" in text  # x0.50 against x0.33
    assert cell("hol", "p50_ms", 1.0, "<=") == ("-", None)
    assert report.kill9_cell(res, "chronomq_sync", "rocketmq5_sync") == \
        ("0/0/0 (RocketMQ 5: 0/1/7): met", True)
    md = report.targets_markdown(res)
    assert md is not None and md.splitlines()[0] == "| target | cmq S vs RMQ5 S |"
    assert len(md.splitlines()) == 2 + len(report.TARGETS) + 1
    assert "The targets against Apache RocketMQ 5" in report.readme_section(res)
    assert report.targets_markdown(_results()) is None  # no RocketMQ 5 ran


def test_rocketmq_clients_are_made_again_while_the_name_server_has_no_route(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch
                                                                            ) -> None:
    from bench.compare import rocketmq_peer

    monkeypatch.setattr(rocketmq_peer.time, "sleep", lambda s: None)
    peer = rocketmq_peer.RocketMQPeer(tmp_path, "rocketmq5", "SYNC_FLUSH")
    calls = iter([RuntimeError("no route for topic 'TBW102': the name server does not know it"),
                  RuntimeError("No route info of this topic"), "client"])

    def make() -> str:
        c = next(calls)
        if isinstance(c, Exception):
            raise c
        return c

    assert peer._routed(make) == "client" and peer.route_retries == 2
    with pytest.raises(ValueError):  # anything else is not retried
        peer._routed(lambda: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(RuntimeError):  # bounded
        peer._routed(lambda: (_ for _ in ()).throw(RuntimeError("no route")), timeout_s=0)
    assert peer.describe()["route_retries"] == 2  # the bounded one gave up at once


def test_count_overrides_rename_the_plan_and_refuse_bad_input() -> None:
    from bench.compare.__main__ import with_counts
    from bench.compare.workloads import FULL

    plan = with_counts(FULL, ["schedule_count=200_000", "pending_count=500000"])
    assert (plan.schedule_count, plan.pending_count, plan.burst_count) == (200_000, 500_000, FULL.burst_count)
    assert plan.mode == "full (pending_count=500,000, schedule_count=200,000)"
    assert with_counts(FULL, [f"burst_count={FULL.burst_count}"]) is FULL  # the mode's own count: unchanged
    for bad in ("schedule=5", "schedule_count", "schedule_count=x", "schedule_count=0", "grace_ms=5"):
        with pytest.raises(SystemExit, match="--count"):
            with_counts(FULL, [bad])
