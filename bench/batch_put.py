"""The broker's CPU per message for batch puts as the Spark sink makes them: batches of 1 KiB rows (the
sink's default batchSize, or --batch-size), each row with its UNIQ_KEY (row_uniq_keys, as the sink derives
it), with and without de-duplication (CHRONOMQ_DEDUP=true), sent by chronomq.client's
``send_encoded_batch`` with bodies from ``encode_rows`` (the sink's own calls) and 8 sends in flight (the
sink's maxInFlight). Prints the broker process's CPU (utime + stime from /proc, all its threads) per
message for each phase, phases interleaved (dedup, plain, plain, dedup, ...), and the medians with their
spread.

    .venv/bin/python bench/batch_put.py [--batches 300] [--rounds 3] [--batch-size N] [--src DIR ...]
        [--profile FILE]

``--src DIR`` (repeatable) runs one broker per checkout's ``src`` directory (the bench's own by default),
all started together and measured in turns: A against B under the same load. ``--profile FILE`` records
the first broker with py-spy (/tmp/tools/bin/py-spy or $PY_SPY; ``--native``) during one more
de-duplicated phase and writes its flame graph. ``--pure`` runs the brokers without the compiled
kernels. Each phase is a few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.compat.harness import ChronomqProcess

from chronomq.client import Producer, encode_rows
from chronomq.spark.options import OPTIONS

SINK_BATCH = next(int(o.default or 0) for o in OPTIONS if o.name == "batchSize")
BATCH = SINK_BATCH  # rows a batch (main sets it from --batch-size)
IN_FLIGHT = 8  # the sink's maxInFlight default
SIZE = 1024


def row_uniq_keys(query_id: str, batch_id: int, partition_id: int, first_row: int, n: int) -> list[str]:
    """chronomq.spark.schema.row_uniq_keys (used from there when PySpark imports; the same text)."""
    try:
        from chronomq.spark.schema import row_uniq_keys as sink_keys
    except ImportError:
        pass
    else:
        return sink_keys(query_id, batch_id, partition_id, first_row, n)
    head = hashlib.blake2b(f"{query_id}\x00{batch_id}\x00{partition_id}\x00".encode(), digest_size=16)
    out = []
    for row in range(first_row, first_row + n):
        h = head.copy()
        h.update(str(row).encode())
        out.append(h.hexdigest().upper())
    return out


def cpu_s(pid: int) -> float:
    """utime + stime of a process in seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bodies(batches: int, query_id: str, dedup: bool) -> list[tuple[bytes, list[str]]]:
    """``batches`` batch bodies of BATCH rows of 1 KiB (value only, as bench/spark_io.py writes them)."""
    out = []
    for b in range(batches):
        first = b * BATCH
        values = [f"{first + i:012d}".encode() + b"x" * (SIZE - 12) for i in range(BATCH)]
        ids = row_uniq_keys(query_id, 0, 0, first, BATCH)
        out.append((encode_rows(values, ids, dedup=dedup, row_numbers=range(first, first + BATCH)), ids))
    return out


async def send_all(producer: Producer, topic: str, work: list[tuple[bytes, list[str]]]) -> None:
    it = iter(work)

    async def lane() -> None:
        for data, ids in it:
            await producer.send_encoded_batch(topic, data, ids)

    await asyncio.gather(*(lane() for _ in range(IN_FLIGHT)))


async def phase(producer: Producer, topic: str, pid: int, work: list[tuple[bytes, list[str]]]
                ) -> tuple[float, float]:
    """Send ``work``; (broker CPU µs per message, wall seconds)."""
    c0, t0 = cpu_s(pid), time.perf_counter()
    await send_all(producer, topic, work)
    c1, t1 = cpu_s(pid), time.perf_counter()
    return (c1 - c0) / (len(work) * BATCH) * 1e6, t1 - t0


def task_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """Each thread's (utime, stime) in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) / tick, int(fields[12]) / tick)
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Python thread names by native thread id, from ``py-spy dump`` (empty without it)."""
    spy = py_spy()
    if spy is None:
        return {}
    try:
        text = subprocess.run([spy, "dump", "-p", str(pid)], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    names = {}
    for line in text.splitlines():
        m = re.match(r'Thread (0x[0-9A-Fa-f]+|\d+) \([^)]*\): "([^"]*)"', line)
        if m:
            tid = m.group(1)
            names[int(tid, 16) if tid.startswith("0x") else int(tid)] = m.group(2)
    return names


async def threads(a: argparse.Namespace, server: ChronomqProcess, producer: Producer, topic: str) -> None:
    """One more de-duplicated phase: each thread's CPU a message, user and system."""
    assert server.pid is not None
    pid = server.pid
    work = bodies(a.batches, f"threads{time.time_ns()}", True)
    t0 = task_cpu(pid)
    us, _ = await phase(producer, topic, pid, work)
    t1 = task_cpu(pid)
    names = thread_names(pid)
    n = len(work) * BATCH
    print(f"a dedup phase, {us:.2f} µs a message; by thread (user + system µs a message):")
    rows = []
    for tid, (u1, s1) in t1.items():
        u0, s0 = t0.get(tid, (0.0, 0.0))
        rows.append(((u1 - u0) * 1e6 / n, (s1 - s0) * 1e6 / n, tid))
    for u, s, tid in sorted(rows, key=lambda r: -(r[0] + r[1])):
        if u + s > 0:
            name = "main (event loop)" if tid == pid else names.get(tid, "")
            print(f"  {tid:>7} {name:<40} {u:5.2f} + {s:5.2f}")


def idle_us_per_s(pid: int, seconds: float = 1.0) -> float:
    c0 = cpu_s(pid)
    time.sleep(seconds)
    return (cpu_s(pid) - c0) * 1e6 / seconds


def py_spy() -> str | None:
    for p in (os.environ.get("PY_SPY"), "/tmp/tools/bin/py-spy", shutil.which("py-spy")):
        if p and os.access(p, os.X_OK):
            return p
    return None


async def run(a: argparse.Namespace, servers: list[tuple[str, ChronomqProcess]]) -> None:
    producers = []
    for _label, server in servers:
        p = Producer("PG_batch_put", server.namesrv_addr, send_timeout=30.0)
        await p.start()
        producers.append(p)
    try:
        topic = f"BatchPut{int(time.time())}"
        for p in producers:  # the topic, the route and the connection, before any figure
            await send_all(p, topic, bodies(IN_FLIGHT * 2, "warm-up", True))
        for (label, server), _p in zip(servers, producers, strict=True):
            assert server.pid is not None
            print(f"broker {label}: pid {server.pid}, idle {idle_us_per_s(server.pid):.0f} µs of CPU a "
                  "second")
        modes = ("dedup", "plain")
        figures: dict[tuple[str, str], list[float]] = {}
        n = a.batches * BATCH
        print(f"{a.rounds} rounds of {a.batches} batches of {BATCH} x {SIZE} B ({n:,} messages) a phase, "
              f"{IN_FLIGHT} in flight; load average {os.getloadavg()[0]:.2f}")
        for r in range(a.rounds):
            order = modes if r % 2 == 0 else modes[::-1]
            for mode in order:
                for (label, server), p in zip(servers, producers, strict=True):
                    assert server.pid is not None
                    work = bodies(a.batches, f"q{r}{mode}{label}{time.time_ns()}", mode == "dedup")
                    us, wall = await phase(p, topic, server.pid, work)
                    figures.setdefault((label, mode), []).append(us)
                    print(f"  round {r} {label:>12} {mode:>5}: {us:5.2f} µs a message, "
                          f"{n / wall:8,.0f} msgs/s", flush=True)
        print(f"medians (min-max) of broker CPU a message; load average {os.getloadavg()[0]:.2f}")
        for (label, mode), xs in figures.items():
            print(f"  {label:>12} {mode:>5}: {statistics.median(xs):5.2f} µs ({min(xs):.2f}-{max(xs):.2f})")
        if a.threads:
            await threads(a, servers[0][1], producers[0], topic)
        if a.profile:
            await profile(a, servers[0][1], producers[0], topic)
    finally:
        for p in producers:
            await p.close()


async def profile(a: argparse.Namespace, server: ChronomqProcess, producer: Producer, topic: str) -> None:
    spy = py_spy()
    if spy is None:
        print("no py-spy (set PY_SPY): no profile")
        return
    assert server.pid is not None
    work = bodies(a.batches, f"profile{time.time_ns()}", True)
    cmd = [spy, "record", "-p", str(server.pid), "-o", a.profile, "-r", str(a.rate)]
    cmd.append("--native" if a.native else "--nonblocking")  # native stacks need the process paused
    if a.profile.endswith(".txt"):
        cmd += ["-f", "raw"]
    spy_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    await asyncio.sleep(1.0)  # py-spy attaches
    us, _ = await phase(producer, topic, server.pid, work)
    spy_proc.send_signal(signal.SIGINT)
    _, err = spy_proc.communicate(timeout=60)
    print(f"profile of a dedup phase ({us:.2f} µs a message) in {a.profile}; py-spy: {err.strip()[-300:]}")


def main() -> None:
    global BATCH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=300, help="batches a phase")
    ap.add_argument("--batch-size", type=int, default=SINK_BATCH,
                    help=f"rows a batch (the sink's default: {SINK_BATCH})")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each has a dedup and a plain phase")
    ap.add_argument("--src", action="append", default=[],
                    help="a checkout's src directory to run a broker from")
    ap.add_argument("--threads", action="store_true", help="one more dedup phase: CPU by thread")
    ap.add_argument("--pure", action="store_true", help="brokers without the compiled kernels")
    ap.add_argument("--profile", help="py-spy output (.svg flame graph, .txt collapsed stacks)")
    ap.add_argument("--native", action="store_true", help="with --profile: py-spy --native")
    ap.add_argument("--rate", type=int, default=500, help="with --profile: samples a second")
    a = ap.parse_args()
    BATCH = a.batch_size
    srcs = a.src or [str(Path(__file__).resolve().parents[1] / "src")]
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        servers = []
        for i, src in enumerate(srcs):
            server = ChronomqProcess(Path(d) / f"data{i}")
            server.env["PYTHONPATH"] = str(Path(src).resolve())
            if a.pure:
                server.env["CHRONOMQ_PURE_PYTHON"] = "1"
            stack.enter_context(server)
            label = Path(src).resolve().parent.name[:12] if len(srcs) > 1 else "broker"
            if label in (s[0] for s in servers):
                label = f"{label[:10]}#{i}"
            servers.append((label, server))
        asyncio.run(run(a, servers))


if __name__ == "__main__":
    main()
