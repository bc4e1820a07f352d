"""chronomq.client vs the official 4.x client (PyPI rocketmq==0.4.4, C++ core) on the same chronomq
and the same workload: 1 KiB messages, single sync sends, async sends (64 in flight), batches of 64,
and a push consumer draining a topic. Prints both figures side by side with the ratio ours/theirs.

    .venv/bin/python bench/client.py [--quick] [--uvloop] [--count N]
    .venv/bin/python bench/client.py --drain N [--profile FILE]

``--drain N`` measures only our push consumer (the configuration of ``python -m bench.compare``:
concurrency=64, pull_batch_size=32, long_poll_timeout=5) draining a pre-filled backlog of N 1 KiB
messages: messages/s, and CPU microseconds per message of this process (time.process_time) and of the
broker process (/proc/<pid>/stat), so an optimisation can be judged on CPU time, not noisy wall time.

The official client runs in its own venv (tests/compat/harness.official_python) as a subprocess; ours
runs in this process. Both talk to one `chronomq start` on loopback (ASYNC_FLUSH).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.compat.harness import ChronomqProcess, run_driver

from chronomq.client import Message, Producer, PushConsumer

# 1 KiB of base64 text: printable (the official wrapper's body getter stops at NUL) and hardly
# compressible, so neither client gains from compressing batches (the C++ client zlib-compresses a
# whole batch above 4 KiB; Java clients and chronomq.client never compress batches)
BODY = base64.b64encode(os.urandom(1024))[:1024]


async def ours_sync(ns: str, topic: str, count: int) -> float:
    async with Producer("PG_ours_sync", ns) as p:
        await p.send(Message(topic, BODY))
        t0 = time.monotonic()
        for _ in range(count):
            await p.send(Message(topic, BODY))
        return count / (time.monotonic() - t0)


def ours_blocking(ns: str, topic: str, count: int) -> float:
    with Producer("PG_ours_block", ns) as p:
        p.send(Message(topic, BODY))
        t0 = time.monotonic()
        for _ in range(count):
            p.send(Message(topic, BODY))
        return count / (time.monotonic() - t0)


async def ours_async(ns: str, topic: str, count: int, window: int = 64) -> float:
    async with Producer("PG_ours_async", ns) as p:
        await p.send(Message(topic, BODY))
        sem = asyncio.Semaphore(window)

        async def one() -> None:
            async with sem:
                await p.send(Message(topic, BODY))

        t0 = time.monotonic()
        await asyncio.gather(*(one() for _ in range(count)))
        return count / (time.monotonic() - t0)


async def ours_batch(ns: str, topic: str, count: int, size: int = 64) -> float:
    async with Producer("PG_ours_batch", ns) as p:
        await p.send(Message(topic, BODY))
        t0 = time.monotonic()
        sent = 0
        while sent < count:
            n = min(size, count - sent)
            await p.send_batch([Message(topic, BODY) for _ in range(n)])
            sent += n
        return count / (time.monotonic() - t0)


async def ours_consume(ns: str, topic: str, count: int, group: str) -> float:
    got = 0
    done = asyncio.Event()

    def listener(_msg: object) -> None:
        nonlocal got
        got += 1
        if got >= count:
            done.set()

    async def alistener(msg: object) -> None:
        listener(msg)

    t0 = time.monotonic()
    async with PushConsumer(group, topic, alistener, ns, consume_from="first", concurrency=64):
        await asyncio.wait_for(done.wait(), 300)
        elapsed = time.monotonic() - t0
    return count / elapsed


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of a process in seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def ours_drain(ns: str, topic: str, count: int, group: str, broker_pid: int,
                     profile: str | None = None) -> dict[str, float]:
    """Drain a pre-filled topic with the bench.compare consumer configuration; CPU per message."""
    got = 0
    done = asyncio.Event()

    async def listener(_msg: object) -> None:
        nonlocal got
        got += 1
        if got >= count:
            done.set()

    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
    b0, c0, t0 = _proc_cpu_s(broker_pid), time.process_time(), time.monotonic()
    if prof is not None:
        prof.enable()
    async with PushConsumer(group, {topic: "*"}, listener, ns, consume_from="first", concurrency=64,
                            pull_batch_size=32, long_poll_timeout=5.0):
        await asyncio.wait_for(done.wait(), 300)
        elapsed = time.monotonic() - t0
        c1, b1 = time.process_time(), _proc_cpu_s(broker_pid)
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)  # type: ignore[arg-type]
    return {"msgs_per_s": count / elapsed, "client_us": (c1 - c0) / count * 1e6,
            "broker_us": (b1 - b0) / count * 1e6}


async def _produce_at_rate(ns: str, topic: str, rate: int, seconds: float) -> None:
    async with Producer("PG_tail", ns) as p:
        await p.send(Message(topic, BODY))
        step = 0.005
        per = max(1, round(rate * step))
        t0 = time.monotonic()
        n = 0
        while n < rate * seconds:
            await p.send_batch([Message(topic, BODY) for _ in range(per)])
            n += per
            await asyncio.sleep(max(0.0, t0 + n / rate - time.monotonic()))


def _producer_process(ns: str, topic: str, rate: int, seconds: float) -> None:
    asyncio.run(_produce_at_rate(ns, topic, rate, seconds))


async def ours_tail(ns: str, topic: str, rate: int, seconds: float, broker_pid: int) -> dict[str, float]:
    """Our push consumer following a topic written at ``rate`` msg/s by another process (batches every
    5 ms): CPU per message of this process and of the broker, and messages per FOUND pull."""
    import multiprocessing

    got = 0
    pulls = 0

    async def listener(_msg: object) -> None:
        nonlocal got
        got += 1

    async with PushConsumer("CG_tail", {topic: "*"}, listener, ns, consume_from="last", concurrency=64,
                            pull_batch_size=32, long_poll_timeout=5.0) as c:
        real_pull = getattr(c, "_pull", None)  # (absent in older consumers: per_pull then reads 0)

        async def counting_pull(pq, count, commit):  # type: ignore[no-untyped-def]
            nonlocal pulls
            assert real_pull is not None
            res = await real_pull(pq, count, commit)
            pulls += bool(res.messages)
            return res

        if real_pull is not None:
            c._pull = counting_pull  # type: ignore[method-assign]
        await asyncio.sleep(1.0)  # queues assigned, pulls held
        proc = multiprocessing.get_context("spawn").Process(target=_producer_process,
                                                            args=(ns, topic, rate, seconds))
        b0, c0 = _proc_cpu_s(broker_pid), time.process_time()
        got0 = got
        proc.start()
        await asyncio.get_running_loop().run_in_executor(None, proc.join)
        expected = got0 + int(rate * seconds) + 1
        deadline = time.monotonic() + 30
        while got < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        n = got - got0
        c1, b1 = time.process_time(), _proc_cpu_s(broker_pid)
    return {"received": n, "client_us": (c1 - c0) / n * 1e6, "broker_us": (b1 - b0) / n * 1e6,
            "per_pull": n / pulls if pulls else 0.0}


def tail_main(rate: int, seconds: float, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as d, ChronomqProcess(Path(d) / "data") as server:
        pid = server.pid
        assert pid is not None
        asyncio.run(ours_batch(server.namesrv_addr, "BenchTail", 1, 1))  # create the topic
        print(f"a producer process writes {rate} msg/s for {seconds} s (a batch every 5 ms); our consumer "
              "follows (the client CPU below is the consumer's alone)")
        for i in range(repeat):
            r = asyncio.run(ours_tail(server.namesrv_addr, "BenchTail", rate, seconds, pid))
            print(f"  run {i}: {r['received']:.0f} received, {r['per_pull']:.1f} per pull; CPU per message: "
                  f"client {r['client_us']:.1f} us, broker {r['broker_us']:.1f} us (with the sends)")


def drain_main(count: int, repeat: int, profile: str | None) -> None:
    with tempfile.TemporaryDirectory() as d, ChronomqProcess(Path(d) / "data") as server:
        ns = server.namesrv_addr
        pid = server.pid
        assert pid is not None
        asyncio.run(ours_batch(ns, "BenchDrain", count - 1, 64))  # + 1 warm-up message = count
        print(f"backlog of {count} 1 KiB messages in BenchDrain; consumer: concurrency=64, "
              "pull_batch_size=32")
        for i in range(repeat):
            r = asyncio.run(ours_drain(ns, "BenchDrain", count, f"CG_drain{i}", pid,
                                       profile if i == repeat - 1 else None))
            print(f"  run {i}: {r['msgs_per_s']:,.0f} msg/s; CPU per message: client "
                  f"{r['client_us']:.1f} us, broker {r['broker_us']:.1f} us")


def theirs(ns: str, topic: str, **args: object) -> float:
    res = run_driver("client_bench", {"namesrv": ns, "topic": topic, **args}, timeout=400)
    if args.get("role") == "consume":
        if res["count"] < int(args["count"]):  # type: ignore[call-overload]
            raise RuntimeError(f"official consumer got {res['count']} of {args['count']}")
        return res["count"] / res["elapsed_s"]
    if res["errors"]:
        print(f"  official producer ({args.get('mode')}): {res['errors']} errors, "
              f"first: {res['first_error']}")
    return res["acked"] / res["elapsed_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small counts (about a minute)")
    ap.add_argument("--uvloop", action="store_true", help="run our client on uvloop")
    ap.add_argument("--count", type=int, default=0, help="messages per single-send run")
    ap.add_argument("--repeat", type=int, default=3, help="alternating runs per workload (median)")
    ap.add_argument("--drain", type=int, default=0, help="only: our push consumer draining N messages")
    ap.add_argument("--profile", help="with --drain: cProfile stats of the last run to this file")
    ap.add_argument("--tail", type=int, default=0, help="only: our push consumer following N msg/s")
    a = ap.parse_args()
    if a.drain:
        drain_main(a.drain, a.repeat, a.profile)
        return
    if a.tail:
        tail_main(a.tail, 5.0, a.repeat)
        return
    n_sync = a.count or (2000 if a.quick else 10000)
    n_async = n_sync * 3
    n_batch = n_sync * 10
    run = asyncio.run
    if a.uvloop:
        import uvloop

        def run(coro):  # type: ignore[no-untyped-def]
            return uvloop.run(coro)

    rows: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory() as d, ChronomqProcess(Path(d) / "data") as server:
        ns = server.namesrv_addr
        print(f"chronomq at {ns}; 1 KiB bodies; our loop: {'uvloop' if a.uvloop else 'asyncio'}; "
              f"each figure is the median of {a.repeat} alternating runs")

        def pair(name: str, official: Callable[[int], float], ours: Callable[[int], float]) -> None:
            t_runs, o_runs = [], []
            for i in range(a.repeat):
                t_runs.append(official(i))
                o_runs.append(ours(i))
            t, o = statistics.median(t_runs), statistics.median(o_runs)
            print(f"  {name}: official {[round(x) for x in t_runs]} ours {[round(x) for x in o_runs]}")
            rows.append((name, t, o))

        pair(f"single sync sends ({n_sync}), 1 in flight",
             lambda i: theirs(ns, f"BenchSync{i}", role="produce", mode="sync", count=n_sync),
             lambda i: run(ours_sync(ns, f"BenchSync{i}", n_sync)))
        pair(f"single sync sends, blocking facade ({n_sync})",
             lambda i: theirs(ns, f"BenchSyncB{i}", role="produce", mode="sync", count=n_sync),
             lambda i: ours_blocking(ns, f"BenchSyncB{i}", n_sync))
        pair(f"async sends, 64 in flight ({n_async})",
             lambda i: theirs(ns, f"BenchAsync{i}", role="produce", mode="async", count=n_async, window=64),
             lambda i: run(ours_async(ns, f"BenchAsync{i}", n_async, 64)))
        pair(f"batches of 64 ({n_batch})",
             lambda i: theirs(ns, f"BenchBatch{i}", role="produce", mode="batch", count=n_batch,
                              batch_size=64),
             lambda i: run(ours_batch(ns, f"BenchBatch{i}", n_batch, 64)))
        # consumers: each run drains one of the async topics (n_async + 1 warm-up message from each
        # producer), with a fresh group
        total = n_async * 2 + 2
        pair(f"push consumer draining {total}",
             lambda i: theirs(ns, f"BenchAsync{i}", role="consume", count=total, group=f"CG_theirs{i}"),
             lambda i: run(ours_consume(ns, f"BenchAsync{i}", total, f"CG_ours{i}")))
    print()
    print(f"{'workload':<48} {'official msg/s':>15} {'chronomq.client':>16} {'ours/official':>14}")
    for name, t, o in rows:
        ratio = f"{o / t:>13.0%}" if t > 0 else f"{'n/a':>13}"
        print(f"{name:<48} {t:>15,.0f} {o:>16,.0f} {ratio}")


if __name__ == "__main__":
    main()
