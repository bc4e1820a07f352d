"""``chronomq admin`` without a server: the cancel/reschedule exit codes in --help, the delay-stats text
(which counters restart with the broker), how times print (ISO-8601 UTC, or epoch ms with --epoch-ms) and
the CLI modules' import graph (no cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from chronomq.cli import admin_timer
from chronomq.cli.admin import broker_status_text, delay_stats_table
from chronomq.cli.main import build_parser, main
from chronomq.cli.output import fmt_epoch_ms, parse_time_ms

CLI_DIR = Path(admin_timer.__file__).parent


@pytest.mark.parametrize(("verb", "done"), [("cancel", "CANCELLED"), ("reschedule", "RESCHEDULED")])
def test_timer_verb_help_states_exit_codes(verb: str, done: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["admin", verb, "--help"])
    assert ei.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"exit codes: 0 when at least one message was {done}; 3 when none was" in text
    assert "1 on an error" in text and "2 on a usage error" in text
    assert admin_timer.EXIT_NOTHING_CHANGED == 3


def test_delay_stats_labels_the_counters_kept_in_memory() -> None:
    stats = {
        "levels": [{"level": 2, "delay_ms": 5000, "pending": 4, "oldest_pending_deliver_ms": None,
                    "delivered": 7, "lateness_ms": {"count": 7, "p50": 1, "p99": 2, "max": 3}}],
        "early_deliveries": 0,
        "recovered_skips": 1,
        "timer": {"pending": 5, "due_undelivered": 0, "delivered": 9, "cancelled": 2, "rescheduled": 1,
                  "failed": 0, "early_deliveries": 0, "next_due_ms": 1_700_000_000_000,
                  "lateness_ms": {"count": 9, "p50": 1, "p99": 4, "max": 6}, "disk_bytes": {"total": 4096},
                  "pending_by_topic": {"T": 5}, "lateness_ms_by_topic": {"T": {"count": 9, "max": 6}}},
    }
    lines = delay_stats_table(stats).splitlines()
    assert lines[1].split() == ["2", "5s", "4", "-", "7", "7", "1", "2", "3"]
    since = [line for line in lines if "since start" in line]
    assert "delivered, n and late_*" in since[0] and "early_deliveries=0" in since[0]
    assert "recovered_skips=1" in since[0]
    assert any("delivered=9" in s and "cancelled=2" in s and "rescheduled=1" in s for s in since)
    assert any("lateness_ms n=9" in s for s in since)
    assert any("delivered_n and late_*" in s for s in since)
    # what the stores hold survives a restart: not labelled
    timer_head = next(line for line in lines if line.startswith("timer:"))
    assert "pending=5" in timer_head and "since start" not in timer_head and "disk=4096 B" in timer_head
    assert lines[-1].split()[:3] == ["T", "5", "9"]


DUE_MS = 1_795_787_057_461
DUE_ISO = "2026-11-27T13:44:17.461Z"


def test_times_print_as_iso_utc_with_ms_or_as_epoch_ms() -> None:
    assert fmt_epoch_ms(DUE_MS) == DUE_ISO and fmt_epoch_ms(str(DUE_MS)) == DUE_ISO
    assert parse_time_ms(DUE_ISO) == DUE_MS  # what a table shows, --at/--from/--to read back
    assert fmt_epoch_ms(DUE_MS, epoch_ms=True) == str(DUE_MS)
    assert fmt_epoch_ms(1_000) == "1970-01-01T00:00:01.000Z"
    for none in (None, -1, "", "-", True):
        assert fmt_epoch_ms(none) == "-" and fmt_epoch_ms(none, epoch_ms=True) == "-"


def test_delay_stats_and_broker_status_show_times_for_people_or_scripts() -> None:
    stats = {"levels": [{"level": 1, "delay_ms": 1000, "pending": 1, "oldest_pending_deliver_ms": DUE_MS}],
             "timer": {"pending": 1, "next_due_ms": DUE_MS}}
    lines = delay_stats_table(stats).splitlines()
    assert lines[0].split()[3] == "oldest_deliver" and lines[1].split()[3] == DUE_ISO
    assert f"next_due={DUE_ISO}" in next(line for line in lines if line.startswith("timer:"))
    lines = delay_stats_table(stats, epoch_ms=True).splitlines()
    assert lines[0].split()[3] == "oldest_deliver_ms" and lines[1].split()[3] == str(DUE_MS)
    assert f"next_due_ms={DUE_MS}" in next(line for line in lines if line.startswith("timer:"))
    info = {"bootTimestamp": str(DUE_MS), "earliestMessageTimeStamp": "1000", "putMessageTimesTotal": "5"}
    assert broker_status_text(info).split() == ["bootTimestamp", DUE_ISO, "earliestMessageTimeStamp",
                                                "1970-01-01T00:00:01.000Z", "putMessageTimesTotal", "5"]
    assert broker_status_text(info, epoch_ms=True).split()[1] == str(DUE_MS)


@pytest.mark.parametrize("verb", [["delay-stats"], ["pending"], ["cancel", "X"], ["reschedule", "X"],
                                  ["broker-status"],
                                  ["reset-offset", "-g", "G", "-t", "T", "--timestamp", "0"]])
def test_every_verb_printing_a_time_takes_epoch_ms(verb: list[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["admin", *verb]).epoch_ms is False
    assert parser.parse_args(["admin", *verb, "--epoch-ms"]).epoch_ms is True


def _cli_imports(path: Path) -> set[str]:
    """The chronomq.cli modules ``path`` imports, at any level of the module (function bodies too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                out.add(node.module.split(".")[0])
            elif node.module and node.module.startswith("chronomq.cli."):
                out.add(node.module.split(".")[2])
    return out


def test_cli_modules_import_no_cycle() -> None:
    graph = {p.stem: _cli_imports(p) for p in CLI_DIR.glob("*.py")}
    done: set[str] = set()

    def visit(mod: str, path: tuple[str, ...]) -> None:
        assert mod not in path, f"import cycle: {' -> '.join((*path, mod))}"
        if mod in done:
            return
        for dep in graph.get(mod, ()):
            visit(dep, (*path, mod))
        done.add(mod)

    for mod in graph:
        visit(mod, ())
    assert "admin" not in graph["admin_timer"] and "admin" in graph["main"]
