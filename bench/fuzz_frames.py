"""Hostile remoting traffic against a fresh `chronomq start`: frames with hostile values, garbage headers
and broken streams (tests/integration/frame_fuzz.py) over many connections, to the broker and to the name
server. Prints frames sent, answers, connections the server closed, the probes between rounds, answers
carrying a traceback (must be 0), and the process's RSS before and after. Then a connection flood to
each (5,000 connections from 127.0.0.1, slow-loris connections and requests from 127.0.0.2 meanwhile):
connections kept, slow ones closed, the server's open files and RSS before, during and after.

    .venv/bin/python bench/fuzz_frames.py              # 100,000 frames to each
    .venv/bin/python bench/fuzz_frames.py --full       # 1,000,000 frames to each
    .venv/bin/python bench/fuzz_frames.py --frames 0 --flood 5000 --set serverMaxConnectionsPerIp=0
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    from tests.compat.harness import ChronomqProcess
    from tests.integration.frame_fuzz import connection_flood, flood, rss_bytes, seed_from_env

    from chronomq.config import BrokerConfig
    from chronomq.remoting.server import raise_open_file_limit

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--full", action="store_true", help="1,000,000 frames to each")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--flood", type=int, default=5000, help="connections of the flood round (0: none)")
    ap.add_argument("--slow", type=int, default=20, help="slow-loris connections during the flood")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a broker key")
    a = ap.parse_args()
    frames = 1_000_000 if a.full else a.frames
    overrides = dict(item.split("=", 1) for item in a.set)
    config, _ = BrokerConfig.load(None, overrides)
    per_ip = config.serverMaxConnectionsPerIp or config.serverMaxConnections or a.flood
    raise_open_file_limit()  # this process holds the flood's sockets
    p = ChronomqProcess(Path(tempfile.mkdtemp(prefix="chronomq-fuzz-")) / "data", overrides)
    p.start()
    bad = 0
    try:
        for name, addr, code in (("broker", p.broker_addr, 28), ("namesrv", p.namesrv_addr, 106)):
            host, _, port = addr.rpartition(":")
            pid = p.pid or 0
            if not frames:
                continue
            before, anon_before = rss_bytes(pid), rss_bytes(pid, "RssAnon")
            s = flood((host, int(port)), frames, a.connections, seed_from_env(), code,
                      rounds=max(10, frames // 5000), max_seconds=3600)
            after, anon_after = rss_bytes(pid), rss_bytes(pid, "RssAnon")
            ok = p.running and not s.probes_failed and not s.tracebacks
            bad += not ok
            print(f"{name}: {s.frames:,} frames ({s.structured:,} well formed) over {s.connections:,} "
                  f"connections in {s.seconds:.0f} s; {s.answered:,} answers; "
                  f"{s.closed_by_server:,} closed by the server; "
                  f"probes {s.probes_ok} ok, {len(s.probes_failed)} failed; tracebacks {len(s.tracebacks)}; "
                  f"RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB (heap {anon_before / 2**20:.1f} -> "
                  f"{anon_after / 2**20:.1f} MiB); {'up' if p.running else 'DOWN'}")
        for name, addr, code in (("broker", p.broker_addr, 28), ("namesrv", p.namesrv_addr, 106)):
            if not a.flood:
                break
            host, _, port = addr.rpartition(":")
            keep = min(per_ip, a.flood)
            c = connection_flood((host, int(port)), p.pid or 0, a.flood, keep, code, slow=a.slow,
                                 slow_interval=1.0, max_seconds=300)
            during_ok = sum(x == 0 for x in c.probes_during)
            ok = (p.running and c.kept <= keep and during_ok == len(c.probes_during) and c.probe_after == 0
                  and c.slow_closed == c.slow)
            bad += not ok
            mib = [f"{r / 2**20:.1f}" for r in c.rss]
            print(f"{name} flood: {c.opened:,} connections from 127.0.0.1, {c.kept:,} kept, "
                  f"{c.opened - c.kept:,} refused; requests from 127.0.0.2 meanwhile {during_ok}/"
                  f"{len(c.probes_during)} answered; slow-loris {c.slow_closed}/{c.slow} closed; after the "
                  f"flood: {'answered' if c.probe_after == 0 else c.probe_after}; open files "
                  f"{c.fds[0]} -> {c.fds[1]} -> {c.fds[2]}; RSS {' -> '.join(mib)} MiB; {c.seconds:.0f} s; "
                  f"{'up' if p.running else 'DOWN'}")
    finally:
        p.stop()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
