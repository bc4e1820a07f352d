"""``chronomq admin cancel | reschedule | pending`` and the timer part of ``delay-stats`` (issue 7).

Each verb asks every master broker (or ``-b HOST:PORT``) over request codes 9002-9004 (see
chronomq.broker.timer_processor for the wire format)::

    chronomq admin cancel -n HOST:PORT ID [--key]
    chronomq admin reschedule -n HOST:PORT ID (--at ISO-8601|EPOCH-MS | --in SECONDS) [--key]
    chronomq admin pending -n HOST:PORT [--topic T] [--key K] [--tag G] [--from T] [--to T] [--limit N]
                                        [--count] [--json]

ID is a message id (the UNIQ_KEY a send returned, or its offset msg id); with ``--key`` it is a word of
KEYS and every pending message carrying it is affected. cancel/reschedule exit 0 when at least one
message was CANCELLED/RESCHEDULED, 3 when none was (UNKNOWN, ALREADY_DELIVERED, ...), 1 on errors.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from chronomq.remoting.codes import RequestCode

# admin.py imports this module lazily (inside functions), so importing admin here is not circular
from .admin import AdminError, _json, _table, _targets, call

Common = Callable[..., None]

EXIT_NOTHING_CHANGED = 3


def parse_time_ms(text: str, what: str = "time") -> int:
    """Epoch milliseconds from an integer (epoch ms; below 10**11 read as epoch seconds, like the broker)
    or an ISO-8601 date-time (a naive one is UTC). Raises AdminError with a clear message."""
    s = text.strip()
    if not s:
        raise AdminError(f"{what}: empty value")
    if s.lstrip("-").isdigit():
        v = int(s)
        if v < 0:
            raise AdminError(f"{what}: {text!r} is negative")
        return v * 1000 if 0 < v < 10**11 else v
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00") if s.endswith("Z") else s)
    except ValueError:
        raise AdminError(f"{what}: {text!r} is neither epoch milliseconds nor an ISO-8601 time") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


def parse_in_seconds(text: str) -> int:
    """A relative delay in (possibly fractional) seconds -> milliseconds."""
    try:
        v = float(text)
    except ValueError:
        raise AdminError(f"--in: {text!r} is not a number of seconds") from None
    if v != v or v < 0 or v == float("inf"):
        raise AdminError(f"--in: {text!r} must be a finite, non-negative number of seconds")
    return round(v * 1000)


def fmt_epoch_ms(ms: Any) -> str:
    if not isinstance(ms, int) or ms < 0:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def _results_table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    return _table([[name, str(r.get("outcome")), str(r.get("msg_id")), str(r.get("topic") or "-"),
                    fmt_epoch_ms(r.get("deliver_ms"))] for name, r in rows],
                  ["broker", "outcome", "msg_id", "topic", "deliver_time"])


def _timer_op(args: argparse.Namespace, code: int, ext: dict[str, str], done: str) -> int:
    found: list[tuple[str, dict[str, Any]]] = []
    unknown: list[tuple[str, dict[str, Any]]] = []
    for name, addr in _targets(args):
        results = _json(call(addr, code, ext)).get("results")
        if not isinstance(results, list):
            raise AdminError(f"{addr} answered no results list")
        for r in results:
            if isinstance(r, dict):
                (unknown if r.get("outcome") == "UNKNOWN" else found).append((name, r))
    rows = found or unknown[:1]
    if args.json:
        print(json.dumps([dict(r, broker=n) for n, r in rows]))
    elif rows:
        print(_results_table(rows))
    return 0 if any(r.get("outcome") == done for _, r in found) else EXIT_NOTHING_CHANGED


def cmd_cancel(args: argparse.Namespace) -> int:
    ext = {"id": args.id, "byKey": "true" if args.key else "false"}
    return _timer_op(args, RequestCode.CHRONOMQ_CANCEL_SCHEDULED, ext, "CANCELLED")


def cmd_reschedule(args: argparse.Namespace, now_ms: Callable[[], int] | None = None) -> int:
    if (args.at is None) == (args.in_s is None):
        raise AdminError("give exactly one of --at and --in")
    if args.at is not None:
        deliver_ms = parse_time_ms(args.at, "--at")
    else:
        deliver_ms = (now_ms or (lambda: int(time.time() * 1000)))() + parse_in_seconds(args.in_s)
    ext = {"id": args.id, "byKey": "true" if args.key else "false", "deliverMs": str(deliver_ms)}
    return _timer_op(args, RequestCode.CHRONOMQ_RESCHEDULE, ext, "RESCHEDULED")


def pending_ext(args: argparse.Namespace) -> dict[str, str]:
    ext: dict[str, str] = {}
    for name in ("topic", "key", "tag"):
        v = getattr(args, name)
        if v:
            ext[name] = v
    start = parse_time_ms(args.from_, "--from") if args.from_ else None
    end = parse_time_ms(args.to, "--to") if args.to else None
    if start is not None and end is not None and end < start:
        raise AdminError(f"--to ({end}) is before --from ({start})")
    if start is not None:
        ext["startMs"] = str(start)
    if end is not None:
        ext["endMs"] = str(end)
    return ext


def cmd_pending(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= 1000:
        raise AdminError(f"--limit must be within 1..1000, got {args.limit}")
    base = pending_ext(args)
    if args.count:
        total = 0
        for name, addr in _targets(args):
            n = int(_json(call(addr, RequestCode.CHRONOMQ_QUERY_PENDING, dict(base, countOnly="true")))
                    .get("count", 0))
            total += n
            if not args.json:
                print(f"{name}: {n}")
        print(json.dumps({"count": total}) if args.json else f"total: {total}")
        return 0
    items: list[dict[str, Any]] = []
    more: list[str] = []
    for name, addr in _targets(args):
        left = args.limit - len(items)
        if left <= 0:
            more.append(name)
            break
        data = _json(call(addr, RequestCode.CHRONOMQ_QUERY_PENDING, dict(base, limit=str(left))))
        items.extend(dict(i, broker=name) for i in data.get("items") or [] if isinstance(i, dict))
        if data.get("next_cursor"):
            more.append(name)
    if args.json:
        print(json.dumps({"items": items, "truncated": bool(more)}))
        return 0
    rows = [[str(i.get("broker")), str(i.get("msg_id")), str(i.get("topic")), str(i.get("queue_id")),
             str(i.get("tags") or "-"), ",".join(i.get("keys") or []) or "-",
             fmt_epoch_ms(i.get("deliver_ms")), str(i.get("body_size"))] for i in items]
    print(_table(rows, ["broker", "msg_id", "topic", "queue", "tags", "keys", "deliver_time", "bytes"]))
    if more:
        print(f"(more pending messages on {', '.join(more)}: raise --limit or narrow the filters)")
    return 0


def timer_stats_text(timer: Any) -> str:
    """The ``timer`` part of CHRONOMQ_DELAY_STATS, for ``chronomq admin delay-stats``."""
    if not isinstance(timer, dict):
        return ""
    if "error" in timer:
        return f"timer: {timer['error']}"
    lat = timer.get("lateness_ms") or {}
    head = (f"timer: pending={timer.get('pending', 0)} due_undelivered={timer.get('due_undelivered', 0)} "
            f"delivered={timer.get('delivered', 0)} cancelled={timer.get('cancelled', 0)} "
            f"rescheduled={timer.get('rescheduled', 0)} failed={timer.get('failed', 0)} "
            f"early_deliveries={timer.get('early_deliveries', 0)} "
            f"next_due={fmt_epoch_ms(timer.get('next_due_ms'))}\n"
            f"       lateness_ms n={lat.get('count', 0)} p50={lat.get('p50', '-')} "
            f"p99={lat.get('p99', '-')} max={lat.get('max', '-')}  "
            f"disk={(timer.get('disk_bytes') or {}).get('total', '-')} B")
    by_topic = timer.get("pending_by_topic") or {}
    lat_by = timer.get("lateness_ms_by_topic") or {}
    topics = sorted(set(by_topic) | set(lat_by))
    if not topics:
        return head
    rows = [[t, str(by_topic.get(t, 0)), str((lat_by.get(t) or {}).get("count", 0)),
             str((lat_by.get(t) or {}).get("p50", "-")), str((lat_by.get(t) or {}).get("p99", "-")),
             str((lat_by.get(t) or {}).get("max", "-"))] for t in topics]
    return head + "\n" + _table(rows, ["topic", "pending", "delivered_n", "late_p50", "late_p99", "late_max"])


def run_timer_verb(args: argparse.Namespace) -> int | None:
    """Run cancel/reschedule/pending; None for any other verb. Raises AdminError."""
    if args.verb == "cancel":
        return cmd_cancel(args)
    if args.verb == "reschedule":
        return cmd_reschedule(args)
    if args.verb == "pending":
        return cmd_pending(args)
    return None


def add_timer_parsers(sub: Any, common: Common) -> None:
    sp = sub.add_parser("cancel", help="cancel a message waiting in the timer store (deliver_at/delay)")
    common(sp)
    sp.add_argument("id", help="message id (UNIQ_KEY or offset msg id), or a key with --key")
    sp.add_argument("--key", action="store_true", help="ID is a key: cancel every pending message with it")
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp = sub.add_parser("reschedule", help="move a pending timed message to a new deliver time")
    common(sp)
    sp.add_argument("id", help="message id (UNIQ_KEY or offset msg id), or a key with --key")
    sp.add_argument("--at", help="new deliver time: ISO-8601 (naive = UTC) or epoch milliseconds")
    sp.add_argument("--in", dest="in_s", metavar="SECONDS",
                    help="new deliver time: this many seconds from now")
    sp.add_argument("--key", action="store_true", help="ID is a key: move every pending message with it")
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp = sub.add_parser("pending", help="messages waiting in the timer store")
    common(sp)
    sp.add_argument("--topic")
    sp.add_argument("--key", help="a word of KEYS, or a message id")
    sp.add_argument("--tag")
    sp.add_argument("--from", dest="from_", metavar="TIME", help="deliver time at or after (ISO or epoch ms)")
    sp.add_argument("--to", metavar="TIME", help="deliver time at or before (ISO or epoch ms)")
    sp.add_argument("--limit", type=int, default=100, help="at most this many (1..1000, default 100)")
    sp.add_argument("--count", action="store_true", help="print only how many are pending")
    sp.add_argument("--json", action="store_true", help="print JSON")
