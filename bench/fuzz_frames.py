"""Hostile remoting traffic against a fresh `chronomq start`: frames with hostile values, garbage headers
and broken streams (tests/integration/frame_fuzz.py) over many connections, to the broker and to the name
server. Prints frames sent, answers, connections the server closed, the probes between rounds, answers
carrying a traceback (must be 0), and the process's RSS before and after.

    .venv/bin/python bench/fuzz_frames.py              # 100,000 frames to each
    .venv/bin/python bench/fuzz_frames.py --full       # 1,000,000 frames to each
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
    from tests.integration.frame_fuzz import flood, rss_bytes, seed_from_env

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--full", action="store_true", help="1,000,000 frames to each")
    ap.add_argument("--connections", type=int, default=32)
    a = ap.parse_args()
    frames = 1_000_000 if a.full else a.frames
    p = ChronomqProcess(Path(tempfile.mkdtemp(prefix="chronomq-fuzz-")) / "data")
    p.start()
    bad = 0
    try:
        for name, addr, code in (("broker", p.broker_addr, 28), ("namesrv", p.namesrv_addr, 106)):
            host, _, port = addr.rpartition(":")
            pid = p.pid or 0
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
    finally:
        p.stop()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
