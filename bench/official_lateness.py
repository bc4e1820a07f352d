"""Delivery lateness of timed messages (TIMER_DELIVER_MS) with the official RocketMQ 4.x Python client
(PyPI rocketmq==0.4.4, ctypes over rocketmq-client-cpp) against a real `chronomq start` on loopback.

  rate     1,000 messages due 10 ms apart (100/s for 10 s), all sent ahead (first due 2 s after sending)
  same-ms  1,000 messages all due in the same millisecond, sent ahead (due 3 s after sending)

Lateness = the consumer's wall clock on entry to the push listener - the due time carried in the body
(float ms, same host clock). "early" counts receipts before the due time (must be 0). Each run uses a
fresh topic (4 queues) and consumer group on one broker; the consumer is started and has received
warm-up messages from every queue before the timed messages are sent. The lateness is split at the
delivered copy's store timestamp (int ms: when the timer put it into the commit log); the part after it
is dispatch, the held pull's answer, the C++ client and its listener thread. The figures mean something
only on a quiet machine: each run prints the load average at its start and the CPU time other
processes used during it.

Two listeners, each measured (``--listeners``):
  plain  the listener as a new user writes it;
  kept   the same listener, which on its first call in each of the client's threads takes one extra
         hold on that thread's Python state (``ctypes.pythonapi.PyGILState_Ensure()``, never released).
         The wrapper calls Python through ctypes from the C++ client's own threads, and ctypes creates and
         destroys a Python thread state around every call (its frame stack mapped and unmapped each
         time): about 10 µs a message. With the hold, each thread keeps its state.

    .venv/bin/python bench/official_lateness.py [--scenarios rate,same-ms] [--listeners plain,kept]
        [--repeat 3] [--threads 4]

Exit code 2 if the official client cannot be built or loaded here. `--driver` is internal: it runs the
client side inside .venv-compat (standard library + the official wrapper only).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ("rate", "same-ms")
LISTENERS = ("plain", "kept")
COUNT = 1000
DUMP: str | None = None  # --dump PREFIX: each run's records as PREFIX.<scenario>.<run>.json
WARM = 8  # plain messages before each run: the default producer spreads them over the 4 queues


# --- client side: runs in .venv-compat (python bench/official_lateness.py --driver <mode> '<json>') ------
def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _hard_exit(code: int = 0) -> None:
    """Leave without the wrapper's __del__ hooks (they can crash after an explicit shutdown)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def driver_consume(args: dict[str, Any]) -> None:
    """Push consumer. Bodies "L|<idx>|<due_ms>" are measured, "W|..." are warm-up. Progress lines go to
    args["progress"]; on SIGTERM (or the deadline) the records are printed *before* the client's shutdown
    (rocketmq-client-cpp 1.2.x sometimes aborts in shutdown)."""
    from rocketmq.client import PushConsumer

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    deadline = time.monotonic() + float(args.get("deadline_s", 180))
    lock = threading.Lock()
    recs: list[list[Any]] = []  # [idx, due_ms, recv_ms, store_ts, queue_id, thread ident]
    state = {"warm": 0, "bad": 0}

    keep_state = args.get("listener") == "kept"
    kept: set[int] = set()

    def on_message(msg: Any) -> None:
        recv_ms = time.time_ns() / 1e6  # first thing in the listener: the receipt time
        if keep_state:
            tid = threading.get_ident()
            if tid not in kept:  # once per client thread: its Python thread state outlives the call
                kept.add(tid)
                ctypes.pythonapi.PyGILState_Ensure()
        body = msg.body or b""
        if body[:2] == b"L|":
            _, idx, due = body.decode().split("|")
            rec = [int(idx), int(due), recv_ms, msg.store_timestamp, msg.queue_id, threading.get_ident()]
            with lock:
                recs.append(rec)
        else:
            with lock:
                state["warm" if body[:2] == b"W|" else "bad"] += 1

    consumer = PushConsumer(args["group"])
    consumer.set_namesrv_addr(args["namesrv"])
    if args.get("threads"):
        consumer.set_thread_count(int(args["threads"]))
    consumer.subscribe(args["topic"], on_message)
    consumer.start()
    with open(args["progress"], "a", encoding="utf-8") as prog:
        prog.write(json.dumps({"event": "started"}) + "\n")
        prog.flush()
        last: tuple[int, int] = (-1, -1)
        while not stop.wait(0.02) and time.monotonic() < deadline:
            with lock:
                now = (len(recs), state["warm"])
            if now != last:
                prog.write(json.dumps({"count": now[0], "warm": now[1]}) + "\n")
                prog.flush()
                last = now
    with lock:
        _emit({"records": list(recs), "warm": state["warm"], "bad": state["bad"],
               "reason": "signal" if stop.is_set() else "deadline", "before_shutdown": True})
    with contextlib.suppress(Exception):
        consumer.shutdown()
    _hard_exit(0)


def driver_produce(args: dict[str, Any]) -> None:
    """Sync sends. kind "warm": `count` plain messages. kind "timed": one plain message first (route and
    connection), then base = now + lead_ms and message i is due at base + i * spacing_ms, carried in the
    TIMER_DELIVER_MS property and in the body."""
    from rocketmq.client import Message, Producer

    producer = Producer(str(args.get("group", "PG_lateness")), timeout=5000)
    producer.set_namesrv_addr(args["namesrv"])
    producer.start()
    topic, count = args["topic"], int(args["count"])
    deadline = time.monotonic() + float(args.get("deadline_s", 60))
    errors: list[str] = []
    retries = 0
    out: dict[str, Any] = {"acked": 0}

    def send(body: str, props: dict[str, str]) -> bool:
        nonlocal retries
        m = Message(topic)
        m.set_body(body)
        for k, v in props.items():
            m.set_property(k, v)
        for attempt in range(6):  # the client's first send on a new connection can fail at once
            try:
                producer.send_sync(m)
                return True
            except Exception as e:
                if attempt < 5 and "No route info" in str(e) and not out["acked"]:
                    retries += 1
                    time.sleep(0.3)
                    continue
                errors.append(f"{type(e).__name__}: {e}"[:300])
                return False
        return False

    if args["kind"] == "warm":
        for i in range(count):
            if time.monotonic() < deadline and send(f"W|{i}", {}):
                out["acked"] += 1
    else:
        send("W|producer", {})
        lead, spacing = int(args["lead_ms"]), int(args["spacing_ms"])
        base = int(time.time() * 1000) + lead
        out.update(base_ms=base, first_due_ms=base, last_due_ms=base + (count - 1) * spacing,
                   t_first_send_ms=time.time() * 1000)
        late = 0  # acknowledged only after the message's own due time (then it was not sent ahead)
        for i in range(count):
            if time.monotonic() > deadline or len(errors) > 20:
                break
            due = base + i * spacing
            if send(f"L|{i}|{due}", {"TIMER_DELIVER_MS": str(due)}):
                out["acked"] += 1
                if time.time() * 1000 >= due:
                    late += 1
        out.update(t_last_ack_ms=time.time() * 1000, acked_after_due=late)
    _emit({**out, "errors": errors[:5], "n_errors": len(errors), "retries": retries, "before_shutdown": True})
    with contextlib.suppress(Exception):
        producer.shutdown()
    _hard_exit(0)


def driver_main(mode: str, raw: str) -> None:
    args = json.loads(raw)
    {"consume": driver_consume, "produce": driver_produce}[mode](args)


# --- bench side: runs in the project's .venv ---------------------------------------------------------------
class Driver:
    """This file in --driver mode as a child process in .venv-compat; every wait is bounded."""

    def __init__(self, py: str, mode: str, args: dict[str, Any], work: Path, env: dict[str, str]) -> None:
        stem = f"{mode}-{time.monotonic_ns()}"
        self.mode = mode
        self.stdout_path, self.stderr_path = work / f"{stem}.out", work / f"{stem}.err"
        self.progress_path = Path(args["progress"]) if args.get("progress") else None
        cmd = [py, str(Path(__file__).resolve()), "--driver", mode, json.dumps(args)]
        with open(self.stdout_path, "wb") as so, open(self.stderr_path, "wb") as se:
            self.proc = subprocess.Popen(cmd, stdout=so, stderr=se, stdin=subprocess.DEVNULL, env=env,
                                         cwd=REPO)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-1500:]
        except OSError:
            return ""

    def progress(self) -> dict[str, Any]:
        if self.progress_path is None or not self.progress_path.exists():
            return {}
        lines = [ln for ln in self.progress_path.read_text().splitlines(keepends=True) if ln.endswith("\n")]
        return json.loads(lines[-1]) if lines else {}

    def finish(self, timeout: float, terminate: bool = False) -> dict[str, Any]:
        if terminate and self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            msg = f"{self.mode} driver did not finish within {timeout}s; stderr: {self.stderr()}"
            raise RuntimeError(msg) from None
        lines = [ln for ln in self.stdout_path.read_text(errors="replace").splitlines() if ln.strip()]
        try:
            result = json.loads(lines[-1]) if lines else None
        except ValueError:
            result = None
        if not isinstance(result, dict) or (code != 0 and not result.get("before_shutdown")):
            raise RuntimeError(f"{self.mode} driver exited {code} without a result; stderr: {self.stderr()}")
        if code != 0:
            result["shutdown_crash"] = f"exit {code}"  # the client aborted in shutdown, after its result
        return result

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def wait_until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


def machine_busy_s() -> float:
    """CPU seconds all CPUs spent busy since boot (/proc/stat; nan where there is none)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def own_cpu_s(broker_pid: int | None) -> float:
    """CPU seconds of the broker plus this process and its reaped children (the drivers)."""
    ru_self, ru_kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = ru_self.ru_utime + ru_self.ru_stime + ru_kids.ru_utime + ru_kids.ru_stime
    try:
        fields = Path(f"/proc/{broker_pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return total


def pct(sorted_vals: list[float], p: float) -> float:
    if not sorted_vals:
        return float("nan")
    k = min(len(sorted_vals) - 1, max(0, math.ceil(p / 100 * len(sorted_vals)) - 1))  # nearest rank
    return sorted_vals[k]


def run_once(scenario: str, listener: str, run: int, py: str, env: dict[str, str], ns: str, work: Path,
             threads: int, broker_pid: int | None) -> dict[str, Any]:
    load = os.getloadavg()
    t0, busy0, own0 = time.monotonic(), machine_busy_s(), own_cpu_s(broker_pid)
    tag = uuid.uuid4().hex[:6]
    topic, group = f"Lat_{scenario.replace('-', '_')}_{run}_{tag}", f"CG_lat_{tag}"
    warm = Driver(py, "produce", {"namesrv": ns, "topic": topic, "kind": "warm", "count": WARM,
                                  "group": f"PG_warm_{tag}"}, work, env)
    w = warm.finish(90)
    if w["acked"] != WARM:
        raise RuntimeError(f"warm-up sends failed: {w}")
    consumer = Driver(py, "consume", {"namesrv": ns, "topic": topic, "group": group, "threads": threads,
                                      "listener": listener,
                                      "deadline_s": 240, "progress": str(work / f"{topic}.progress")},
                      work, env)
    try:
        wait_until(lambda: consumer.progress().get("warm", 0) >= WARM or not consumer.alive(), 60,
                   f"the consumer to receive the {WARM} warm-up messages")
        if not consumer.alive():
            raise RuntimeError(f"consumer exited early; stderr: {consumer.stderr()}")
        lead, spacing = (2000, 10) if scenario == "rate" else (3000, 0)
        prod = Driver(py, "produce", {"namesrv": ns, "topic": topic, "kind": "timed", "count": COUNT,
                                      "lead_ms": lead, "spacing_ms": spacing, "group": f"PG_lat_{tag}"},
                      work, env)
        p = prod.finish(90)
        if p["acked"] != COUNT:
            raise RuntimeError(f"timed sends: {p['acked']} of {COUNT} acknowledged: {p}")
        wait_s = max(0.0, p["last_due_ms"] / 1000 - time.time()) + 30
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: consumer.progress().get("count", 0) >= COUNT or not consumer.alive(), wait_s,
                       f"the consumer to receive the {COUNT} timed messages")
        c = consumer.finish(30, terminate=True)
    finally:
        consumer.kill()
    wall, own = time.monotonic() - t0, own_cpu_s(broker_pid) - own0
    other = max(0.0, machine_busy_s() - busy0 - own)  # CPU the rest of the machine used meanwhile
    recs = c["records"]
    if DUMP:
        Path(f"{DUMP}.{scenario}.{listener}.{run}.json").write_text(json.dumps(recs))
    seen = {r[0] for r in recs}
    lat = sorted(r[2] - r[1] for r in recs)
    broker = sorted(r[3] - r[1] for r in recs)  # store timestamp of the delivered copy - due (int ms)
    client = sorted(r[2] - r[3] for r in recs)  # receipt - store ts: dispatch, pull answer, the client
    # The client's own pace: receipts after the broker had put the last message (store ts is int ms,
    # so the window starts at the next whole ms): microseconds per message the client alone needed.
    last_put = max((r[3] for r in recs), default=0) + 1
    tail = sorted(r[2] for r in recs if r[2] >= last_put)
    pace = (tail[-1] - last_put) * 1000 / len(tail) if len(tail) >= 50 else float("nan")
    return {
        "scenario": scenario, "listener": listener, "run": run, "loadavg": load, "received": len(recs),
        "distinct": len(seen),
        "missing": COUNT - len(seen), "dups": len(recs) - len(seen), "early": sum(1 for x in lat if x < 0),
        "p50": pct(lat, 50), "p99": pct(lat, 99), "max": lat[-1] if lat else float("nan"),
        "min": lat[0] if lat else float("nan"),
        "bmin": broker[0] if broker else float("nan"),
        "b50": pct(broker, 50), "b99": pct(broker, 99), "bmax": broker[-1] if broker else float("nan"),
        "c50": pct(client, 50), "c99": pct(client, 99), "cmax": client[-1] if client else float("nan"),
        "threads_used": len({r[5] for r in recs}),
        "tail_n": len(tail), "tail_pace_us": pace,
        "send_s": (p["t_last_ack_ms"] - p["t_first_send_ms"]) / 1000,
        "ahead_ms": p["first_due_ms"] - p["t_last_ack_ms"], "acked_after_due": p["acked_after_due"],
        "retries": p["retries"] + w["retries"], "warm_recv": c["warm"],
        "wall_s": wall, "own_cpu_s": own, "other_cpu_s": other,
    }


def print_run(r: dict[str, Any]) -> None:
    la = " ".join(f"{x:.2f}" for x in r["loadavg"])
    print(f"  run {r['run']}: load avg at start {la}; sent {COUNT} in {r['send_s']:.2f} s, last ack"
          f" {r['ahead_ms']:.0f} ms before the first due ({r['acked_after_due']} acked after their due)")
    print(f"    lateness ms (receipt - due): p50 {r['p50']:.2f}  p99 {r['p99']:.2f}  max {r['max']:.2f}"
          f"  min {r['min']:.2f}   early {r['early']}")
    print(f"    received {r['received']} (missing {r['missing']}, duplicates {r['dups']});"
          f" listener threads seen {r['threads_used']}")
    print(f"    put (store ts of delivered copy - due, int ms): min {r['bmin']:.0f}  p50 {r['b50']:.0f}"
          f"  p99 {r['b99']:.0f}  max {r['bmax']:.0f};  after the put (receipt - store ts):"
          f" p50 {r['c50']:.2f}  p99 {r['c99']:.2f}  max {r['cmax']:.2f}")
    print(f"    CPU during the run ({r['wall_s']:.1f} s): broker + clients {r['own_cpu_s']:.2f} s,"
          f" other processes {r['other_cpu_s']:.2f} s"
          f" ({100 * r['other_cpu_s'] / r['wall_s']:.0f}% of one CPU)")
    if r["scenario"] == "same-ms":
        print(f"    all {r['received']} received {r['max']:.1f} ms after the common due time")
        print(f"    after the last put: {r['tail_n']} still to receive,"
              f" at {r['tail_pace_us']:.1f} µs a message"
              " (the client's own pace)")


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] == "--driver":
        if len(sys.argv) != 4:
            sys.exit("usage: official_lateness.py --driver consume|produce '<json>'")
        driver_main(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: rate,same-ms")
    ap.add_argument("--listeners", default=",".join(LISTENERS), help="comma-separated: plain,kept")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dump", default=None,
                    help="write each run's records to DUMP.<scenario>.<listener>.<run>.json")
    ap.add_argument("--threads", type=int, default=4, help="push consumer thread count (set_thread_count)")
    opts = ap.parse_args()
    global DUMP
    DUMP = opts.dump
    scenarios = [s.strip() for s in opts.scenarios.split(",") if s.strip()]
    listeners = [s.strip() for s in opts.listeners.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in SCENARIOS] + [s for s in listeners if s not in LISTENERS]
    if bad or not scenarios or not listeners or opts.repeat < 1:
        ap.error(f"--scenarios takes {','.join(SCENARIOS)} (got {opts.scenarios!r}), --listeners takes"
                 f" {','.join(LISTENERS)} (got {opts.listeners!r}); --repeat >= 1")
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "src"))
    from tests.compat.harness import ChronomqProcess, CompatUnavailable, _driver_env, official_python

    try:
        py = official_python()
    except CompatUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="chronomq-official-lateness-"))
    server = ChronomqProcess(work / "data")
    results: list[dict[str, Any]] = []
    try:
        server.start()
        print(f"official client rocketmq==0.4.4 against chronomq start (pid {server.pid})"
              f" on {server.namesrv_addr}; {os.cpu_count()} CPUs; push consumer, {opts.threads} threads,"
              " 4 queues")
        env = _driver_env()
        for scenario in scenarios:
            what = ("1,000 msgs due 10 ms apart (100/s over 10 s), first due 2 s after sending"
                    if scenario == "rate" else "1,000 msgs due in the same ms, 3 s after sending")
            for listener in listeners:
                print(f"\n[{scenario}, {listener} listener] {what}", flush=True)
                for run in range(1, opts.repeat + 1):
                    r = run_once(scenario, listener, run, py, env, server.namesrv_addr, work, opts.threads,
                                 server.pid)
                    results.append(r)
                    print_run(r)
                    sys.stdout.flush()
    finally:
        with contextlib.suppress(RuntimeError):
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("\nsummary (median over runs):")
    for scenario, listener in [(s, ln) for s in scenarios for ln in listeners]:
        rs = [r for r in results if r["scenario"] == scenario and r["listener"] == listener]
        med = {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in ("p50", "p99", "max", "b99", "c99")}
        print(f"  {scenario:8s} {listener:5s} p50 {med['p50']:.2f}  p99 {med['p99']:.2f}"
              f"  max {med['max']:.2f} ms (worst run {max(r['max'] for r in rs):.2f});"
              f" early {sum(r['early'] for r in rs)}; missing {sum(r['missing'] for r in rs)};"
              f" put p99 {med['b99']:.0f}, after-put p99 {med['c99']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
