"""``chronomq admin``: a few administration verbs over the remoting protocol (blocking sockets)."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any

from chronomq.remoting.codec import FrameDecoder, FrameError, RemotingCommand, encode
from chronomq.remoting.codes import RequestCode


class AdminError(Exception):
    pass


def invoke(addr: str, cmd: RemotingCommand, timeout: float = 5.0) -> RemotingCommand:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise AdminError(f"bad address {addr!r}: expected HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.sendall(encode(cmd))
            dec = FrameDecoder()
            while True:
                data = s.recv(65536)
                if not data:
                    raise AdminError(f"{addr} closed the connection")
                for item in dec.feed(data):
                    if isinstance(item, FrameError):
                        raise AdminError(f"bad response from {addr}: {item}")
                    if item.opaque == cmd.opaque and item.is_response:
                        return item
    except TimeoutError:
        raise AdminError(f"{addr} did not answer within {timeout:g} s") from None
    except OSError as e:
        raise AdminError(f"cannot reach {addr}: {e.strerror or e}") from None


def call(addr: str, code: int, ext: dict[str, Any] | None = None, body: bytes = b"") -> RemotingCommand:
    resp = invoke(addr, RemotingCommand.request(code, ext or {}, body))
    if resp.code != 0:
        raise AdminError(f"{addr} answered code {resp.code}: {resp.remark or ''}")
    return resp


def _json(resp: RemotingCommand) -> Any:
    try:
        return json.loads(resp.body) if resp.body else {}
    except ValueError as e:
        raise AdminError(f"response body is not JSON: {e}") from None


def master_brokers(namesrv: str) -> list[tuple[str, str]]:
    info = _json(call(namesrv, RequestCode.GET_BROKER_CLUSTER_INFO))
    out = []
    for name, bd in sorted((info.get("brokerAddrTable") or {}).items()):
        addr = (bd.get("brokerAddrs") or {}).get("0")
        if addr:
            out.append((name, addr))
    return out


def _targets(args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.broker:
        return [(args.broker, args.broker)]
    brokers = master_brokers(args.namesrv)
    if not brokers:
        raise AdminError(f"no broker is registered with the name server {args.namesrv}")
    return brokers


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(h).rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _fmt_ms(v: Any) -> str:
    if v is None or v == -1 or v == "":
        return "-"
    try:
        ms = int(v)
    except (TypeError, ValueError):
        return str(v)
    if ms % 3_600_000 == 0 and ms:
        return f"{ms // 3_600_000}h"
    if ms % 60_000 == 0 and ms:
        return f"{ms // 60_000}m"
    if ms % 1000 == 0 and ms:
        return f"{ms // 1000}s"
    return f"{ms}ms"


def delay_stats_table(stats: dict[str, Any]) -> str:
    rows = []
    for lv in stats.get("levels") or []:
        lat = lv.get("lateness_ms") or {}
        rows.append(
            [
                str(lv.get("level", "")),
                _fmt_ms(lv.get("delay_ms")),
                str(lv.get("pending", 0)),
                str(
                    lv.get("oldest_pending_deliver_ms", "-")
                    if lv.get("oldest_pending_deliver_ms") not in (None, -1)
                    else "-"
                ),
                str(lv.get("delivered", 0)),
                str(lat.get("count", 0)),
                str(lat.get("p50", "-")),
                str(lat.get("p99", "-")),
                str(lat.get("max", "-")),
            ]
        )
    header = [
        "level",
        "delay",
        "pending",
        "oldest_deliver_ms",
        "delivered",
        "n",
        "late_p50",
        "late_p99",
        "late_max",
    ]
    extra = {k: v for k, v in stats.items() if k not in ("levels", "timer")}
    from .admin_timer import timer_stats_text  # the timer store's part (issue 7)

    timer = timer_stats_text(stats.get("timer"))
    return (_table(rows, header) + "\n" + "  ".join(f"{k}={v}" for k, v in extra.items())
            + ("\n" + timer if timer else ""))


def run_admin(args: argparse.Namespace) -> int:
    try:
        verb = args.verb
        if verb == "delay-stats":
            for name, addr in _targets(args):
                stats = _json(call(addr, RequestCode.CHRONOMQ_DELAY_STATS))
                if args.json:
                    print(json.dumps({"broker": name, "addr": addr, "stats": stats}))
                else:
                    print(f"broker {name} ({addr})")
                    print(delay_stats_table(stats))
        elif verb == "cluster":
            info = _json(call(args.namesrv, RequestCode.GET_BROKER_CLUSTER_INFO))
            rows = []
            for cluster, names in sorted((info.get("clusterAddrTable") or {}).items()):
                for n in names:
                    bd = (info.get("brokerAddrTable") or {}).get(n) or {}
                    for bid, addr in sorted((bd.get("brokerAddrs") or {}).items()):
                        rows.append([cluster, n, str(bid), addr])
            print(_table(rows, ["cluster", "broker", "id", "address"]))
        elif verb == "topics":
            for t in _json(call(args.namesrv, RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER)).get(
                "topicList", []
            ):
                print(t)
        elif verb == "route":
            print(
                json.dumps(
                    _json(call(args.namesrv, RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": args.topic})),
                    indent=1,
                )
            )
        elif verb == "update-topic":
            for _, addr in _targets(args):
                call(
                    addr,
                    RequestCode.UPDATE_AND_CREATE_TOPIC,
                    {
                        "topic": args.topic,
                        "readQueueNums": args.queues,
                        "writeQueueNums": args.queues,
                        "perm": args.perm,
                    },
                )
                print(f"topic {args.topic} updated on {addr}")
        elif verb == "consumer-progress":
            rows = []
            for name, addr in _targets(args):
                table = _json(call(addr, RequestCode.GET_ALL_CONSUMER_OFFSET)).get("offsetTable", {})
                clients = invoke(
                    addr,
                    RemotingCommand.request(
                        RequestCode.GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": args.group}
                    ),
                )
                online = len(_json(clients).get("consumerIdList", [])) if clients.code == 0 else 0
                for key, queues in sorted(table.items()):
                    topic, _, group = key.rpartition("@")
                    if group != args.group:
                        continue
                    for q, committed in sorted(queues.items(), key=lambda kv: int(kv[0])):
                        mx = int(
                            call(
                                addr, RequestCode.GET_MAX_OFFSET, {"topic": topic, "queueId": q}
                            ).ext_fields.get("offset", 0)
                        )
                        rows.append(
                            [
                                name,
                                topic,
                                str(q),
                                str(mx),
                                str(committed),
                                str(max(0, mx - int(committed))),
                                str(online),
                            ]
                        )
            if not rows:
                print(f"no committed offsets for group {args.group}")
            else:
                print(_table(rows, ["broker", "topic", "queue", "max", "committed", "lag", "online"]))
        elif verb == "broker-status":
            for name, addr in _targets(args):
                table = _json(call(addr, RequestCode.GET_BROKER_RUNTIME_INFO)).get("table", {})
                print(f"broker {name} ({addr})")
                for k, v in sorted(table.items()):
                    print(f"  {k:28s} {v}")
        elif verb in ("cancel", "reschedule", "pending"):
            from .admin_timer import run_timer_verb  # timer store verbs (issue 7)

            return run_timer_verb(args) or 0
        else:
            print(f"unknown admin verb {verb!r}", file=sys.stderr)
            return 2
    except AdminError as e:
        print(f"chronomq admin: {e}", file=sys.stderr)
        return 1
    return 0


def add_admin_parsers(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="verb", required=True)

    def common(sp: argparse.ArgumentParser, broker: bool = True) -> None:
        sp.add_argument("-n", "--namesrv", default="127.0.0.1:9876", help="name server HOST:PORT")
        if broker:
            sp.add_argument("-b", "--broker", help="ask this broker HOST:PORT directly")

    sp = sub.add_parser("delay-stats", help="per-level delay statistics of every master broker")
    common(sp)
    sp.add_argument("--json", action="store_true", help="print JSON instead of a table")
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
    common(sub.add_parser("broker-status", help="runtime figures of the broker(s)"))
    sp = sub.add_parser("consumer-progress", help="committed offsets and lag of a consumer group")
    common(sp)
    sp.add_argument("-g", "--group", required=True)
    from .admin_timer import add_timer_parsers  # cancel, reschedule, pending (issue 7)

    add_timer_parsers(sub, common)
