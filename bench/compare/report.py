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

PEERS = ("redis", "rabbitmq", "rocketmq5_async", "rocketmq5_sync", "rocketmq4")
CHRONOMQ = ("chronomq_async", "chronomq_sync")
# chronomq's mode -> Apache RocketMQ 5 in the same flush mode (the targets compare these pairs)
ROCKETMQ_PAIR = {"chronomq_async": "rocketmq5_async", "chronomq_sync": "rocketmq5_sync"}
TITLE = "chronomq vs Redis ZSET vs RabbitMQ TTL+DLX vs Apache RocketMQ"


@dataclass(frozen=True)
class Metric:
    workload: str   # key in results["workloads"]
    field: str      # key in that workload's dict
    group: str      # row group title (the workload)
    label: str      # figure
    better: str     # "higher" or "lower"
    unit: str       # "rate", "ms", "bytes", "count", "s", "cpu"


def metrics(plan: dict[str, Any]) -> list[Metric]:
    w = plan
    return [
        Metric("startup", "first_ack_s", "0 start", "process start to first acknowledged send", "lower", "s"),
        Metric("startup", "rss_idle_bytes", "", "server RSS idle", "lower", "bytes"),
        Metric("schedule", "msgs_per_s", f"1 schedule {w['schedule_count']:,}", "msgs/s", "higher", "rate"),
        Metric("schedule", "cpu_s_per_1k_scheduled", "", "server CPU per 1,000 scheduled", "lower", "cpu"),
        Metric("spread", "p50_ms", f"2 {w['spread_count']:,} due over {w['spread_window_ms'] // 1000} s",
               "lateness p50", "lower", "ms"),
        Metric("spread", "p99_ms", "", "lateness p99", "lower", "ms"),
        Metric("spread", "max_ms", "", "lateness max", "lower", "ms"),
        Metric("spread", "early_receipts", "", "early deliveries", "lower", "count"),
        Metric("spread", "lost", "", "not received", "lower", "count"),
        Metric("spread", "cpu_s_per_1k_delivered", "", "server CPU per 1,000 delivered", "lower", "cpu"),
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


def java_metrics(plan: dict[str, Any]) -> list[Metric]:
    """The second table: the official Java client's runs (workloads["java"]["timed" / "levels"])."""
    n = plan.get("java_count", 0)
    out = []
    for mode, title in (("timed", f"timed (TIMER_DELIVER_MS) {n:,} due over "
                                  f"{plan['spread_window_ms'] // 1000} s"),
                        ("levels", f"delay levels 1-10 (1-10 s) {n:,}")):
        wl = f"java.{mode}"
        out += [Metric(wl, "msgs_per_s", title, "schedule msgs/s", "higher", "rate"),
                Metric(wl, "p50_ms", "", "lateness p50", "lower", "ms"),
                Metric(wl, "p99_ms", "", "lateness p99", "lower", "ms"),
                Metric(wl, "max_ms", "", "lateness max", "lower", "ms"),
                Metric(wl, "early_receipts", "", "early deliveries", "lower", "count"),
                Metric(wl, "lost", "", "not received", "lower", "count")]
    return out


def workload(sysres: dict[str, Any], name: str) -> Any:
    """A workload's dict; a dotted name reaches into one (``java.timed``)."""
    wl: Any = sysres.get("workloads", {})
    for part in name.split("."):
        if not isinstance(wl, dict):
            return None
        if "na" in wl or "skipped" in wl:  # the whole workload does not apply (or could not run)
            return wl
        wl = wl.get(part)
    return wl


def value(results: dict[str, Any], system: str, m: Metric) -> float | None:
    sysres = results.get("systems", {}).get(system)
    if not sysres or sysres.get("status") != "ok":
        return None
    wl = workload(sysres, m.workload)
    if not isinstance(wl, dict) or "error" in wl or "na" in wl or "skipped" in wl:
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
    if unit == "cpu":
        return f"{v:,.3f} s"
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


def rocketmq_pairs(results: dict[str, Any], systems: list[str]) -> list[tuple[str, str]]:
    """(chronomq mode, RocketMQ 5 in the same flush mode) for each pair that both ran."""
    return [(c, r) for c, r in ROCKETMQ_PAIR.items() if c in systems and r in systems
            and results["systems"][r].get("status") == "ok"]


def overran(wl: dict[str, Any]) -> bool:
    """True when loading had not finished by the (first) due time, so early receipts overlap the load."""
    return wl.get("loaded_before_first_due") is False or wl.get("loaded_before_due") is False


def table_rows(results: dict[str, Any], java: bool = False) -> tuple[list[str], list[list[str]]]:
    """Header and rows (strings) of the comparison table: group, figure, one column per system, then
    chronomq's ratio to the best peer for each chronomq variant and to Apache RocketMQ 5 in the same
    flush mode ("↑ better"/"↓ better" is the figure's direction; "-" when a value is missing). With
    ``java``: the second table (the official Java client), its systems only, ratios to RocketMQ 5 only."""
    plan = results["meta"]["plan"]
    systems = systems_present(results)
    if java:
        systems = [s for s in systems if s in CHRONOMQ or s.startswith("rocketmq")]
    labels = {s: results["systems"][s].get("system", {}).get("label", s) for s in systems}
    cmq = [] if java else [s for s in systems if s in CHRONOMQ]
    pairs = rocketmq_pairs(results, systems)
    header = ["workload", "figure", *[labels[s] for s in systems],
              *[f"{labels[s]} / best peer" for s in cmq], *[f"{labels[c]} / {labels[r]}" for c, r in pairs]]
    rows = []
    for m in (java_metrics(plan) if java else metrics(plan)):
        best = best_peer(results, m)
        row = [m.group, m.label]
        for s in systems:
            sysres = results["systems"][s]
            if sysres.get("status") != "ok":
                row.append(sysres.get("status", "?"))
                continue
            wl = workload(sysres, m.workload)
            if isinstance(wl, dict) and ("na" in wl or "skipped" in wl):
                row.append("n/a" if "na" in wl else "skipped")
                continue
            wl = wl if isinstance(wl, dict) else {}
            failed = "error" in wl
            cell = "error" if failed else fmt(value(results, s, m), m.unit)
            if not failed and isinstance(wl, dict) and overran(wl) and cell != "-":
                cell += " *"
            if not failed and isinstance(wl, dict) and wl.get("capped") and cell != "-":
                done = wl.get("pending", wl.get("count", wl.get("sent")))
                cell += f" † {done:,}" if isinstance(done, int) else " †"
            row.append(cell)
        for s in cmq:
            row.append(fmt_ratio(ratio(value(results, s, m), best[1] if best else None), m.better))
        for c, r in pairs:
            row.append(fmt_ratio(ratio(value(results, c, m), value(results, r, m)), m.better))
        rows.append(row)
    return header, rows


def has_java(results: dict[str, Any]) -> bool:
    return any(isinstance(d.get("workloads", {}).get("java"), dict) and
               not {"na", "skipped"} & set(d["workloads"]["java"])
               for d in results.get("systems", {}).values())


def java_footer(results: dict[str, Any]) -> list[str]:
    """How the Java table was made, and why a system has no figures there."""
    lines = []
    for s in systems_present(results):
        j = results["systems"][s].get("workloads", {}).get("java")
        if isinstance(j, dict) and "jvm" in j:
            lines.append(f"official Java client: {j.get('client', '')}, async sends (64 in flight), a push "
                         f"consumer; JVM {j['jvm']}")
            break
    for s in systems_present(results):
        j = results["systems"][s].get("workloads", {}).get("java")
        if isinstance(j, dict) and "skipped" in j:
            label = results["systems"][s].get("system", {}).get("label", s)
            lines.append(f"{label}: skipped: {j['skipped']}")
    return lines


def rounds_line(rounds: int) -> str:
    return (f"each figure is the median of {rounds} rounds, the systems run in turns (A, B, A, B, ...); "
            "lost, duplicated and early messages are the worst round's")


def footer_lines(results: dict[str, Any]) -> list[str]:
    """The legend and one line per system: configuration, client, version, and why it did not run."""
    lines = ["ratio = chronomq / best peer (or / Apache RocketMQ 5 in the same flush mode);  ↑ higher is "
             "better,  ↓ lower is better;  n/a: the figure does not apply to that system;  * loading had not "
             "finished when the first message fell due;  † N: the load hit its time cap (load_cap_s) after N "
             "messages, and the figure is for those"]
    rounds = results["meta"].get("rounds") or 1
    if rounds > 1:
        lines.append(rounds_line(rounds))
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
        extra = [plain_table(*table_rows(results, java=True)), *java_footer(results)] \
            if has_java(results) else []
        return "\n".join([plain_table(header, rows), *footer_lines(results), *extra, f"(plain table: {e})"])
    mode = results["meta"]["plan"]["mode"]

    def make(title: str, header: list[str], rows: list[list[str]]) -> Any:
        table = rich_table.Table(title=title, show_lines=False)
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i < 2 else "right", no_wrap=i >= 2)
        prev = None
        for row in rows:
            if row[0] and row[0] != prev and prev is not None:
                table.add_section()
            prev = row[0] or prev
            table.add_row(*row)
        return table

    # wide enough that no column is squeezed (7 systems and 4 ratio columns make a wide table)
    widest = max(sum(max(len(r[i]) for r in [h, *rs]) + 3 for i in range(len(h)))
                 for h, rs in [(header, rows), table_rows(results, java=True)])
    console = rich_console.Console(width=max(200, widest + 4), record=True)
    with console.capture() as cap:
        console.print(make(f"{TITLE} ({mode} mode, 1 KiB payloads)", header, rows))
        for line in footer_lines(results):
            console.print(line, highlight=False, markup=False)
        if has_java(results):
            console.print(make("the same brokers driven by the official Java client (4.x API)",
                               *table_rows(results, java=True)))
            for line in java_footer(results):
                console.print(line, highlight=False, markup=False)
    return cap.get()


def plain_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def markdown_table(results: dict[str, Any], java: bool = False) -> str:
    header, rows = table_rows(results, java)
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_json(results: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True, default=str))
    tmp.replace(path)
    return path


CHART_METRICS = [("startup", "first_ack_s", "0 start to first acknowledged send, s (lower)", False),
                 ("startup", "rss_idle_bytes", "0 idle: server RSS MiB (lower)", False),
                 ("schedule", "msgs_per_s", "1 schedule: msgs/s (higher is better)", False),
                 ("schedule", "cpu_s_per_1k_scheduled", "1 server CPU s per 1,000 scheduled (lower)", False),
                 ("spread", "p99_ms", "2 due over window: lateness p99 ms (lower is better)", True),
                 ("burst", "drain_ms", "3 burst: last received after due, ms (lower)", True),
                 ("hol", "p50_ms", "4 head-of-line: short msgs lateness p50 ms (lower)", True),
                 ("pending", "rss_bytes", "5 pending: server RSS MiB (lower)", False),
                 ("restart", "lost", "6 kill -9: lost + duplicates (lower)", False),
                 ("restart", "restart_s", "6 kill -9: restart time, s (lower)", False)]


def write_chart(results: dict[str, Any], path: Path) -> Path:
    """A PNG with one bar panel per workload (matplotlib, Agg backend)."""
    matplotlib = need_module("matplotlib", "matplotlib, for the chart")
    matplotlib.use("Agg")
    plt = need_module("matplotlib.pyplot", "matplotlib, for the chart")
    systems = [s for s in systems_present(results) if results["systems"][s].get("status") == "ok"]
    labels = [results["systems"][s]["system"].get("label", s) for s in systems]
    colors = {"chronomq_async": "#1f77b4", "chronomq_sync": "#4a9fd8", "redis": "#d62728",
              "rabbitmq": "#ff7f0e", "rocketmq5_async": "#2ca02c", "rocketmq5_sync": "#74c476",
              "rocketmq4": "#8c564b"}
    fig, axes = plt.subplots(2, 5, figsize=(26, 9))
    for ax, (wl, field, title, logy) in zip(axes.flat, CHART_METRICS, strict=True):
        vals = []
        for s in systems:
            w = results["systems"][s].get("workloads", {}).get(wl, {})
            v = w.get(field) if isinstance(w, dict) else None
            if (wl, field) == ("restart", "lost") and isinstance(w, dict) and v is not None:
                v = (w.get("lost") or 0) + (w.get("duplicates") or 0)
            if field in ("rss_bytes", "rss_idle_bytes") and v is not None:
                v = v / (1 << 20)
            vals.append(float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0)
        bars = ax.bar(labels, vals, color=[colors.get(s, "grey") for s in systems])
        for b, v in zip(bars, vals, strict=True):
            text = f"{v:,.0f}" if v >= 10 else f"{v:.2f}"
            ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                        fontsize=8)
        if logy and any(v > 0 for v in vals):
            ax.set_yscale("symlog", linthresh=1)
        elif not any(v > 0 for v in vals):
            ax.set_ylim(0, 1)  # all zero (e.g. nothing lost): a flat, readable panel
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    meta = results["meta"]
    fig.suptitle(f"{TITLE} -- {meta['plan']['mode']} mode, "
                 f"{meta.get('machine', {}).get('cpus', '?')} CPUs, run {meta['run']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# the targets against Apache RocketMQ 5 (same flush mode): (text, workload, field, chronomq / RocketMQ bound,
# direction); "<=" means chronomq / RocketMQ must not exceed the bound, ">=" must reach it
TARGETS = [
    ("schedule rate of timed messages >= RocketMQ 5's", "schedule", "msgs_per_s", 1.0, ">="),
    ("spread: lateness p99 <= 1/10 of RocketMQ 5's", "spread", "p99_ms", 0.1, "<="),
    ("burst: last received after due <= RocketMQ 5's", "burst", "drain_ms", 1.0, "<="),
    ("head-of-line: lateness p50 <= RocketMQ 5's", "hol", "p50_ms", 1.0, "<="),
    ("head-of-line: lateness max <= RocketMQ 5's", "hol", "max_ms", 1.0, "<="),
    ("RSS idle <= 1/5 of RocketMQ 5's", "startup", "rss_idle_bytes", 0.2, "<="),
    ("RSS at pending scale <= 1/5 of RocketMQ 5's", "pending", "rss_bytes", 0.2, "<="),
    ("process start to first acknowledged send <= 1/3 of RocketMQ 5's", "startup", "first_ack_s", 1 / 3,
     "<="),
    ("restart after kill -9 <= 1/3 of RocketMQ 5's", "restart", "restart_s", 1 / 3, "<="),
]
_UNITS = {"msgs_per_s": "rate", "rss_idle_bytes": "bytes", "rss_bytes": "bytes", "first_ack_s": "s",
          "restart_s": "s"}


def target_cell(results: dict[str, Any], cmq: str, rmq: str, wl: str, field: str, bound: float,
                direction: str) -> tuple[str, bool | None]:
    """"chronomq vs RocketMQ: xRATIO (bound): met / missed by N %" and whether it was met (None: a figure
    is missing)."""
    m = Metric(wl, field, "", "", "higher" if direction == ">=" else "lower", _UNITS.get(field, "ms"))
    a, b = value(results, cmq, m), value(results, rmq, m)
    if a is None or b is None:
        return "-", None
    r = ratio(a, b)
    assert r is not None
    met = r >= bound if direction == ">=" else r <= bound
    head = f"{fmt(a, m.unit)} vs {fmt(b, m.unit)}: " + ("peer 0" if math.isinf(r) else f"x{r:,.2f}")
    if met:
        return f"{head} ({direction} x{bound:.2f}): met", True
    if math.isinf(r):
        return f"{head}: missed", False
    # how far from the bound, as a share of it
    off = (bound - r) / bound if direction == ">=" else (r - bound) / bound
    return f"{head} ({direction} x{bound:.2f}): missed by {off:.0%}", False


def kill9_cell(results: dict[str, Any], cmq: str, rmq: str) -> tuple[str, bool | None]:
    def triple(s: str) -> tuple[float | None, ...]:
        return tuple(value(results, s, Metric("restart", f, "", "", "lower", "count"))
                     for f in ("lost", "duplicates", "early_receipts"))

    mine, theirs = triple(cmq), triple(rmq)
    if None in mine:
        return "-", None
    show = "/".join(f"{v:,.0f}" if v is not None else "-" for v in mine)
    peer = "/".join(f"{v:,.0f}" if v is not None else "-" for v in theirs)
    met = all(v == 0 for v in mine)
    return f"{show} (RocketMQ 5: {peer}): {'met' if met else 'missed'}", met


def targets_markdown(results: dict[str, Any]) -> str | None:
    """The targets against RocketMQ 5 in the same flush mode, met or missed and by how much (None when no
    chronomq/RocketMQ 5 pair ran)."""
    pairs = rocketmq_pairs(results, systems_present(results))
    if not pairs:
        return None
    labels = {s: results["systems"][s].get("system", {}).get("label", s) for c, r in pairs for s in (c, r)}
    header = ["target", *[f"{labels[c]} vs {labels[r]}" for c, r in pairs]]
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for text, wl, field, bound, direction in TARGETS:
        cells = [target_cell(results, c, r, wl, field, bound, direction)[0] for c, r in pairs]
        out.append("| " + " | ".join([text.replace("|", "/"), *cells]) + " |")
    out.append("| " + " | ".join(["kill -9: lost / duplicates / early 0/0/0",
                                  *[kill9_cell(results, c, r)[0] for c, r in pairs]]) + " |")
    return "\n".join(out)


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
    if (meta.get("rounds") or 1) > 1:
        lines += [f"{rounds_line(meta['rounds']).capitalize()} (`--rounds {meta['rounds']}`).", ""]
    if meta.get("note"):
        lines += [f"Note: {meta['note']}", ""]
    mode = meta["plan"]["mode"]
    if mode.startswith("full ("):
        lines += [f"This is a **{mode}** run: the full mode's counts except those named (the workload "
                  "column of the table gives each count).", ""]
    elif mode != "full":
        lines += [f"This is a **{mode}-mode** run (scaled-down counts: see the workload "
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
    targets = targets_markdown(results)
    if targets:
        lines += ["", "The targets against Apache RocketMQ 5 in the same flush mode (this run's figures):",
                  "", targets]
    if has_java(results):
        lines += ["", "The same brokers driven by the official Java client (4.x API):", "",
                  markdown_table(results, java=True), ""]
        lines += [f"- {line}" for line in java_footer(results)]
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
