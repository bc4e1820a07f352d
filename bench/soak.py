"""A soak: a fresh `chronomq start` under a mixed load at a fixed rate for N minutes (immediate sends, delay
levels, deliver times with cancels, batches; one push consumer), sampled every ``--interval`` seconds:
the broker's RSS and heap, open files, threads, CPU, the lateness of timed messages and the consumer's lag.
Writes a CSV and a plot under bench/results/ and prints a verdict on its last line: the heap, open files
and threads must level off (growth over the second half of the run within a bound), and the ledger's
invariants must hold (nothing lost, corrupt, early or cancelled-and-delivered).

    .venv/bin/python bench/soak.py --minutes 60             # the recorded run (docs/reliability.md)
    .venv/bin/python bench/soak.py --minutes 1 --interval 5 # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.workload import Ledger, Mix, now_ms, proc_sample, receipt_of  # noqa: E402

COLUMNS = ("t_s", "rss_mib", "heap_mib", "fds", "other_fds", "threads", "cpu_pct", "sent", "acked",
           "received", "lag", "late_p50_ms", "late_p99_ms", "late_max_ms", "data_mib")


def pct(vals: list[int], p: float) -> float:
    if not vals:
        return 0.0
    vals = sorted(vals)
    return float(vals[min(len(vals) - 1, int(p / 100 * len(vals)))])


def dir_mib(path: Path) -> float:
    """Bytes allocated on disk (segments are sparse files: their size is not their use)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file()) / 2**20


def levels_off(rows: list[dict[str, float]], key: str, slack: float, frac: float) -> tuple[bool, str]:
    """Growth of ``key`` over the second half of the run within max(slack, frac x the midpoint value)."""
    if len(rows) < 4:
        return True, f"{key}: too few samples to judge"
    mid, end = rows[len(rows) // 2][key], max(r[key] for r in rows[-max(1, len(rows) // 10):])
    bound = max(slack, frac * mid)
    ok = end - mid <= bound
    return ok, f"{key} {rows[0][key]:.1f} -> {mid:.1f} (midpoint) -> {end:.1f} (end): " + (
        f"second-half growth {end - mid:+.1f} within {bound:.1f}" if ok
        else f"second-half growth {end - mid:+.1f} exceeds {bound:.1f}")


def plot(rows: list[dict[str, float]], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] / 60 for r in rows]
    fig, ax = plt.subplots(3, 2, figsize=(11, 9), sharex=True)

    def panel(a, series: list[tuple[str, str]], ylabel: str = "") -> None:
        for key, label in series:
            a.plot(t, [r[key] for r in rows], label=label)
        if ylabel:
            a.set_ylabel(ylabel)
        a.set_ylim(bottom=0)
        a.legend(loc="best")

    panel(ax[0][0], [("heap_mib", "heap (RssAnon)")], "MiB")
    panel(ax[0][1], [("rss_mib", "RSS (heap + mapped files)"), ("data_mib", "data on disk")], "MiB")
    panel(ax[1][0], [("fds", "open files"), ("other_fds", "open files outside the data dir"),
                     ("threads", "threads")])
    panel(ax[1][1], [("late_p50_ms", "p50"), ("late_p99_ms", "p99")], "timed-message lateness, ms")
    panel(ax[2][0], [("lag", "lag (due, not received)")], "messages")
    panel(ax[2][1], [("cpu_pct", "broker CPU")], "%")
    for a in ax[2]:
        a.set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def replot(csv_path: Path, title: str) -> Path:
    """Draw the plot of a CSV written by an earlier run (next to it, same name, .png)."""
    with csv_path.open() as f:
        rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
    for r in rows:  # a CSV from before other_fds was recorded
        r.setdefault("other_fds", float("nan"))
    png = csv_path.with_suffix(".png")
    plot(rows, png, title)
    return png


async def soak(args: argparse.Namespace) -> int:
    from tests.compat.harness import ChronomqProcess

    from chronomq.client import Admin, Producer, PushConsumer

    data = Path(tempfile.mkdtemp(prefix="chronomq-soak-")) / "data"
    server = ChronomqProcess(data, {"flushDiskType": args.flush, **dict(kv.split("=", 1) for kv in args.set)})
    server.start()
    pid = server.pid or 0
    ledger = Ledger()
    late: list[int] = []
    topic = "SoakTopic"

    async def handle(message: object) -> None:
        r = receipt_of(ledger, message)
        if r.due_ms:
            late.append(r.at_ms - r.due_ms)

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out_dir / f"soak-{stamp}.csv", out_dir / f"soak-{stamp}.png"
    rows: list[dict[str, float]] = []
    seconds = args.minutes * 60
    ns = server.namesrv_addr
    try:
        async with Admin(ns) as admin:
            await admin.create_topic(topic, 4)
            async with Producer("soak-producer", namesrv=ns) as producer, \
                    PushConsumer("soak-consumer", topic, handle, namesrv=ns, consume_from="first",
                                 rebalance_interval=2):
                mix = Mix(ledger, ns, topic, size=args.size, max_delay_s=args.max_delay)
                stop = asyncio.Event()
                load = asyncio.create_task(mix.run(producer, admin, args.rate, seconds, stop))
                t0 = time.monotonic()
                cpu0 = proc_sample(pid)["cpu_s"]
                prev_t, prev_cpu = t0, cpu0
                with csv_path.open("w", newline="") as f:
                    w = csv.DictWriter(f, COLUMNS)
                    w.writeheader()
                    while not load.done():
                        left = max(0.0, t0 + seconds - time.monotonic())
                        await asyncio.sleep(min(args.interval, left + 0.1))
                        s = proc_sample(pid, data)
                        t = time.monotonic()
                        window, late[:] = late[:], []
                        row = {"t_s": round(t - t0, 1), "rss_mib": round(s["VmRSS"], 1),
                               "heap_mib": round(s["RssAnon"], 1), "fds": s["fds"],
                               "other_fds": s["fds"] - s["data_fds"], "threads": s["threads"],
                               "cpu_pct": round(100 * (s["cpu_s"] - prev_cpu) / max(1e-9, t - prev_t), 1),
                               "sent": mix.stats.attempts, "acked": mix.stats.acked,
                               "received": len(ledger.receipts), "lag": ledger.lag(now_ms()),
                               "late_p50_ms": pct(window, 50), "late_p99_ms": pct(window, 99),
                               "late_max_ms": float(max(window, default=0)),
                               "data_mib": round(dir_mib(data), 1)}
                        prev_t, prev_cpu = t, s["cpu_s"]
                        rows.append(row)
                        w.writerow(row)
                        f.flush()
                        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                await load
                # let what is still due arrive before the ledger is judged
                deadline = time.monotonic() + args.max_delay + 30
                while ledger.outstanding and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)  # polling the ledger, with a deadline
    finally:
        server.stop()
    v = ledger.verdict()
    # open files below the data dir are the store's segments, which grow with the data kept (until
    # fileReservedTime): the check is on the others (sockets, pipes, anything else)
    checks = [levels_off(rows, "heap_mib", args.heap_slack, 0.10), levels_off(rows, "other_fds", 4, 0.10),
              levels_off(rows, "threads", 2, 0.10)]
    plot(rows, png_path, f"chronomq soak: {args.rate} msgs/s mixed, {args.flush}, {args.minutes:g} min")
    lat = [r["late_p99_ms"] for r in rows]
    for ok, text in checks:
        print(("ok    " if ok else "GROWS ") + text)
    print(f"send errors: {mix.stats.errors or 'none'}; csv {csv_path}; plot {png_path}")
    good = v.ok and all(ok for ok, _ in checks)
    print(f"soak {'ok' if good else 'FAILED'}: minutes={args.minutes:g} rate={args.rate} {v.line()} "
          f"lateness_p99_ms(median of samples)={pct([int(x) for x in lat], 50):.0f} "
          f"rss_mib={rows[0]['rss_mib'] if rows else 0}->{rows[-1]['rss_mib'] if rows else 0} "
          f"heap_mib={rows[0]['heap_mib'] if rows else 0}->{rows[-1]['heap_mib'] if rows else 0} "
          f"fds={rows[0]['fds'] if rows else 0}->{rows[-1]['fds'] if rows else 0} "
          f"other_fds={rows[0]['other_fds'] if rows else 0}->{rows[-1]['other_fds'] if rows else 0}")
    if v.examples:
        print(f"examples: {v.examples}")
    return 0 if good else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--rate", type=int, default=200, help="messages per second, all kinds together")
    ap.add_argument("--interval", type=float, default=10, help="seconds between samples")
    ap.add_argument("--size", type=int, default=512, help="body bytes")
    ap.add_argument("--max-delay", type=float, default=30, help="deliver times up to this many seconds ahead")
    ap.add_argument("--flush", default="ASYNC_FLUSH", choices=("ASYNC_FLUSH", "SYNC_FLUSH"))
    ap.add_argument("--heap-slack", type=float, default=8.0,
                    help="MiB of heap growth allowed in the second half")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a broker configuration key (repeatable)")
    ap.add_argument("--replot", metavar="CSV", help="only redraw the plot of an earlier run's CSV")
    a = ap.parse_args()
    if a.replot:
        print(replot(Path(a.replot), f"chronomq soak: {a.rate} msgs/s mixed, {a.flush}, {a.minutes:g} min"))
        return 0
    return asyncio.run(soak(a))


if __name__ == "__main__":
    sys.exit(main())
