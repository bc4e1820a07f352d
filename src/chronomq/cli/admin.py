"""``chronomq admin``: the administration verbs, each a thin shell over ``chronomq.client.Admin`` (one
admin client for the CLI and for programs; see admin_session.py). This module holds the cluster, topic,
route, broker-status, promote, consumer-progress, reset-offset and delay-stats verbs and the argument
parsers; the timer store's verbs (cancel, reschedule, pending) live in admin_timer.py, shared output
helpers in output.py.

Times print as ISO-8601 UTC with milliseconds, or as epoch ms with --epoch-ms (output.fmt_epoch_ms); --json
keeps epoch ms. Exit codes: 0 done, 1 an error (printed as one line on stderr), 2 a usage error; cancel and
reschedule also 3 (see their --help).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from chronomq.client import ClientError
from chronomq.client.admin import NotANameServer

from .admin_auth import add_auth_parsers, run_auth_verb
from .admin_session import open_admin, targets
from .admin_timer import add_timer_parsers, run_timer_verb, timer_stats_text
from .output import AdminError, add_epoch_ms_arg, fmt_epoch_ms, fmt_ms, parse_time_ms, table, time_name

__all__ = ["AdminError", "add_admin_parsers", "delay_stats_table", "run_admin"]

# The delay service's counters kept in memory: they restart from 0 with the broker. So do each level's
# delivered count and lateness histogram; its pending count and oldest deliver time come from the store.
SINCE_START_KEYS = ("early_deliveries", "recovered_skips")


def delay_stats_table(stats: dict[str, Any], epoch_ms: bool = False) -> str:
    rows = []
    for lv in stats.get("levels") or []:
        lat = lv.get("lateness_ms") or {}
        rows.append([str(lv.get("level", "")), fmt_ms(lv.get("delay_ms")), str(lv.get("pending", 0)),
                     fmt_epoch_ms(lv.get("oldest_pending_deliver_ms"), epoch_ms), str(lv.get("delivered", 0)),
                     str(lat.get("count", 0)), str(lat.get("p50", "-")), str(lat.get("p99", "-")),
                     str(lat.get("max", "-"))])
    header = ["level", "delay", "pending", time_name("oldest_deliver", epoch_ms), "delivered", "n",
              "late_p50", "late_p99", "late_max"]
    extra = {k: v for k, v in stats.items() if k not in ("levels", "timer")}
    lines = [table(rows, header)]
    other = [f"{k}={v}" for k, v in extra.items() if k not in SINCE_START_KEYS]
    if other:
        lines.append("  ".join(other))
    lines.append("since start (restart from 0 with the broker): delivered, n and late_* above; "
                 + "  ".join(f"{k}={v}" for k, v in extra.items() if k in SINCE_START_KEYS))
    timer = timer_stats_text(stats.get("timer"), epoch_ms)
    return "\n".join(lines) + ("\n" + timer if timer else "")


def _not_a_namesrv_text(e: NotANameServer, args: argparse.Namespace) -> str:
    text = (f"{e.addr} is a broker, not a name server: -n takes the name server's address "
            "(HOST:PORT, default 127.0.0.1:9876)")
    if hasattr(args, "broker"):
        text += f"; to ask this broker alone, use -b {e.addr}"
    return text


def _run_verb(args: argparse.Namespace) -> int:
    verb = args.verb
    timer_exit = run_timer_verb(args)
    if timer_exit is not None:
        return timer_exit
    if verb in ("user", "acl"):
        return run_auth_verb(args)
    with open_admin(args) as admin:
        if verb == "delay-stats":
            for name, addr in targets(admin, args):
                stats = admin.broker_delay_stats(addr)
                if args.json:
                    print(json.dumps({"broker": name, "addr": addr, "stats": stats}))
                else:
                    print(f"broker {name} ({addr})")
                    print(delay_stats_table(stats, args.epoch_ms))
        elif verb == "cluster":
            rows = [[cluster, name, str(bid), addr, *_replication_cells(admin, addr)]
                    for cluster, brokers in sorted(admin.cluster().items())
                    for name, addrs in brokers.items() for bid, addr in sorted(addrs.items())]
            print(table(rows, ["cluster", "broker", "id", "address", "role", "replication lag"]))
        elif verb == "topics":
            for t in admin.list_topics(sort=False):
                print(t)
        elif verb == "route":
            print(json.dumps(admin.route_data(args.topic), indent=1))
        elif verb == "update-topic":
            for _, addr in targets(admin, args):
                admin.create_topic(args.topic, args.queues, perm=args.perm, broker_addr=addr)
                print(f"topic {args.topic} updated on {addr}")
        elif verb == "consumer-progress":
            rows = []
            for name, addr in targets(admin, args):
                online = len(admin.broker_consumer_ids(addr, args.group))
                rows += [[name, p.queue.topic, str(p.queue.queue_id), str(p.broker_offset),
                          str(p.consumer_offset), str(p.lag),
                          fmt_epoch_ms(p.last_consumed_ms or None, args.epoch_ms),
                          str(online)]
                         for p in admin.broker_group_progress(addr, args.group, name)]
            if not rows:
                print(f"no committed offsets for group {args.group}")
            else:
                print(table(rows, ["broker", "topic", "queue", "max", "committed", "lag",
                                   time_name("last_consumed", args.epoch_ms), "online"]))
        elif verb == "reset-offset":
            ts = parse_time_ms(args.timestamp, "--timestamp")
            moved = admin.reset_offsets_by_time(args.group, args.topic, ts, force=not args.only_back,
                                                broker_addr=args.broker)
            print(f"group {args.group}, topic {args.topic}: offsets reset to the first message stored at or "
                  f"after {fmt_epoch_ms(ts, args.epoch_ms)}; the group's online consumers were told")
            print(table([[mq.broker_name, str(mq.queue_id), str(off)] for mq, off in moved.items()],
                        ["broker", "queue", "offset"]))
        elif verb == "promote":
            if not args.broker:
                raise AdminError("promote needs the slave's address: -b HOST:PORT")
            print(admin.promote(args.broker, args.role))
        elif verb == "broker-status":
            for name, addr in targets(admin, args):
                print(f"broker {name} ({addr})")
                print(broker_status_text(admin.broker_runtime_info(addr), args.epoch_ms))
        else:
            print(f"unknown admin verb {verb!r}", file=sys.stderr)
            return 2
    return 0


def broker_status_text(info: dict[str, str], epoch_ms: bool = False) -> str:
    """A broker's runtime figures, one ``key value`` line each; its times (the keys ending in
    "timestamp": bootTimestamp, earliestMessageTimeStamp) formatted like every admin time."""
    return "\n".join(f"  {k:28s} {fmt_epoch_ms(v, epoch_ms) if k.lower().endswith('timestamp') else v}"
                     for k, v in sorted(info.items()))


def _replication_cells(admin: Any, addr: str) -> list[str]:
    """A broker's role and how far its replication is behind, as `cluster` shows them."""
    try:
        info = admin.broker_runtime_info(addr)
    except (AdminError, ClientError, OSError) as e:
        return ["unreachable", str(e)[:60]]
    role = info.get("brokerRole", "?")
    lag_bytes, lag_ms = int(info.get("haLagBytes", "-1")), info.get("haLagMs")
    if role == "SLAVE":
        if info.get("haConnected") != "True":
            return [role, f"not connected to {info.get('haMasterAddr') or 'a master'}"]
        return [role, f"{lag_bytes:,} bytes behind" if lag_bytes >= 0 else "connected"]
    if lag_bytes < 0:
        return [role, "no slave connected"]
    return [role, f"best slave {lag_bytes:,} bytes, {lag_ms} ms behind"]


def run_admin(args: argparse.Namespace) -> int:
    try:
        return _run_verb(args)
    except NotANameServer as e:
        print(f"chronomq admin: {_not_a_namesrv_text(e, args)}", file=sys.stderr)
    except (AdminError, ClientError, ValueError) as e:
        print(f"chronomq admin: {e}", file=sys.stderr)
    return 1


def add_admin_parsers(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="verb", required=True)

    def common(sp: argparse.ArgumentParser, broker: bool = True) -> None:
        sp.add_argument("-n", "--namesrv", default="127.0.0.1:9876", help="name server HOST:PORT")
        sp.add_argument("--access-key", help="ACL access key (or CHRONOMQ_ACCESS_KEY)")
        sp.add_argument("--secret-key", help="ACL secret key (better: CHRONOMQ_SECRET_KEY)")
        sp.add_argument("--tls", nargs="?", const=True, default=None, metavar="CAFILE",
                        help="connect over TLS (docs/tls.md); with CAFILE, verify the servers' certificates "
                             "against it (without, they are not verified, as RocketMQ's clients do)")
        if broker:
            sp.add_argument("-b", "--broker", help="ask this broker HOST:PORT directly")

    sp = sub.add_parser("delay-stats", help="per-level delay statistics of every master broker")
    common(sp)
    sp.add_argument("--json", action="store_true", help="print JSON instead of a table (times in epoch ms)")
    add_epoch_ms_arg(sp)
    common(sub.add_parser("cluster", help="brokers registered with the name server"), broker=False)
    common(sub.add_parser("topics", help="topics known to the name server"), broker=False)
    sp = sub.add_parser("route", help="the route of a topic")
    common(sp, broker=False)
    sp.add_argument("topic")
    sp = sub.add_parser("update-topic", help="create or update a topic on the broker(s)")
    common(sp)
    sp.add_argument("topic")
    sp.add_argument("--queues", type=int, default=4)
    sp.add_argument("--perm", type=int, default=6)
    sp = sub.add_parser("broker-status", help="runtime figures of the broker(s)")
    common(sp)
    add_epoch_ms_arg(sp)
    sp = sub.add_parser("promote", help="make a slave the master of its broker name (the old master is down)")
    common(sp)
    sp.add_argument("--role", choices=["ASYNC_MASTER", "SYNC_MASTER"], default="ASYNC_MASTER")
    sp = sub.add_parser("consumer-progress", help="committed offsets and lag of a consumer group")
    common(sp)
    add_epoch_ms_arg(sp)
    sp.add_argument("-g", "--group", required=True)
    sp = sub.add_parser("reset-offset", help="move a consumer group's offsets on a topic to a point in time",
                        description="Each broker serving the topic moves the group's offset on each queue to "
                        "the first message stored at or after --timestamp, commits it and tells the group's "
                        "online consumers, which start again from there (RocketMQ's resetOffsetByTime).")
    common(sp)
    sp.add_argument("-g", "--group", required=True)
    sp.add_argument("-t", "--topic", required=True)
    sp.add_argument("--timestamp", required=True, help="ISO-8601 (naive = UTC) or epoch milliseconds")
    sp.add_argument("--only-back", action="store_true",
                    help="move a queue only if that goes back (RocketMQ's force=false)")
    add_epoch_ms_arg(sp)
    add_timer_parsers(sub, common)
    add_auth_parsers(sub, common)
