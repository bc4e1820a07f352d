"""Turning raw results into the comparison: one row per figure (grouped by the six workloads), one column
per system, and chronomq's ratio to the best peer; the JSON file, the PNG chart and the markdown table
for README.md."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import need_module

PEERS = ("redis", "rabbitmq")
CHRONOMQ = ("chronomq_async", "chronomq_sync")


@dataclass(frozen=True)
class Metric:
    workload: str   # key in results["workloads"]
    field: str      # key in that workload's dict
    group: str      # row group title (the workload)
    label: str      # figure
    better: str     # "higher" or "lower"
    unit: str       # "rate", "ms", "bytes", "count", "s"


def metrics(plan: dict[str, Any]) -> list[Metric]:
    w = plan
    return [
        Metric("schedule", "msgs_per_s", f"1 schedule {w['schedule_count']:,}", "msgs/s", "higher", "rate"),
        Metric("spread", "p50_ms", f"2 {w['spread_count']:,} due over {w['spread_window_ms'] // 1000} s",
               "lateness p50", "lower", "ms"),
        Metric("spread", "p99_ms", "", "lateness p99", "lower", "ms"),
        Metric("spread", "max_ms", "", "lateness max", "lower", "ms"),
        Metric("spread", "early_receipts", "", "early deliveries", "lower", "count"),
        Metric("spread", "lost", "", "not received", "lower", "count"),
        Metric("burst", "drain_ms", f"3 burst {w['burst_count']:,} due at once", "last received after due",
               "lower", "ms"),
        Metric("burst", "p99_ms", "", "lateness p99", "lower", "ms"),
        Metric("hol", "p50_ms", f"4 head-of-line 1x{w['hol_long_ms'] // 1000}s then "
               f"{w['hol_short_count']:,}x{w['hol_short_ms'] // 1000}s", "short msgs lateness p50", "lower",
               "ms"),
        Metric("hol", "max_ms", "", "short msgs lateness max", "lower", "ms"),
        Metric("pending", "rss_bytes", f"5 pending {w['pending_count']:,}", "server RSS", "lower", "bytes"),
        Metric("pending", "disk_bytes", "", "disk", "lower", "bytes"),
        Metric("restart", "lost", f"6 kill -9 with {w['restart_count']:,} pending", "lost", "lower", "count"),
        Metric("restart", "duplicates", "", "duplicates", "lower", "count"),
        Metric("restart", "early_receipts", "", "early", "lower", "count"),
        Metric("restart", "restart_s", "", "restart time", "lower", "s"),
    ]


def value(results: dict[str, Any], system: str, m: Metric) -> float | None:
    sysres = results.get("systems", {}).get(system)
    if not sysres or sysres.get("status") != "ok":
        return None
    wl = sysres.get("workloads", {}).get(m.workload)
    if not isinstance(wl, dict) or "error" in wl:
        return None
    v = wl.get(m.field)
    if isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, float) and math.isnan(v)):
        return None
    return float(v)


def best_peer(results: dict[str, Any], m: Metric) -> tuple[str, float] | None:
    vals = [(s, v) for s in PEERS if (v := value(results, s, m)) is not None]
    if not vals:
        return None
    pick = max if m.better == "higher" else min
    return pick(vals, key=lambda sv: sv[1])


def ratio(v: float | None, best: float | None) -> float | None:
    """chronomq / best peer (None when either is missing; 1.0 when both are zero; inf when only the peer
    is zero)."""
    if v is None or best is None:
        return None
    if best == 0:
        return 1.0 if v == 0 else math.inf
    return v / best


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "rate":
        return f"{v:,.0f}"
    if unit == "ms":
        return f"{v / 1000:,.2f} s" if v >= 10_000 else f"{v:,.0f} ms"
    if unit == "bytes":
        for u, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if v >= f:
                return f"{v / f:,.1f} {u}"
        return f"{v:,.0f} B"
    if unit == "s":
        return f"{v:,.1f} s"
    return f"{v:,.0f}"


def fmt_ratio(r: float | None, better: str) -> str:
    if r is None:
        return "-"
    if math.isinf(r):
        return "peer 0"
    arrow = "↑" if better == "higher" else "↓"
    return f"x{r:,.2f} {arrow}"


def systems_present(results: dict[str, Any]) -> list[str]:
    order = [*CHRONOMQ, *PEERS]
    return [s for s in order if s in results.get("systems", {})]


def overran(wl: dict[str, Any]) -> bool:
    """True when loading had not finished by the (first) due time, so early receipts overlap the load."""
    return wl.get("loaded_before_first_due") is False or wl.get("loaded_before_due") is False


def table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows (strings) of the comparison table: group, figure, one column per system, then
    chronomq's ratio to the best peer for each chronomq variant ("↑ better"/"↓ better" is the figure's
    direction; "-" when a value is missing)."""
    systems = systems_present(results)
    labels = {s: results["systems"][s].get("system", {}).get("label", s) for s in systems}
    cmq = [s for s in systems if s in CHRONOMQ]
    header = ["workload", "figure", *[labels[s] for s in systems],
              *[f"{labels[s]} / best peer" for s in cmq]]
    rows = []
    for m in metrics(results["meta"]["plan"]):
        best = best_peer(results, m)
        row = [m.group, m.label]
        for s in systems:
            sysres = results["systems"][s]
            if sysres.get("status") != "ok":
                row.append(sysres.get("status", "?"))
                continue
            wl = sysres.get("workloads", {}).get(m.workload, {})
            failed = isinstance(wl, dict) and "error" in wl
            cell = "error" if failed else fmt(value(results, s, m), m.unit)
            if not failed and isinstance(wl, dict) and overran(wl) and cell != "-":
                cell += " *"
            if not failed and isinstance(wl, dict) and wl.get("capped") and cell != "-":
                done = wl.get("pending", wl.get("count", wl.get("sent")))
                cell += f" † {done:,}" if isinstance(done, int) else " †"
            row.append(cell)
        for s in cmq:
            row.append(fmt_ratio(ratio(value(results, s, m), best[1] if best else None), m.better))
        rows.append(row)
    return header, rows


def footer_lines(results: dict[str, Any]) -> list[str]:
    """The legend and one line per system: configuration, client, version, and why it did not run."""
    lines = ["ratio = chronomq / best peer;  ↑ higher is better,  ↓ lower is better;  * loading had not "
             "finished when the first message fell due;  † N: the load hit its time cap (load_cap_s) after N "
             "messages, and the figure is for those"]
    placement = results["meta"].get("cpu_placement")
    if placement:
        lines.append(f"CPU placement (--pin): each system under test on CPU {placement['server_cpus']}, "
                     f"the bench and its clients on CPUs {placement['bench_cpus']}")
    for s in systems_present(results):
        d = results["systems"][s]
        desc = d.get("system", {})
        line = f"{desc.get('label', s)}: {desc.get('durability', '')}; client {desc.get('client', '')}"
        if desc.get("delay_mode"):
            line += f"; delays: {desc['delay_mode']}"
        if desc.get("version"):
            line += f"; {desc['version']}"
        if d.get("status") != "ok":
            line += f" -- {d.get('status')}: {d.get('reason', '')}"
        lines.append(line)
    return lines


def render_rich(results: dict[str, Any]) -> str:
    """The table as rich renders it (to a string); a plain-text table if rich is missing."""
    header, rows = table_rows(results)
    try:
        rich_console = need_module("rich.console", "rich, for the table")
        rich_table = need_module("rich.table", "rich, for the table")
    except RuntimeError as e:
        return "\n".join([plain_table(header, rows), *footer_lines(results), f"(plain table: {e})"])
    mode = results["meta"]["plan"]["mode"]
    title = f"chronomq vs Redis ZSET vs RabbitMQ TTL+DLX ({mode} mode, 1 KiB payloads)"
    table = rich_table.Table(title=title, show_lines=False)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i < 2 else "right", no_wrap=i >= 2)
    prev = None
    for row in rows:
        if row[0] and row[0] != prev and prev is not None:
            table.add_section()
        prev = row[0] or prev
        table.add_row(*row)
    console = rich_console.Console(width=200, record=True)
    with console.capture() as cap:
        console.print(table)
        for line in footer_lines(results):
            console.print(line, highlight=False, markup=False)
    return cap.get()


def plain_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def markdown_table(results: dict[str, Any]) -> str:
    header, rows = table_rows(results)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_json(results: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True, default=str))
    tmp.replace(path)
    return path


CHART_METRICS = [("schedule", "msgs_per_s", "1 schedule: msgs/s (higher is better)", False),
                 ("spread", "p99_ms", "2 due over window: lateness p99 ms (lower is better)", True),
                 ("burst", "drain_ms", "3 burst: last received after due, ms (lower)", True),
                 ("hol", "p50_ms", "4 head-of-line: short msgs lateness p50 ms (lower)", True),
                 ("pending", "rss_bytes", "5 pending: server RSS MiB (lower)", False),
                 ("restart", "lost", "6 kill -9: lost + duplicates (lower)", False)]


def write_chart(results: dict[str, Any], path: Path) -> Path:
    """A PNG with one bar panel per workload (matplotlib, Agg backend)."""
    matplotlib = need_module("matplotlib", "matplotlib, for the chart")
    matplotlib.use("Agg")
    plt = need_module("matplotlib.pyplot", "matplotlib, for the chart")
    systems = [s for s in systems_present(results) if results["systems"][s].get("status") == "ok"]
    labels = [results["systems"][s]["system"].get("label", s) for s in systems]
    colors = {"chronomq_async": "#1f77b4", "chronomq_sync": "#4a9fd8", "redis": "#d62728",
              "rabbitmq": "#ff7f0e"}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (wl, field, title, logy) in zip(axes.flat, CHART_METRICS, strict=True):
        vals = []
        for s in systems:
            w = results["systems"][s].get("workloads", {}).get(wl, {})
            v = w.get(field) if isinstance(w, dict) else None
            if wl == "restart" and isinstance(w, dict) and v is not None:
                v = (w.get("lost") or 0) + (w.get("duplicates") or 0)
            if wl == "pending" and v is not None:
                v = v / (1 << 20)
            vals.append(float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0)
        bars = ax.bar(labels, vals, color=[colors.get(s, "grey") for s in systems])
        for b, v in zip(bars, vals, strict=True):
            ax.annotate(f"{v:,.0f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=8)
        if logy and any(v > 0 for v in vals):
            ax.set_yscale("symlog", linthresh=1)
        elif not any(v > 0 for v in vals):
            ax.set_ylim(0, 1)  # all zero (e.g. nothing lost): a flat, readable panel
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    meta = results["meta"]
    fig.suptitle(f"chronomq vs Redis ZSET vs RabbitMQ TTL+DLX -- {meta['plan']['mode']} mode, "
                 f"{meta.get('machine', {}).get('cpus', '?')} CPUs, run {meta['run']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


README_START = "<!-- results:start -->"
README_END = "<!-- results:end -->"


def readme_section(results: dict[str, Any]) -> str:
    meta = results["meta"]
    m = meta.get("machine", {})
    lines = [README_START, "",
             f"Latest recorded run: **{meta['plan']['mode']} mode**, {meta.get('started', '')} "
             f"(run `{meta['run']}`, {meta.get('elapsed_s', 0):.0f} s in total).", "",
             f"Machine: {m.get('cpu_model', '?')}, {m.get('cpus', '?')} CPUs, "
             f"{m.get('mem_gib', '?')} GiB RAM, "
             f"{m.get('os', '?')}, Python {m.get('python', '?')}.", ""]
    if meta.get("load_avg_start") or meta.get("load_avg_end"):
        lines += [f"Load average (1/5/15 min) at start {meta.get('load_avg_start')}, at end "
                  f"{meta.get('load_avg_end')} (anything above 2 on this 2-core machine is other work "
                  "competing with the bench).", ""]
    if meta.get("note"):
        lines += [f"Note: {meta['note']}", ""]
    if meta["plan"]["mode"] != "full":
        lines += [f"This is a **{meta['plan']['mode']}-mode** run (scaled-down counts: see the workload "
                  "table above); the full mode has not been recorded on this machine yet.", ""]
    lines += [markdown_table(results), ""]
    for s in systems_present(results):
        d = results["systems"][s]
        desc = d.get("system", {})
        line = f"- {desc.get('label', s)}: {desc.get('durability', '')}; {desc.get('client', '')}"
        if desc.get("delay_mode"):
            line += f"; delays: {desc['delay_mode']}"
        if desc.get("version"):
            line += f"; {desc['version']}"
        if d.get("status") != "ok":
            line += f" -- **{d.get('status')}**: {d.get('reason', '')}"
        lines.append(line)
    lines += ["", README_END]
    return "\n".join(lines)


def update_readme(readme: Path, results: dict[str, Any]) -> None:
    text = readme.read_text() if readme.exists() else ""
    section = readme_section(results)
    if README_START in text and README_END in text:
        head, rest = text.split(README_START, 1)
        _, tail = rest.split(README_END, 1)
        text = head + section + tail
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    readme.write_text(text)
