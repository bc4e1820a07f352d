"""``python -m bench.compare [--quick | --full]``: chronomq (ASYNC_FLUSH and SYNC_FLUSH) against a Redis
sorted-set delay queue, RabbitMQ TTL + dead-letter and Apache RocketMQ (5.3.3 with its timer wheel, in
both flush modes, and 4.9.7 with delay levels), same workloads, same machine, one run; the remoting brokers
also driven by the official Java client (a second table).

Prints the table, writes bench/results/compare-<run>.json (raw results) and .png (chart); with
``--write-readme`` also records the run in bench/compare/README.md."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .base import Peer
from .chronomq_peer import ChronomqPeer
from .procs import APT_LINE, PeerUnavailable, pin
from .rabbit_peer import RabbitPeer
from .redis_peer import RedisPeer
from .report import render_rich, targets_markdown, update_readme, write_chart, write_json
from .rocketmq_peer import RocketMQPeer
from .runner import WORKLOADS, merge_rounds, run_system
from .workloads import PLANS, Plan

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
BROKER_SETTINGS: dict[str, str] = {}  # --set: further settings of the chronomq brokers
SYSTEMS: dict[str, Callable[[Path], Peer]] = {
    "chronomq_async": lambda d: ChronomqPeer(d, "ASYNC_FLUSH", BROKER_SETTINGS),
    "chronomq_sync": lambda d: ChronomqPeer(d, "SYNC_FLUSH", BROKER_SETTINGS),
    "redis": RedisPeer,
    "rabbitmq": RabbitPeer,
    "rocketmq5_async": lambda d: RocketMQPeer(d, "rocketmq5", "ASYNC_FLUSH"),
    "rocketmq5_sync": lambda d: RocketMQPeer(d, "rocketmq5", "SYNC_FLUSH"),
    "rocketmq4": lambda d: RocketMQPeer(d, "rocketmq4", "ASYNC_FLUSH"),
}


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "os": f"{platform.system()} {platform.release()}", "hostname": platform.node()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["mem_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
        rel = Path("/etc/os-release")
        if rel.exists():
            for line in rel.read_text().splitlines():
                if line.startswith("PRETTY_NAME="):
                    info["os"] += f" ({line.split('=', 1)[1].strip(chr(34))})"
    except OSError:
        pass
    return info


def _loadavg() -> list[float] | None:
    """The machine's 1/5/15-minute load averages: other work on the machine shows up in every figure."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def with_counts(plan: Plan, overrides: list[str]) -> Plan:
    """``plan`` with its ``*_count`` fields replaced by ``FIELD=N`` overrides; a changed plan is named
    after its mode and the counts it changed, so no run passes for the mode's own counts."""
    fields = {f.name for f in dataclasses.fields(plan) if f.name.endswith("_count")}
    changes: dict[str, int] = {}
    for kv in overrides:
        key, sep, value = kv.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise SystemExit(f"--count {kv!r}: expected FIELD=N with FIELD one of {sorted(fields)}")
        try:
            n = int(value.replace("_", "").replace(",", ""))
        except ValueError:
            raise SystemExit(f"--count {kv!r}: {value!r} is not a whole number") from None
        if n <= 0:
            raise SystemExit(f"--count {kv!r}: the count must be positive")
        changes[key] = n
    changes = {k: v for k, v in changes.items() if getattr(plan, k) != v}
    if not changes:
        return plan
    named = ", ".join(f"{k}={v:,}" for k, v in sorted(changes.items()))
    return dataclasses.replace(plan, mode=f"{plan.mode} ({named})", **changes)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", const="quick", dest="mode",
                      help="scaled-down counts, under 10 minutes on 2 cores (default)")
    mode.add_argument("--full", action="store_const", const="full", dest="mode",
                      help="the issue's counts (1,000,000 scheduled, 10,000,000 pending, ...): hours")
    mode.add_argument("--tiny", action="store_const", const="tiny", dest="mode",
                      help="seconds-long smoke run (tests)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"subset of {', '.join(WORKLOADS)}")
    ap.add_argument("--pending", type=int, help="override the pending-scale count (workload 5)")
    ap.add_argument("--count", action="append", default=[], metavar="FIELD=N",
                    help="override one count of the plan, e.g. schedule_count=200000 or java_count=50000 "
                         "(repeatable; the run is then recorded as the mode with its counts changed)")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="directory for the JSON and PNG (bench/results)")
    ap.add_argument("--workdir", type=Path, help="parent of the temporary data dirs (default: system temp)")
    ap.add_argument("--keep", action="store_true", help="keep the data dirs afterwards")
    ap.add_argument("--no-chart", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a broker setting of the chronomq systems (repeatable; stated in the results)")
    ap.add_argument("--write-readme", action="store_true", help="record this run in bench/compare/README.md")
    ap.add_argument("--readme-from", type=Path, metavar="JSON",
                    help="only re-render README.md's results section from a saved results file")
    ap.add_argument("--note", default="", help="a remark stored with the results and shown in README.md")
    ap.add_argument("--pin", action="store_true",
                    help="run each system under test on the first CPU and the bench (its clients) on the "
                         "others, the same for every system (README.md: CPU placement)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every system this many times, in turns (A, B, A, B, ...), and give each "
                         "figure's median over the rounds (lost, duplicated and early messages: the worst "
                         "round's); the rounds' own figures stay in the JSON")
    ap.set_defaults(mode="quick")
    return ap.parse_args(argv)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    plan: Plan = PLANS[args.mode]
    for kv in getattr(args, "set", None) or []:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {kv!r}: expected KEY=VALUE")
        BROKER_SETTINGS[key.strip()] = value.strip()
    counts = [f"pending_count={args.pending}"] if args.pending else []
    plan = with_counts(plan, counts + list(getattr(args, "count", None) or []))
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {list(SYSTEMS)}")
    only = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    server_cpus: set[int] | None = None
    bench_cpus: set[int] | None = None
    placement: dict[str, Any] | None = None
    if getattr(args, "pin", False):
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            raise SystemExit(f"--pin needs at least 2 CPUs; this process may use {cpus}")
        server_cpus, bench_cpus = {cpus[0]}, set(cpus[1:])
        pin([os.getpid()], bench_cpus, descendants=False)  # the bench, and the client threads it starts
        placement = {"server_cpus": [cpus[0]], "bench_cpus": cpus[1:]}
    rounds = getattr(args, "rounds", None)
    rounds = 1 if rounds is None else rounds
    if rounds < 1:
        raise SystemExit(f"--rounds {rounds}: must be at least 1")
    run_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    started = time.monotonic()
    results: dict[str, Any] = {"meta": {"run": run_id, "mode": plan.mode, "plan": plan.to_dict(),
                                        "started": datetime.now(UTC).isoformat(timespec="seconds"),
                                        "machine": machine_info(), "argv": sys.argv[1:],
                                        "note": getattr(args, "note", ""), "load_avg_start": _loadavg(),
                                        "workloads": list(only), "cpu_placement": placement,
                                        "rounds": rounds},
                               "systems": {}}
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    parent = Path(tempfile.mkdtemp(prefix=f"chronomq-compare-{run_id}-", dir=args.workdir))
    log(f"run {run_id}, {plan.mode} mode, data under {parent}")
    try:
        peers: dict[str, Peer] = {}
        for name in names:
            peer = SYSTEMS[name](parent / name)
            try:
                peer.check()
            except PeerUnavailable as e:
                log(f"skipping {peer.label}: {e}")
                if "apt-get" in str(e):
                    log(f"  to include it: {APT_LINE}")
                results["systems"][name] = {"system": peer.describe(), "status": "skipped", "reason": str(e)}
                continue
            peers[name] = peer
            results["systems"][name] = {"system": peer.describe(), "status": "error", "reason": "not run"}
        done: dict[str, list[dict[str, Any]]] = {name: [] for name in peers}
        for k in range(rounds):
            for name in peers:
                # a fresh system each round, its data dir of its own
                peer = peers[name] if k == 0 else SYSTEMS[name](parent / f"{name}.r{k + 1}")
                if k:
                    try:
                        peer.check()
                    except PeerUnavailable as e:
                        done[name].append({"system": peer.describe(), "status": "skipped", "reason": str(e)})
                        continue
                turn = f", round {k + 1} of {rounds}" if rounds > 1 else ""
                log(f"== {peer.label} ({peer.durability}){turn}")
                done[name].append(run_system(peer, plan, run_id, log, only, server_cpus, bench_cpus))
                log(f"== {peer.label} done in {done[name][-1].get('total_s', 0):.0f} s")
                if not args.keep:  # full mode leaves tens of GiB per system: free them before the next one
                    shutil.rmtree(peer.workdir, ignore_errors=True)
                results["systems"][name] = merge_rounds(done[name])
    finally:
        results["meta"]["elapsed_s"] = time.monotonic() - started
        results["meta"]["load_avg_end"] = _loadavg()
        results["meta"]["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
        if not args.keep:
            shutil.rmtree(parent, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.readme_from:
        import json

        saved = json.loads(args.readme_from.read_text())
        if args.note:
            saved["meta"]["note"] = args.note
        update_readme(HERE / "README.md", saved)
        print(f"recorded {args.readme_from} in {HERE / 'README.md'}")
        return 0
    results = run(args)
    out: Path = args.out
    json_path = write_json(results, out / f"compare-{results['meta']['run']}.json")
    print(render_rich(results))
    targets = targets_markdown(results)
    if targets:
        print("targets against Apache RocketMQ 5 (same flush mode):")
        print(targets)
    print(f"raw results: {json_path}")
    if not args.no_chart:
        try:
            png = out / f"compare-{results['meta']['run']}.png"
            print(f"chart: {write_chart(results, png)}")
        except PeerUnavailable as e:
            print(f"no chart: {e}")
    if args.write_readme:
        update_readme(HERE / "README.md", results)
        print(f"recorded in {HERE / 'README.md'}")
    print(f"total {results['meta']['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
