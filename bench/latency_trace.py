"""Where the milliseconds go between a timed message's due time and the consumer's listener.

Starts ``chronomq start`` in a child process with a tracer installed from outside (it wraps a few broker
methods and records wall-clock timestamps; the product has no tracing hooks), sends N messages due at
the same millisecond with ``chronomq.client`` and receives them with a PushConsumer, then prints, for
the first and the last message, how long after the due time each stage finished:

    staged       the timer read and encoded them ahead of their time (negative: before the due time)
    timer take   the timer's delivery loop took the due entries from its window (woke up)
    store put    the timer's batch was appended to the commit log (put_records)
    dispatch     their consume-queue entries were written (reput)
    pull wake    a held pull of the queue was woken
    pull answer  the broker built a FOUND pull response
    answer written  the broker's event loop wrote an answer holding a message to the client's socket
    client read  the client's read of the connection returned bytes holding a message
    client decoded  the client decoded a pull answer holding messages
    listener     the consumer's listener ran (client side)

    .venv/bin/python bench/latency_trace.py [--n 1,1000] [--repeat 5] [--set key=value ...] [--no-trace]

The client's stages are recorded in this process the same way (its connection reads and its pull
answers' decoding wrapped). Each scenario runs ``--repeat`` times on one broker; the table gives the
median over the runs, and the CPU the broker (from /proc) and the client process (producer idle by then)
spent from 300 ms before the due time until the last receipt, which on a loaded machine compares two
builds better than wall time.
``--no-trace`` runs the broker without the tracer (only the lateness and CPU figures). Real clock,
loopback only, bounded: every wait has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STAGES = ("staged", "timer take", "store put", "dispatch", "pull wake", "pull answer", "answer written",
          "client read", "client decoded", "listener")
BODY = 1024  # the bench's message bodies: a write or a read of more bytes than this holds a message


# --- the broker side: install the tracer, then run `chronomq start` -------------------------------------
def _wrap(cls: Any, name: str, stage: str, events: list[tuple[str, int]],
          keep: Any = lambda res, args: True) -> None:
    orig = getattr(cls, name, None)
    if orig is None:
        print(f"latency_trace: {cls.__name__}.{name} not found; stage '{stage}' not traced", file=sys.stderr)
        return

    def traced(self: Any, *args: Any, **kw: Any) -> Any:
        res = orig(self, *args, **kw)
        if keep(res, args):
            events.append((stage, time.time_ns()))
        return res

    setattr(cls, name, traced)


def serve_traced(out: str, argv: list[str]) -> None:
    from chronomq.broker.longpoll import PullHoldService
    from chronomq.broker.processors.pull import PullProcessor
    from chronomq.cli.main import main
    from chronomq.delay.timer.store import TimerStore
    from chronomq.remoting.codes import ResponseCode
    from chronomq.remoting.server import Connection
    from chronomq.store.message_store import MessageStore

    try:  # the dispatcher (reput) lives in its own module; older trees kept it in the facade
        from chronomq.store.reput import ReputMessageService as dispatcher
        dispatch_method = "dispatch"
    except ImportError:
        dispatcher, dispatch_method = MessageStore, "_dispatch"

    events: list[tuple[str, int]] = []
    # poll also serves staging, with a horizon ahead of the clock: only polls for due items count
    _wrap(TimerStore, "poll", "timer take", events,
          lambda res, args: bool(res[0]) and args[0] <= time.time_ns() // 1_000_000 + 1)
    _wrap(TimerStore, "stage", "staged", events, lambda res, args: res > 0)
    _wrap(TimerStore, "deliver_staged", "timer take", events, lambda res, args: res[0] > 0)
    _wrap(TimerStore, "deliver_staged", "store put", events, lambda res, args: res[0] > 0)
    _wrap(TimerStore, "deliver_many", "store put", events)
    _wrap(dispatcher, dispatch_method, "dispatch", events)
    _wrap(PullProcessor, "_pull_once", "pull answer", events,
          lambda res, args: res[0].code == ResponseCode.SUCCESS)
    orig_flush = Connection._flush

    def flush(self: Any) -> None:
        holds = self._out_bytes > BODY
        orig_flush(self)
        if holds:
            events.append(("answer written", time.time_ns()))

    Connection._flush = flush
    orig_notify = PullHoldService.notify

    def notify(self: Any, topic: str, queue_id: int, max_offset: int) -> None:
        if self._waiters.get((topic, queue_id)):
            events.append(("pull wake", time.time_ns()))
        orig_notify(self, topic, queue_id, max_offset)

    PullHoldService.notify = notify  # type: ignore[method-assign]

    def dump() -> None:
        done = 0
        while True:
            time.sleep(0.05)
            n = len(events)
            if n > done:
                with open(out, "a") as f:
                    f.writelines(f"{s}\t{t}\n" for s, t in events[done:n])
                done = n

    threading.Thread(target=dump, daemon=True).start()
    sys.argv = ["chronomq", *argv]
    main()


# --- the client side -------------------------------------------------------------------------------------
def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used so far, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Run = tuple[int, list[int], float, float]  # due ms, receipts (ns), broker CPU s, client CPU s


@contextlib.contextmanager
def _client_traced(events: list[tuple[str, int]]) -> Iterator[None]:
    """Record when this process's connection reads return a message's bytes and when a pull answer with
    messages is decoded (the client's stages), for the duration."""
    from chronomq.client import ops

    orig_read, orig_result = asyncio.StreamReader.read, ops.pull_result

    async def read(self: asyncio.StreamReader, n: int = -1) -> bytes:
        data = await orig_read(self, n)
        if len(data) > BODY:
            events.append(("client read", time.time_ns()))
        return data

    def pull_result(*args: Any, **kw: Any) -> Any:
        res = orig_result(*args, **kw)
        if res.messages:
            events.append(("client decoded", time.time_ns()))
        return res

    asyncio.StreamReader.read = read  # type: ignore[method-assign]
    ops.pull_result = pull_result
    try:
        yield
    finally:
        asyncio.StreamReader.read = orig_read  # type: ignore[method-assign]
        ops.pull_result = orig_result


async def _scenario(ns: str, topic: str, n: int, repeat: int, lead_ms: int, broker_pid: int) -> list[Run]:
    """Send ``n`` messages due at one ms, ``repeat`` times; returns, per run, the due ms, the receipts
    and the CPU of the broker and of this process from 300 ms before the due time to the last receipt."""
    from chronomq.client import Message, Producer, PushConsumer

    got: list[int] = []
    want = [4]  # the receipts that complete the current step
    done = asyncio.Event()

    async def listener(msg: Any) -> None:
        got.append(time.time_ns())
        if len(got) == want[0]:
            done.set()

    consumer = PushConsumer(f"trace_c_{topic}", {topic: "*"}, listener, namesrv=ns, consume_from="first",
                            concurrency=64, pull_batch_size=32)
    producer = Producer(f"trace_p_{topic}", namesrv=ns)
    await consumer.start()
    await producer.start()
    runs = []
    try:
        for _ in range(4):  # create the topic's queues and wait until the consumer pulls them all
            await producer.send(Message(topic=topic, body=b"warm-up"))
        deadline = time.monotonic() + 60
        while len(got) < 4:
            if time.monotonic() > deadline:
                raise RuntimeError("the consumer did not receive the warm-up messages within 60 s")
            await asyncio.sleep(0.05)
        for _ in range(repeat):
            await asyncio.sleep(0.3)
            got.clear()
            done.clear()
            want[0] = n
            due = _now_ms() + lead_ms
            body = b"x" * 1024
            for i in range(0, n, 100):
                await producer.send_batch([Message(topic=topic, body=body, deliver_at=due)
                                           for _ in range(min(100, n - i))])
            if _now_ms() >= due:
                raise RuntimeError(f"sending {n} took longer than the {lead_ms} ms lead; raise --lead-ms")
            # the CPU from 300 ms before the due time: the staging ahead of it counts, the sends' aftermath
            # (the timer's flush of what they parked) mostly not
            await asyncio.sleep(max(0, due - 300 - _now_ms()) / 1000)
            cpu_b, cpu_c = _cpu_s(broker_pid), time.process_time()
            try:  # woken by the n-th receipt: no polling on the consumer's loop
                await asyncio.wait_for(done.wait(), (due - _now_ms()) / 1000 + 30)
            except TimeoutError:
                raise RuntimeError(f"received {len(got)} of {n} within 30 s of the due time") from None
            runs.append((due, list(got), _cpu_s(broker_pid) - cpu_b, time.process_time() - cpu_c))
    finally:
        await consumer.close()
        await producer.close()
    return runs


def _breakdown(events: list[tuple[str, int]], due_ms: int, receipts: list[int]
               ) -> dict[str, tuple[float, float]]:
    lo = due_ms * 1_000_000
    hi = max(receipts)
    out: dict[str, tuple[float, float]] = {}
    for stage in STAGES[:-1]:
        # staging happens timerStageAheadMs (50 ms by default) before the due time; the runs are 1 s apart
        start = lo - 1_000_000_000 if stage == "staged" else lo
        ts = [t for s, t in events if s == stage and start <= t <= hi]
        if ts:
            out[stage] = ((min(ts) - lo) / 1e6, (max(ts) - lo) / 1e6)
    out["listener"] = ((min(receipts) - lo) / 1e6, (hi - lo) / 1e6)
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-traced":
        serve_traced(sys.argv[2], sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="1,1000", help="comma-separated batch sizes (messages due at one ms)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--lead-ms", type=int, default=1000, help="due time = end of the warm-up + this")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="broker setting")
    ap.add_argument("--no-trace", action="store_true", help="run the broker without the tracer")
    args = ap.parse_args()
    from tests.compat.harness import ChronomqProcess

    with tempfile.TemporaryDirectory(prefix="chronomq-trace-") as tmp:
        trace = Path(tmp) / "events.tsv"
        me = Path(__file__).resolve()
        if not args.no_trace:
            os.environ["CHRONOMQ_COMPAT_START"] = f"{sys.executable} {me} --serve-traced {trace}"
        overrides = dict(kv.split("=", 1) for kv in args.set)
        proc = ChronomqProcess(Path(tmp) / "data", overrides)
        proc.start()
        try:
            print(f"broker pid {proc.pid}; load average {os.getloadavg()[0]:.2f}")
            for n in (int(x) for x in args.n.split(",")):
                assert proc.pid is not None
                events: list[tuple[str, int]] = []
                with contextlib.ExitStack() as stack:
                    if not args.no_trace:
                        stack.enter_context(_client_traced(events))
                    runs = asyncio.run(_scenario(proc.namesrv_addr, f"Trace{n}", n, args.repeat,
                                                 args.lead_ms, proc.pid))
                if not args.no_trace:
                    time.sleep(0.2)  # the tracer writes its events every 50 ms
                    events += [(s, int(t)) for s, t in (ln.rstrip("\n").split("\t") for ln in trace.open())]
                per_run = [_breakdown(events, due, rec) for due, rec, _, _ in runs]
                lat = sorted((t / 1e6 - due) for due, rec, _, _ in runs for t in rec)
                early = sum(1 for x in lat if x < 0)
                p50, p99 = lat[len(lat) // 2], lat[int(len(lat) * 0.99)]
                print(f"\n{n} message(s) due at the same ms, {len(runs)} runs: lateness p50 {p50:.1f} ms, "
                      f"p99 {p99:.1f} ms, max {lat[-1]:.1f} ms, early {early}")
                print(f"  {'stage (ms after due, median of runs)':40} {'first':>8} {'last':>8}")
                for stage in STAGES:
                    vals = [r[stage] for r in per_run if stage in r]
                    if vals:
                        first = statistics.median(v[0] for v in vals)
                        last = statistics.median(v[1] for v in vals)
                        print(f"  {stage:40} {first:8.1f} {last:8.1f}")
                cpu_b = [round(b * 1000) for _, _, b, _ in runs]
                cpu_c = [round(c * 1000) for _, _, _, c in runs]
                print(f"  CPU ms from 300 ms before the due time to the last receipt: broker median "
                      f"{statistics.median(cpu_b):.0f} {cpu_b}, client median {statistics.median(cpu_c):.0f} "
                      f"{cpu_c}")
        finally:
            proc.stop()


if __name__ == "__main__":
    main()
