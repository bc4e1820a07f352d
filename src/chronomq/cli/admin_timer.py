"""``chronomq admin cancel | reschedule | pending`` and the timer part of ``delay-stats``.

Each verb asks every master broker (or ``-b HOST:PORT``) through ``chronomq.client.Admin`` (request codes
9002-9004)::

    chronomq admin cancel -n HOST:PORT ID [--key]
    chronomq admin reschedule -n HOST:PORT ID (--at ISO-8601|EPOCH-MS | --in SECONDS) [--key]
    chronomq admin pending -n HOST:PORT [--topic T] [--key K] [--tag G] [--from T] [--to T] [--limit N]
                                        [--count] [--json]

ID is a message id (the UNIQ_KEY a send returned, or its offset msg id); with ``--key`` it is a word of
KEYS and every pending message carrying it is affected. Exit codes of cancel/reschedule: TIMER_EXIT_CODES.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from chronomq.client import TimerOpResult, TimerOutcome

from .admin_session import open_admin, targets
from .output import (
    AdminError,
    add_epoch_ms_arg,
    fmt_epoch_ms,
    parse_in_seconds,
    parse_time_ms,
    table,
    time_name,
)

Common = Callable[..., None]

EXIT_NOTHING_CHANGED = 3


def timer_exit_codes(done: str) -> str:
    """The exit codes of cancel (done="CANCELLED") or reschedule (done="RESCHEDULED"), for --help."""
    return (f"exit codes: 0 when at least one message was {done}; {EXIT_NOTHING_CHANGED} when none was "
            "(the answer is UNKNOWN, ALREADY_DELIVERED, ALREADY_CANCELLED or FAILED); 1 on an error "
            "(a bad argument, an unreachable or refusing server); 2 on a usage error")


def _result_dict(r: TimerOpResult) -> dict[str, Any]:
    return {"outcome": str(r.outcome), "msg_id": r.msg_id, "deliver_ms": r.deliver_ms, "topic": r.topic,
            "broker": r.broker}


def _print_results(results: list[TimerOpResult], args: argparse.Namespace, done: TimerOutcome) -> int:
    if args.json:
        print(json.dumps([_result_dict(r) for r in results]))
    elif results:
        print(table([[str(r.broker), str(r.outcome), r.msg_id, r.topic or "-",
                      fmt_epoch_ms(r.deliver_ms, args.epoch_ms)] for r in results],
                    ["broker", "outcome", "msg_id", "topic", time_name("deliver_time", args.epoch_ms)]))
    return 0 if any(r.outcome == done for r in results) else EXIT_NOTHING_CHANGED


def cmd_cancel(args: argparse.Namespace) -> int:
    with open_admin(args) as admin:
        results = admin.cancel(args.id, args.key, broker_addr=args.broker)
    return _print_results(results, args, TimerOutcome.CANCELLED)


def cmd_reschedule(args: argparse.Namespace) -> int:
    if (args.at is None) == (args.in_s is None):
        raise AdminError("give exactly one of --at and --in")
    if args.at is not None:
        # a datetime, not epoch ms: any time is accepted (one long past means "due now")
        at = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=parse_time_ms(args.at, "--at"))
        when: dict[str, Any] = {"deliver_at": at}
    else:  # counted from now by the admin client's clock
        when = {"delay": timedelta(milliseconds=parse_in_seconds(args.in_s))}
    with open_admin(args) as admin:
        results = admin.reschedule(args.id, by_key=args.key, broker_addr=args.broker, **when)
    return _print_results(results, args, TimerOutcome.RESCHEDULED)


def pending_filters(args: argparse.Namespace) -> dict[str, Any]:
    """The pending filters of the command line as Admin.pending keywords."""
    out: dict[str, Any] = {name: getattr(args, name) or None for name in ("topic", "key", "tag")}
    start = parse_time_ms(args.from_, "--from") if args.from_ else None
    end = parse_time_ms(args.to, "--to") if args.to else None
    if start is not None and end is not None and end < start:
        raise AdminError(f"--to ({end}) is before --from ({start})")
    return dict(out, start=start, end=end)


def cmd_pending(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= 1000:
        raise AdminError(f"--limit must be within 1..1000, got {args.limit}")
    filters = pending_filters(args)
    with open_admin(args) as admin:
        brokers = targets(admin, args)
        if args.count:
            total = 0
            for name, addr in brokers:
                n = admin.pending_count(**filters, broker_addr=addr)
                total += n
                if not args.json:
                    print(f"{name}: {n}")
            print(json.dumps({"count": total}) if args.json else f"total: {total}")
            return 0
        items: list[dict[str, Any]] = []
        more: list[str] = []
        for name, addr in brokers:
            left = args.limit - len(items)
            if left <= 0:
                more.append(name)
                break
            page = admin.pending(**filters, limit=left, broker_addr=addr)
            items.extend(dict(dataclasses.asdict(i), broker=name) for i in page.items)
            if page.next_cursor:
                more.append(name)
    if args.json:
        print(json.dumps({"items": items, "truncated": bool(more)}))
        return 0
    rows = [[str(i["broker"]), str(i["msg_id"]), str(i["topic"]), str(i["queue_id"]), str(i["tags"] or "-"),
             ",".join(i["keys"]) or "-", fmt_epoch_ms(i["deliver_ms"], args.epoch_ms), str(i["body_size"])]
            for i in items]
    print(table(rows, ["broker", "msg_id", "topic", "queue", "tags", "keys",
                       time_name("deliver_time", args.epoch_ms), "bytes"]))
    if more:
        print(f"(more pending messages on {', '.join(more)}: raise --limit or narrow the filters)")
    return 0


def timer_stats_text(timer: Any, epoch_ms: bool = False) -> str:
    """The ``timer`` part of CHRONOMQ_DELAY_STATS, for ``chronomq admin delay-stats``. The timer store
    keeps its counters and lateness histograms in memory: they are labelled "since start" (they restart
    from 0 with the broker); pending, due_undelivered, next_due and disk come from the store itself."""
    if not isinstance(timer, dict):
        return ""
    if "error" in timer:
        return f"timer: {timer['error']}"
    lat = timer.get("lateness_ms") or {}
    head = (f"timer: pending={timer.get('pending', 0)} due_undelivered={timer.get('due_undelivered', 0)} "
            f"{time_name('next_due', epoch_ms)}={fmt_epoch_ms(timer.get('next_due_ms'), epoch_ms)} "
            f"disk={(timer.get('disk_bytes') or {}).get('total', '-')} B\n"
            f"       since start: delivered={timer.get('delivered', 0)} "
            f"cancelled={timer.get('cancelled', 0)} rescheduled={timer.get('rescheduled', 0)} "
            f"failed={timer.get('failed', 0)} "
            f"early_deliveries={timer.get('early_deliveries', 0)}\n"
            f"       since start: lateness_ms n={lat.get('count', 0)} p50={lat.get('p50', '-')} "
            f"p99={lat.get('p99', '-')} max={lat.get('max', '-')}")
    by_topic = timer.get("pending_by_topic") or {}
    lat_by = timer.get("lateness_ms_by_topic") or {}
    topics = sorted(set(by_topic) | set(lat_by))
    if not topics:
        return head
    rows = [[t, str(by_topic.get(t, 0)), str((lat_by.get(t) or {}).get("count", 0)),
             str((lat_by.get(t) or {}).get("p50", "-")), str((lat_by.get(t) or {}).get("p99", "-")),
             str((lat_by.get(t) or {}).get("max", "-"))] for t in topics]
    return (head + "\n       per topic (delivered_n and late_*: since start)\n"
            + table(rows, ["topic", "pending", "delivered_n", "late_p50", "late_p99", "late_max"]))


def run_timer_verb(args: argparse.Namespace) -> int | None:
    """Run cancel/reschedule/pending; None for any other verb. Raises AdminError (and the client's
    errors)."""
    if args.verb == "cancel":
        return cmd_cancel(args)
    if args.verb == "reschedule":
        return cmd_reschedule(args)
    if args.verb == "pending":
        return cmd_pending(args)
    return None


def add_timer_parsers(sub: Any, common: Common) -> None:
    sp = sub.add_parser("cancel", help="cancel a message waiting in the timer store (deliver_at/delay)",
                        epilog=timer_exit_codes("CANCELLED"))
    common(sp)
    sp.add_argument("id", help="message id (UNIQ_KEY or offset msg id), or a key with --key")
    sp.add_argument("--key", action="store_true", help="ID is a key: cancel every pending message with it")
    sp.add_argument("--json", action="store_true", help="print JSON (times in epoch ms)")
    add_epoch_ms_arg(sp)
    sp = sub.add_parser("reschedule", help="move a pending timed message to a new deliver time",
                        epilog=timer_exit_codes("RESCHEDULED"))
    common(sp)
    sp.add_argument("id", help="message id (UNIQ_KEY or offset msg id), or a key with --key")
    sp.add_argument("--at", help="new deliver time: ISO-8601 (naive = UTC) or epoch milliseconds")
    sp.add_argument("--in", dest="in_s", metavar="SECONDS",
                    help="new deliver time: this many seconds from now")
    sp.add_argument("--key", action="store_true", help="ID is a key: move every pending message with it")
    sp.add_argument("--json", action="store_true", help="print JSON (times in epoch ms)")
    add_epoch_ms_arg(sp)
    sp = sub.add_parser("pending", help="messages waiting in the timer store")
    common(sp)
    sp.add_argument("--topic")
    sp.add_argument("--key", help="a word of KEYS, or a message id")
    sp.add_argument("--tag")
    sp.add_argument("--from", dest="from_", metavar="TIME", help="deliver time at or after (ISO or epoch ms)")
    sp.add_argument("--to", metavar="TIME", help="deliver time at or before (ISO or epoch ms)")
    sp.add_argument("--limit", type=int, default=100, help="at most this many (1..1000, default 100)")
    sp.add_argument("--count", action="store_true", help="print only how many are pending")
    sp.add_argument("--json", action="store_true", help="print JSON (times in epoch ms)")
    add_epoch_ms_arg(sp)
