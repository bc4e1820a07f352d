"""The second table: chronomq and Apache RocketMQ driven by the official Java client (rocketmq-client
4.9.x, its 4.x API, through tests/compat/java's Driver: ops ``bench_produce`` and ``bench_consume``), as a
Java shop would see them.

Two runs per broker, each a fresh topic with a push consumer started first:
- ``timed``: N messages with ``TIMER_DELIVER_MS`` (what the 5.x API's ``setDeliverTimeMs`` writes), due
  evenly over the spread window starting after a lead; async sends, a window in flight. Figures: the
  schedule rate (first send to last acknowledgement, inside the producer's JVM) and the lateness of
  first receipts at the push listener. Not for a broker without a timer (RocketMQ 4.9.7: "n/a").
- ``levels``: N messages with delay levels 1..10 (1 s .. 10 s in the bench's level table), round robin,
  due at send time + the level's delay: the same figures.

The JVMs run the driver with full JIT (the harness's compat flags stop at C1 to start fast; a Java shop's
client runs C2)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from .procs import PeerUnavailable

WINDOW = 64          # async sends in flight (as the Python client's single sends)
LEVELS_USED = 10     # delay levels 1..10 (1 s .. 10 s) for the level run
NA_PROTOCOL = "n/a: the official RocketMQ Java client speaks only RocketMQ's protocol"
NA_TIMER = "n/a: no timer (TIMER_DELIVER_MS) in this broker; delay levels only"


def jvm_command() -> list[str]:
    """``java ... chronomq.compat.Driver`` (tests/compat/jvm.py, built with Maven + javac), with full JIT;
    PeerUnavailable with the reason when Java, Maven or the driver are missing."""
    try:
        from tests.compat.harness import CompatUnavailable
        from tests.compat.jvm import java_driver
    except ImportError as e:
        raise PeerUnavailable(f"tests/compat/jvm.py (the Java driver) is not importable: {e}") from e
    try:
        cmd = java_driver("java4")
    except CompatUnavailable as e:
        raise PeerUnavailable(str(e)) from e
    return [c for c in cmd if c != "-XX:TieredStopAtLevel=1"]


def jvm_flags(cmd: list[str]) -> str:
    return " ".join(c for c in cmd[1:] if c.startswith("-X"))


def consume_args(namesrv: str, topic: str, group: str, prefix: str, expect: int, max_s: int,
                 ready: Path) -> dict[str, Any]:
    return {"op": "bench_consume", "namesrv": namesrv, "topic": topic, "group": group, "prefix": prefix,
            "expect": expect, "maxSeconds": max_s, "readyFile": str(ready)}


def produce_args(namesrv: str, topic: str, group: str, prefix: str, count: int, mode: str, lead_ms: int,
                 window_ms: int, levels_ms: list[int] | None, cap_s: float, size: int) -> dict[str, Any]:
    args: dict[str, Any] = {"op": "bench_produce", "namesrv": namesrv, "topic": topic, "group": group,
                            "prefix": prefix, "count": count, "mode": mode, "window": WINDOW,
                            "bodySize": size, "leadMs": lead_ms, "windowMs": window_ms,
                            "capMs": int(cap_s * 1000), "timeoutMs": 10_000, "retries": 2}
    if mode == "levels":
        if not levels_ms:
            raise ValueError("the level run needs the level table")
        args["levelsMs"] = levels_ms[:LEVELS_USED]
    return args


def java_lead_ms(count: int, floor_ms: int = 5_000) -> int:
    """Lead of the timed run's first due time: the producer JVM's start-up is not in it (the producer
    counts from its own start), loading at a pessimistic 2,000 msgs/s (a 2-core machine shared by the
    broker and two JVMs), x2 + 1 s. The table marks a run whose load overran it (*)."""
    return max(floor_ms, int(count / 2_000 * 2000) + 1_000)


def last_json(stdout: str) -> dict[str, Any]:
    """The driver's result: its last stdout line."""
    lines = [ln for ln in stdout.strip().splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"no result from the Java driver: {stdout[-500:]!r}")
    return json.loads(lines[-1])


def summarize(produced: dict[str, Any], consumed: dict[str, Any], timed: bool = True) -> dict[str, Any]:
    """The figures of one run from the two JVMs' answers."""
    ok = produced.get("ok", 0)
    out = {"sent": ok, "failed": produced.get("failed", 0), "first_error": produced.get("firstError"),
           "capped": produced.get("capped", False), "msgs_per_s": produced.get("msgsPerS"),
           "load_elapsed_s": (produced.get("elapsedMs") or 0) / 1000,
           "received": consumed.get("received", 0), "duplicates": consumed.get("duplicates", 0),
           "early_receipts": consumed.get("early", 0), "p50_ms": consumed.get("p50Ms"),
           "p99_ms": consumed.get("p99Ms"), "max_ms": consumed.get("maxMs"), "min_ms": consumed.get("minMs")}
    out["lost"] = max(0, ok - out["received"])
    if timed and produced.get("firstDueMs") and produced.get("lastAckMs"):  # levels: due from each send
        out["loaded_before_first_due"] = produced["lastAckMs"] <= produced["firstDueMs"]
    return out


def run_one(cmd: list[str], workdir: Path, namesrv: str, topic: str, run: str, mode: str, count: int,
            window_ms: int, levels_ms: list[int] | None, cap_s: float, grace_ms: int,
            size: int) -> dict[str, Any]:
    """One run: the consumer JVM (until it has every message or its time is up), then the producer JVM."""
    workdir.mkdir(parents=True, exist_ok=True)
    prefix = f"cmq|{run}|java-{mode}|"
    ready = workdir / f"{topic}.ready"
    lead = java_lead_ms(count) if mode == "timed" else 0
    span_ms = lead + window_ms if mode == "timed" else LEVELS_USED * 1000
    max_s = int((cap_s * 1000 + span_ms + grace_ms) / 1000) + 30
    cons_log = open(workdir / f"{topic}.consumer.log", "wb")  # noqa: SIM115 (closed below)
    consumer = subprocess.Popen(
        [*cmd, json.dumps(consume_args(namesrv, topic, f"jb_c_{topic}"[:100], prefix, count, max_s, ready))],
        stdout=subprocess.PIPE, stderr=cons_log, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if consumer.poll() is not None or time.monotonic() > deadline:
                log = (workdir / f"{topic}.consumer.log").read_text(errors="replace")
                raise RuntimeError(f"the Java consumer did not start: {log[-1500:]}")
            time.sleep(0.1)
        pargs = produce_args(namesrv, topic, f"jb_p_{topic}"[:100], prefix, count, mode, lead, window_ms,
                             levels_ms, cap_s, size)
        prod = subprocess.run([*cmd, json.dumps(pargs)], capture_output=True, text=True,
                              timeout=cap_s + 120, stdin=subprocess.DEVNULL)
        if prod.returncode != 0:
            raise RuntimeError(f"the Java producer failed ({prod.returncode}): {prod.stderr[-1500:]}")
        produced = last_json(prod.stdout)
        out_s, _ = consumer.communicate(timeout=max_s + 60)
        consumed = last_json(out_s)
    finally:
        if consumer.poll() is None:
            os.killpg(consumer.pid, 9)
            consumer.wait(10)
        cons_log.close()
    res = summarize(produced, consumed, timed=mode == "timed")
    res.update(mode=mode, count=count, lead_ms=lead, window=WINDOW)
    return res
