"""The six workloads, run against one system. Each load loop is bounded by its message count and by the
plan's time cap; each wait is bounded by the last due time plus the plan's grace period."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .base import Consumer, Peer, Producer
from .procs import PeerUnavailable, disk_usage, pin, tree_cpu_s, tree_rss
from .workloads import Plan, Recorder, lead_ms_for, make_payload, now_ms, spread_dues

WORKLOADS = ("schedule", "spread", "burst", "hol", "java", "restart", "pending")
Log = Callable[[str], None]


@dataclass
class Ctx:
    peer: Peer
    plan: Plan
    run: str
    log: Log
    rate: float | None = None  # scheduling rate measured by workload 1 (sizes the lead of later ones)
    notes: list[str] = field(default_factory=list)
    server_cpus: set[int] | None = None  # --pin: the CPUs of the system under test, and of the bench
    bench_cpus: set[int] | None = None

    @contextlib.contextmanager
    def spawning(self) -> Any:
        """Around a (re)start with --pin: this thread runs on the system's CPUs, so the processes it
        starts inherit them from their first instruction (start-up and recovery included); then the
        bench's own threads (any started meanwhile) go back to the bench's CPUs and every thread of the
        system's processes is checked onto its CPUs."""
        if self.server_cpus is None or self.bench_cpus is None:
            yield
            return
        os.sched_setaffinity(0, self.server_cpus)
        try:
            yield
        finally:
            pin([os.getpid()], self.bench_cpus, descendants=False)
            if not pin(self.peer.server_pids(), self.server_cpus):
                self.log(f"[{self.peer.label}] --pin: no server thread found to pin")


def _payload_fn(ctx: Ctx, wl: str) -> Callable[[int, int], bytes]:
    run, size = ctx.run, ctx.plan.payload_size
    return lambda seq, due: make_payload(run, wl, seq, due, size)


def load(producer: Producer, seqs: range, due_of: Callable[[int], int], batch: int,
         cap_s: float) -> dict[str, Any]:
    """Schedule ``seqs`` in batches (bounded by count and by ``cap_s``). Returns sent (seq -> real due),
    elapsed seconds and whether the time cap cut it short."""
    sent: dict[int, int] = {}
    t0 = time.monotonic()
    capped = False
    for start in range(seqs.start, seqs.stop, batch):
        if time.monotonic() - t0 > cap_s:
            capped = True
            break
        chunk = [(s, due_of(s)) for s in range(start, min(start + batch, seqs.stop))]
        dues = producer.schedule(chunk)
        sent.update((s, d) for (s, _), d in zip(chunk, dues, strict=True))
    return {"sent": sent, "elapsed_s": time.monotonic() - t0, "capped": capped, "end_ms": now_ms()}


@contextlib.contextmanager
def _clients(ctx: Ctx, wl: str, consume: bool = True) -> Any:
    rec = Recorder(ctx.run, wl)
    dest = f"cmp_{ctx.run}_{wl}"
    consumer: Consumer | None = ctx.peer.consumer(dest, rec.sink) if consume else None
    producer: Producer | None = None
    try:
        producer = ctx.peer.producer(dest, _payload_fn(ctx, wl))
        yield rec, producer
    finally:
        for c in (producer, consumer):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()


def _wait_all(rec: Recorder, sent: dict[int, int], extra_ms: int, only: set[int] | None = None,
              after_ms: int = 0) -> bool:
    """Wait for every sent message until ``extra_ms`` after the last due time (or after ``after_ms`` if
    that is later)."""
    want = set(sent) if only is None else set(sent) & only
    if not want:
        return True
    last_due = max(max(sent[s] for s in want), after_ms)
    wait_s = max(0.0, (last_due + extra_ms - now_ms()) / 1000)
    return rec.wait_for(want, time.monotonic() + wait_s)


def cpu_now(ctx: Ctx) -> float:
    """CPU seconds the system's whole process tree has used so far (/proc)."""
    return tree_cpu_s(ctx.peer.server_pids())


def per_1k(cpu_s: float, n: int) -> float | None:
    return cpu_s / n * 1000 if n > 0 else None


# --- 0. start-up: process start to the first acknowledged send, idle RSS --------------------------------
def first_ack(ctx: Ctx, t0: float, timeout_s: float = 120.0) -> dict[str, Any]:
    """Send one message (due far ahead) until the server acknowledges it, bounded by ``timeout_s``;
    the time since ``t0`` (right before the server process was started) includes the client's
    connection and route lookup, the same client for each system of a protocol."""
    p = ctx.plan
    deadline = time.monotonic() + timeout_s
    attempts = 0
    while True:
        attempts += 1
        try:
            producer = ctx.peer.producer(f"cmp_{ctx.run}_w0", _payload_fn(ctx, "w0"))
            try:
                producer.schedule([(0, now_ms() + p.far_delay_ms)])
            finally:
                with contextlib.suppress(Exception):
                    producer.close()
            return {"first_ack_s": time.monotonic() - t0, "attempts": attempts}
        except Exception as e:
            if time.monotonic() > deadline:
                return {"error": f"no acknowledged send within {timeout_s:.0f}s: {type(e).__name__}: {e}",
                        "attempts": attempts}
            time.sleep(0.1)


# --- 1. schedule as fast as possible -------------------------------------------------------------------
def w_schedule(ctx: Ctx) -> dict[str, Any]:
    p = ctx.plan
    with _clients(ctx, "w1", consume=False) as (_rec, producer):
        c0 = cpu_now(ctx)
        r = load(producer, range(p.schedule_count), lambda _s: now_ms() + p.far_delay_ms, p.batch,
                 p.load_cap_s)
        cpu = cpu_now(ctx) - c0
    n = len(r["sent"])
    ctx.rate = n / r["elapsed_s"] if r["elapsed_s"] > 0 else None
    return {"count": n, "target": p.schedule_count, "elapsed_s": r["elapsed_s"], "msgs_per_s": ctx.rate,
            "capped": r["capped"], "delay_ms": p.far_delay_ms, "server_cpu_s": cpu,
            "cpu_s_per_1k_scheduled": per_1k(cpu, n)}


# --- 5. pending scale (tops workload 1's destination up to pending_count) -------------------------------
def w_pending(ctx: Ctx, already: int) -> dict[str, Any]:
    p = ctx.plan
    with _clients(ctx, "w1", consume=False) as (_rec, producer):
        r = load(producer, range(already, max(already, p.pending_count)),
                 lambda _s: now_ms() + p.far_delay_ms, p.batch, p.load_cap_s)
    pending = already + len(r["sent"])
    time.sleep(p.settle_s)  # let background flushes/appends settle before measuring (a fixed pause)
    out: dict[str, Any] = {"pending": pending, "target": p.pending_count, "load_elapsed_s": r["elapsed_s"],
                           "capped": r["capped"]}
    out.update(ctx.peer.settle(max(p.settle_s, min(600.0, p.load_cap_s / 4))))
    out.update(tree_rss(ctx.peer.server_pids()))
    out.update(disk_usage(ctx.peer.data_dir))
    if pending:
        out["rss_per_msg_bytes"] = out["rss_bytes"] / pending
        out["disk_per_msg_bytes"] = out["disk_bytes"] / pending
    return out


# --- 2. N due over a window ----------------------------------------------------------------------------
def w_spread(ctx: Ctx) -> dict[str, Any]:
    p = ctx.plan
    with _clients(ctx, "w2") as (rec, producer):
        lead = lead_ms_for(p.spread_count, ctx.rate, p.lead_floor_ms)
        start = now_ms() + lead
        dues = spread_dues(p.spread_count, start, p.spread_window_ms)
        c0 = cpu_now(ctx)
        r = load(producer, range(p.spread_count), lambda s: dues[s], p.batch, p.load_cap_s)
        c1 = cpu_now(ctx)
        complete = _wait_all(rec, r["sent"], p.grace_ms)
        c2 = cpu_now(ctx)
        out = rec.summary(r["sent"])
    # delivered: from the end of the load until the last receipt (the timer's idle wait included)
    out.update(lead_ms=lead, window_ms=p.spread_window_ms, load_elapsed_s=r["elapsed_s"], capped=r["capped"],
               loaded_before_first_due=r["end_ms"] <= start, complete=complete,
               cpu_s_per_1k_scheduled=per_1k(c1 - c0, len(r["sent"])),
               cpu_s_per_1k_delivered=per_1k(c2 - c1, out["received"]))
    return out


# --- 3. burst: N due in the same second ----------------------------------------------------------------
def w_burst(ctx: Ctx) -> dict[str, Any]:
    p = ctx.plan
    with _clients(ctx, "w3") as (rec, producer):
        lead = lead_ms_for(p.burst_count, ctx.rate, p.lead_floor_ms)
        due = now_ms() + lead
        r = load(producer, range(p.burst_count), lambda _s: due, p.batch, p.load_cap_s)
        c1 = cpu_now(ctx)
        complete = _wait_all(rec, r["sent"], p.grace_ms)
        c2 = cpu_now(ctx)
        out = rec.summary(r["sent"])
    out["cpu_s_per_1k_delivered"] = per_1k(c2 - c1, out["received"])
    sent = r["sent"]
    if sent and out.get("last_recv_ms") is not None:
        out["drain_ms"] = out["last_recv_ms"] - max(sent.values())
        out["due_spread_ms"] = max(sent.values()) - min(sent.values())
    out.update(lead_ms=lead, load_elapsed_s=r["elapsed_s"], capped=r["capped"],
               loaded_before_due=r["end_ms"] <= due, complete=complete)
    return out


# --- 4. head-of-line: one long delay, then many short ones, same destination ---------------------------
def w_hol(ctx: Ctx) -> dict[str, Any]:
    p = ctx.plan
    with _clients(ctx, "w4") as (rec, producer):
        first = load(producer, range(1), lambda _s: now_ms() + p.hol_long_ms, p.batch, p.load_cap_s)
        r = load(producer, range(1, p.hol_short_count + 1), lambda _s: now_ms() + p.hol_short_ms, p.batch,
                 p.load_cap_s)
        shorts = set(r["sent"])
        # wait for the short ones; a queue with head-of-line blocking releases them only after the long one
        deadline_ms = max(first["sent"].values(), default=now_ms()) + p.grace_ms
        complete = rec.wait_for(shorts, time.monotonic() + max(0.0, (deadline_ms - now_ms()) / 1000))
        out = rec.summary(r["sent"], only=shorts)
        out["long_received"] = rec.summary(first["sent"])["received"]
    out.update(long_ms=p.hol_long_ms, short_ms=p.hol_short_ms, complete=complete)
    return out


# --- the official Java client (the second table) --------------------------------------------------------
def w_java(ctx: Ctx) -> dict[str, Any]:
    """Both runs of java_bench against a RocketMQ-protocol broker; "na" for other systems, "skipped" with
    the reason when Java, Maven or the driver are missing."""
    from . import java_bench

    peer, p = ctx.peer, ctx.plan
    if not peer.speaks_remoting:
        return {"na": java_bench.NA_PROTOCOL}
    try:
        cmd = java_bench.jvm_command()
    except PeerUnavailable as e:
        return {"skipped": str(e)}
    from .chronomq_peer import _levels_ms, topic_of

    out: dict[str, Any] = {"jvm": java_bench.jvm_flags(cmd), "client": "rocketmq-client 4.9.8, 4.x API"}
    for mode in ("timed", "levels"):
        if mode == "timed" and peer.levels_ms is not None:
            out[mode] = {"na": java_bench.NA_TIMER}
            continue
        topic = topic_of(f"cmp_{ctx.run}_j{mode}")
        try:
            peer._create_topic(topic)  # type: ignore[attr-defined]
            out[mode] = java_bench.run_one(cmd, peer.workdir / "java", peer.namesrv,  # type: ignore[attr-defined]
                                           topic, ctx.run, mode, p.java_count, p.spread_window_ms,
                                           _levels_ms(), p.load_cap_s, p.grace_ms, p.payload_size)
        except Exception as e:
            out[mode] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        ctx.log(f"[{peer.label}] java {mode}: {_brief(out[mode])}")
    return out


# --- 6. kill -9 with N pending, restart, count lost / duplicate / early --------------------------------
def w_restart(ctx: Ctx) -> dict[str, Any]:
    p = ctx.plan
    peer = ctx.peer
    rec = Recorder(ctx.run, "w6")
    dest = f"cmp_{ctx.run}_w6"
    consumer = peer.consumer(dest, rec.sink)
    try:
        producer = peer.producer(dest, _payload_fn(ctx, "w6"))
        try:
            lead = lead_ms_for(p.restart_count, ctx.rate, p.lead_floor_ms) + p.restart_extra_lead_ms
            dues = spread_dues(p.restart_count, now_ms() + lead, p.restart_window_ms)
            r = load(producer, range(p.restart_count), lambda s: dues[s], p.batch, p.load_cap_s)
        finally:
            producer.close()
        sent = r["sent"]
        received_before_kill = rec.distinct()
        t_kill = time.monotonic()
        peer.kill9()
        with ctx.spawning():
            peer.restart()
        restart_s = time.monotonic() - t_kill
        # wait until the last due time or the restart, whichever is later, plus the grace period
        complete = _wait_all(rec, sent, p.restart_grace_ms, after_ms=now_ms())
        if complete:  # give late duplicates (redeliveries) a moment to show up
            time.sleep(2)
        out = rec.summary(sent)
        if out.get("lost"):
            try:
                out["server_backlog"] = peer.backlog(dest)
            except Exception as e:
                out["server_backlog"] = f"unavailable: {e}"
        for attr in ("reconnects", "last_error", "errors"):
            if hasattr(consumer, attr):
                out[f"consumer_{attr}"] = getattr(consumer, attr)
    finally:
        with contextlib.suppress(Exception):
            consumer.close()
    out.update(pending_at_kill=len(sent) - received_before_kill, restart_s=restart_s, complete=complete,
               load_elapsed_s=r["elapsed_s"], capped=r["capped"])
    return out


def run_system(peer: Peer, plan: Plan, run: str, log: Log,
               only: tuple[str, ...] = WORKLOADS, server_cpus: set[int] | None = None,
               bench_cpus: set[int] | None = None) -> dict[str, Any]:
    """Start the system, run the workloads (each isolated: a failure is recorded, the rest still runs),
    stop everything it started. Never raises for a workload failure. ``server_cpus``/``bench_cpus``:
    the system's processes on the one, the bench on the other (--pin)."""
    result: dict[str, Any] = {"system": peer.describe(), "status": "ok", "workloads": {}, "timings_s": {}}
    ctx = Ctx(peer, plan, run, log, server_cpus=server_cpus, bench_cpus=bench_cpus)
    t0 = time.monotonic()
    try:
        with ctx.spawning():
            peer.start()
    except Exception as e:
        result.update(status="error", reason=f"start failed: {e}")
        with contextlib.suppress(Exception):
            peer.stop()
        return result
    result["start_s"] = time.monotonic() - t0
    try:
        startup = {"start_s": result["start_s"], **first_ack(ctx, t0)}
        try:
            peer.after_start()
        except Exception as e:
            startup["after_start_error"] = f"{type(e).__name__}: {e}"
        time.sleep(plan.settle_s)
        idle = tree_rss(peer.server_pids())
        startup.update(rss_idle_bytes=idle["rss_bytes"], rss_idle_anon_bytes=idle["rss_anon_bytes"],
                       processes=idle["processes"], cpu_s_at_idle=cpu_now(ctx))
        result["workloads"]["startup"] = startup
        log(f"[{peer.label}] startup: {_brief(startup)}")
        result["system"] = peer.describe()
        result["baseline"] = {**idle, **disk_usage(peer.data_dir)}
        steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("schedule", lambda: w_schedule(ctx)),
            ("spread", lambda: w_spread(ctx)),
            ("burst", lambda: w_burst(ctx)),
            ("hol", lambda: w_hol(ctx)),
            ("java", lambda: w_java(ctx)),
            ("restart", lambda: w_restart(ctx)),
            ("pending", lambda: w_pending(ctx, result["workloads"].get("schedule", {}).get("count", 0))),
        ]
        for name, fn in steps:
            if name not in only:
                continue
            log(f"[{peer.label}] {name} ...")
            ts = time.monotonic()
            try:
                result["workloads"][name] = fn()
            except Exception as e:
                result["workloads"][name] = {"error": f"{type(e).__name__}: {e}",
                                             "traceback": traceback.format_exc()[-3000:]}
                log(f"[{peer.label}] {name} failed: {e}")
                if not peer.server_pids():  # a failed restart: bring the server back for what follows
                    with contextlib.suppress(Exception), ctx.spawning():
                        peer.restart()
            result["timings_s"][name] = time.monotonic() - ts
            log(f"[{peer.label}] {name} done in {result['timings_s'][name]:.1f}s: "
                f"{_brief(result['workloads'][name])}")
    finally:
        with contextlib.suppress(Exception):  # as it ended (e.g. clients made again after a restart)
            result["system"] = peer.describe()
        try:
            peer.stop()
        except Exception as e:
            result["stop_error"] = str(e)
    result["total_s"] = time.monotonic() - t0
    return result


# --- several rounds of one system, summarized ----------------------------------------------------------
WORST_OF_ROUNDS = frozenset({"lost", "duplicates", "early_receipts", "foreign", "attempts"})  # worst round
ANY_ROUND = frozenset({"capped"})  # a flag that is bad news in any round
FAILED = ("error", "na", "skipped")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _merge_values(key: str, values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(_number(v) for v in present):
        return max(present) if key in WORST_OF_ROUNDS else statistics.median(present)
    if all(isinstance(v, bool) for v in present):
        return any(present) if key in ANY_ROUND else all(present)
    if all(isinstance(v, dict) for v in present):
        return merge_workload(present)
    return present[0] if all(v == present[0] for v in present) else present


def merge_workload(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One workload's figures over several rounds: the median of each figure over the rounds that ran
    (lost, duplicated and early messages: the worst round's; a flag: true only if true in every round,
    ``capped`` if in any), each figure's values by round in ``per_round``, and the failed rounds'
    errors in ``round_errors``."""
    ok = [r for r in rounds if not any(k in r for k in FAILED)]
    if not ok:
        return rounds[0]
    keys = list(dict.fromkeys(k for r in ok for k in r))
    out = {k: _merge_values(k, [r.get(k) for r in ok]) for k in keys}
    out["per_round"] = {k: [r.get(k) for r in ok] for k in keys if any(_number(r.get(k)) for r in ok)}
    out["rounds_ok"] = len(ok)
    errors = [f"round {i + 1}: {r.get('error') or r.get('skipped') or r.get('na')}"
              for i, r in enumerate(rounds) if any(k in r for k in FAILED)]
    if errors:
        out["round_errors"] = errors
    return out


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """``run_system``'s results of several rounds of one system as one result: its status "ok" when a
    round ran, each workload summarized by ``merge_workload``, the rounds' own results in ``rounds``."""
    if len(rounds) == 1:
        return rounds[0]
    ran = [r for r in rounds if r.get("status") == "ok"] or rounds[:1]
    out: dict[str, Any] = {"system": ran[-1].get("system", {}), "status": ran[0].get("status", "error"),
                           "rounds": rounds}
    if ran[0].get("status") != "ok":
        out["reason"] = ran[0].get("reason", "")
    names = list(dict.fromkeys(w for r in ran for w in r.get("workloads", {})))
    out["workloads"] = {w: merge_workload([r["workloads"][w] for r in ran if w in r.get("workloads", {})])
                        for w in names}
    for key in ("start_s", "total_s"):
        vals = [r[key] for r in ran if _number(r.get(key))]
        if vals:
            out[key] = statistics.median(vals) if key == "start_s" else sum(vals)
    baselines = [r["baseline"] for r in ran if isinstance(r.get("baseline"), dict)]
    if baselines:
        out["baseline"] = merge_workload(baselines)
    return out


def _brief(d: dict[str, Any]) -> str:
    keys = ("first_ack_s", "rss_idle_bytes", "msgs_per_s", "cpu_s_per_1k_scheduled", "cpu_s_per_1k_delivered",
            "p50_ms", "p99_ms", "max_ms", "drain_ms", "received", "sent", "lost", "duplicates",
            "early_receipts", "rss_bytes", "disk_bytes", "pending", "error", "na", "skipped")
    parts = []
    for k in keys:
        if k in d and d[k] is not None:
            v = d[k]
            parts.append((f"{k}={v:.0f}" if abs(v) >= 100 else f"{k}={v:.3g}") if isinstance(v, float)
                         else f"{k}={v}")
    return " ".join(parts)
