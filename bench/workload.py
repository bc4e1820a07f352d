"""A mixed load with a ledger, shared by the soak (bench/soak.py) and the kill loop (bench/chaos.py).

Every body names itself (``<source>:<seq>:<kind>:<not_before_ms>:<size>:`` then bytes derived from
that head), so a receiver tells an intact message from a corrupt one without the sender's memory. The
ledger keeps what was acknowledged (by our client, or by the official client's driver through its JSONL
file), what a cancel answered CANCELLED, and every receipt. ``Ledger.verdict`` turns them into the
invariants: nothing acknowledged lost, nothing corrupt, nothing early, nothing cancelled delivered; and
it splits duplicates into re-reads of one stored copy (same queue and offset) and copies stored twice.

A kill can cut an answer. A cancel whose answer never came is undecided: the broker may have cancelled
the message or not. ``Mix.settle`` asks it again once the broker is back, and the definite answer decides
(CANCELLED or ALREADY_CANCELLED: cancelled; ALREADY_DELIVERED, UNKNOWN, FAILED: it must have been
received). A reschedule (always to a later time) answered RESCHEDULED moves the message's earliest time to
the new one; an undecided one is asked again the same way (RESCHEDULED: the new time holds; otherwise the
message was delivered, no earlier than its first time). A send whose answer never came was not
acknowledged, so it is never a loss; when it was stored and delivered anyway it is counted apart, not as a
duplicate.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chronomq.client import Admin, Message, Producer

KINDS = ("now", "level", "timed", "batch")
CANCELLED_OUTCOMES = ("CANCELLED", "ALREADY_CANCELLED")  # a cancel answered so leaves the message cancelled
LEVEL_MS = {1: 1_000, 2: 5_000}  # the default delay levels 1 and 2


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def make_body(source: str, seq: int, kind: str, not_before_ms: int, size: int) -> bytes:
    head = f"{source}:{seq}:{kind}:{not_before_ms}:{size}:".encode()
    fill = hashlib.sha256(head).hexdigest().encode()
    need = max(0, size - len(head))
    return head + (fill * (need // len(fill) + 1))[:need]


def parse_body(body: bytes) -> tuple[str, int, str, int] | None:
    """(source, seq, kind, not_before_ms) of an intact body; None when the body is not one we made."""
    try:
        source, seq, kind, nb, size, _ = body.split(b":", 5)
        parsed = (source.decode(), int(seq), kind.decode(), int(nb))
        return parsed if make_body(*parsed, int(size)) == body else None
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass(slots=True)
class Receipt:
    msg_id: str
    where: tuple[str, int, int]  # topic, queue id, queue offset
    at_ms: int
    due_ms: int  # when it could be delivered at the earliest (0: at once)
    kind: str  # as the body says ("?" when it is corrupt)


@dataclass
class Verdict:
    acknowledged: int = 0
    received: int = 0
    lost: int = 0
    corrupt: int = 0
    early: int = 0
    cancelled: int = 0
    cancelled_delivered: int = 0
    rereads: int = 0
    restored: int = 0
    restored_by_kind: dict[str, int] = field(default_factory=dict)
    undecided: int = 0  # cancels whose answer never came
    settled: dict[str, int] = field(default_factory=dict)  # their answers when asked again: outcome -> count
    unsettled: int = 0  # of those, still without an answer and not received: neither lost nor cancelled
    rescheduled: int = 0  # reschedules answered RESCHEDULED (at once or when asked again)
    reschedules_undecided: int = 0  # reschedules whose answer never came
    reschedules_settled: dict[str, int] = field(default_factory=dict)  # their answers when asked again
    unacknowledged: int = 0  # delivered though their send was never acknowledged (the answer was lost)
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.corrupt or self.early or self.cancelled_delivered or self.unsettled)

    def line(self) -> str:
        return (f"acknowledged={self.acknowledged} received={self.received} lost={self.lost} "
                f"corrupt={self.corrupt} early={self.early} cancelled={self.cancelled} "
                f"cancelled_delivered={self.cancelled_delivered} duplicates={self.rereads + self.restored} "
                f"(re-reads {self.rereads}, stored twice {self.restored}"
                + (f": {self.restored_by_kind}" if self.restored_by_kind else "") + ") "
                f"undecided={self.undecided} settled="
                + (",".join(f"{k}:{n}" for k, n in sorted(self.settled.items())) or "none")
                + f" unsettled={self.unsettled} rescheduled={self.rescheduled} reschedules_undecided="
                f"{self.reschedules_undecided} reschedules_settled="
                + (",".join(f"{k}:{n}" for k, n in sorted(self.reschedules_settled.items())) or "none")
                + f" unacknowledged_delivered={self.unacknowledged}")


class Ledger:
    """What was acknowledged and what arrived. Single-threaded: feed it from the event loop."""

    def __init__(self) -> None:
        self.acked: dict[str, tuple[str, int]] = {}  # msg id -> (topic, not_before_ms)
        self.cancelled: set[str] = set()
        self.undecided: set[str] = set()  # cancels whose answer never came
        self.settled: dict[str, str] = {}  # undecided cancel -> the definite answer when asked again
        self.rescheduled: dict[str, int] = {}  # msg id -> the later time a reschedule was answered for
        self.reschedules_undecided: dict[str, int] = {}  # msg id -> the time asked, the answer never came
        self.reschedules_settled: dict[str, str] = {}  # undecided reschedule -> the answer when asked again
        self.receipts: list[Receipt] = []
        self.corrupt: list[tuple[str, str]] = []  # (msg id, where)
        self.outstanding: dict[str, int] = {}  # acknowledged, not received yet: msg id -> not_before_ms
        self._seen: set[str] = set()

    def ack(self, msg_id: str, topic: str, not_before_ms: int) -> None:
        self.acked[msg_id] = (topic, not_before_ms)
        if msg_id not in self._seen:
            self.outstanding[msg_id] = not_before_ms

    def cancel(self, msg_id: str) -> None:
        self.cancelled.add(msg_id)
        self.outstanding.pop(msg_id, None)

    def cancel_undecided(self, msg_id: str) -> None:
        """A cancel of ``msg_id`` was asked and no answer came: it may or may not have taken effect."""
        self.undecided.add(msg_id)

    def settle(self, msg_id: str, outcome: str) -> None:
        """The definite answer of asking an undecided cancel again."""
        self.settled[msg_id] = outcome
        if outcome in CANCELLED_OUTCOMES:
            self.cancel(msg_id)

    def reschedule(self, msg_id: str, deliver_ms: int) -> None:
        """A reschedule of ``msg_id`` to the later ``deliver_ms`` was answered RESCHEDULED."""
        self.rescheduled[msg_id] = deliver_ms
        if msg_id in self.outstanding:
            self.outstanding[msg_id] = deliver_ms

    def reschedule_undecided(self, msg_id: str, deliver_ms: int) -> None:
        """A reschedule was asked and no answer came: the message is due at its first time or at this one."""
        self.reschedules_undecided[msg_id] = deliver_ms

    def settle_reschedule(self, msg_id: str, outcome: str) -> None:
        """The definite answer of asking an undecided reschedule again (to the same time)."""
        self.reschedules_settled[msg_id] = outcome
        if outcome == "RESCHEDULED":
            self.reschedule(msg_id, self.reschedules_undecided[msg_id])

    def receive(self, msg_id: str, topic: str, queue_id: int, offset: int, body: bytes,
                at_ms: int) -> Receipt:
        parsed = parse_body(body)
        if parsed is None:
            self.corrupt.append((msg_id, f"{topic}/{queue_id}/{offset}"))
            due, kind = 0, "?"
        else:
            due, kind = parsed[3], parsed[2]
        r = Receipt(msg_id, (topic, queue_id, offset), at_ms, due, kind)
        self.receipts.append(r)
        self._seen.add(msg_id)
        self.outstanding.pop(msg_id, None)
        return r

    def lag(self, at_ms: int) -> int:
        """Acknowledged messages already due and not received yet (cancelled ones excluded)."""
        return sum(1 for nb in self.outstanding.values() if nb <= at_ms)

    def verdict(self, only: set[str] | None = None) -> Verdict:
        """The invariants over everything, or over the messages ``only`` names."""
        acked = self.acked if only is None else {m: a for m, a in self.acked.items() if m in only}
        v = Verdict(acknowledged=len(acked), cancelled=len(self.cancelled if only is None
                                                            else self.cancelled & only),
                    corrupt=sum(1 for m, _ in self.corrupt if only is None or m in only))
        where_by_id: dict[str, set[tuple[str, int, int]]] = {}
        unacknowledged: set[str] = set()
        kind_of: dict[str, str] = {}
        reads = 0
        early: list[str] = []
        for r in self.receipts:
            if only is not None and r.msg_id not in only:
                continue
            due = max(r.due_ms, self.rescheduled.get(r.msg_id, 0))
            if due and r.at_ms < due:
                early.append(f"{r.msg_id} {due - r.at_ms} ms early"
                             + (" (rescheduled)" if due > r.due_ms else ""))
            if r.msg_id not in self.acked and r.kind != "?":
                unacknowledged.add(r.msg_id)  # its send's answer was lost: neither a loss nor a duplicate
                continue
            where_by_id.setdefault(r.msg_id, set()).add(r.where)
            kind_of[r.msg_id] = r.kind
            reads += 1
        v.received = len(where_by_id)
        v.unacknowledged = len(unacknowledged)
        copies = sum(len(w) for w in where_by_id.values())
        v.rereads = reads - copies
        v.restored = copies - len(where_by_id)
        for m, w in where_by_id.items():
            if len(w) > 1:
                v.restored_by_kind[kind_of[m]] = v.restored_by_kind.get(kind_of[m], 0) + len(w) - 1
        v.early = len(early)
        undecided = self.undecided if only is None else self.undecided & only
        v.undecided = len(undecided)
        for m in undecided:
            if m in self.settled:
                v.settled[self.settled[m]] = v.settled.get(self.settled[m], 0) + 1
        unsettled = [m for m in undecided if m not in self.settled and m not in where_by_id]
        in_scope = (lambda m: True) if only is None else only.__contains__
        v.rescheduled = sum(1 for m in self.rescheduled if in_scope(m))
        v.reschedules_undecided = sum(1 for m in self.reschedules_undecided if in_scope(m))
        for m, outcome in self.reschedules_settled.items():
            if in_scope(m):
                v.reschedules_settled[outcome] = v.reschedules_settled.get(outcome, 0) + 1
        v.unsettled = len(unsettled)
        lost = [m for m in acked if m not in where_by_id and m not in self.cancelled and m not in unsettled]
        v.lost = len(lost)
        bad_cancel = [m for m in self.cancelled if m in where_by_id and (only is None or m in only)]
        v.cancelled_delivered = len(bad_cancel)
        v.examples = {k: xs[:5] for k, xs in (("lost", lost), ("early", early),
                                               ("corrupt", [f"{m}@{w}" for m, w in self.corrupt]),
                                               ("cancelled_delivered", bad_cancel),
                                               ("unsettled", unsettled)) if xs}
        return v


def read_official_acks(path: Path, ledger: Ledger, topic: str, not_before: Callable[[int], int]) -> int:
    """Feed the acknowledged sends of the official client's driver (its ``out`` JSONL) into the ledger."""
    n = 0
    if not path.exists():
        return 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the driver was stopped mid-line
        if rec.get("status") in (0, "SEND_OK") and rec.get("msg_id"):
            ledger.ack(rec["msg_id"], topic, not_before(int(rec["index"])))
            n += 1
    return n


@dataclass
class MixStats:
    attempts: int = 0
    acked: int = 0
    failed: int = 0
    cancel_asked: int = 0
    reschedule_asked: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, e: BaseException) -> None:
        name = type(e).__name__
        self.errors[name] = self.errors.get(name, 0) + 1
        self.failed += 1


class Mix:
    """Our client's share of the load: sends at a fixed rate, one kind after another (immediate, delay
    level 1 or 2, a deliver time 0.2..``max_delay_s`` ahead, a batch of ``batch`` immediate messages),
    a cancel of every ``cancel_every``-th timed message while it is pending, and a reschedule 1..3 s later
    of every ``reschedule_every``-th one that is not cancelled."""

    def __init__(self, ledger: Ledger, namesrv: str, topic: str, *, source: str = "ours", size: int = 256,
                 batch: int = 8, max_delay_s: float = 8.0, cancel_every: int = 10, reschedule_every: int = 0,
                 seed: int = 1, send_timeout: float = 3.0) -> None:
        self.ledger, self.namesrv, self.topic, self.source = ledger, namesrv, topic, source
        self.size, self.batch, self.max_delay_s, self.cancel_every = size, batch, max_delay_s, cancel_every
        self.reschedule_every = reschedule_every
        self.send_timeout = send_timeout
        self.rng = random.Random(seed)
        self.seq = 0
        self.timed = 0
        self.stats = MixStats()
        self._tasks: set[asyncio.Task[None]] = set()

    def _next(self, kind: str, not_before: int) -> tuple[int, bytes]:
        self.seq += 1
        return self.seq, make_body(self.source, self.seq, kind, not_before, self.size)

    async def one(self, producer: Producer, admin: Admin, kind: str) -> None:
        t0 = now_ms()
        try:
            if kind == "batch":
                msgs = [Message(self.topic, self._next("batch", 0)[1]) for _ in range(self.batch)]
                self.stats.attempts += len(msgs)
                res = await producer.send_batch(msgs)
                for mid in res.msg_id.split(","):
                    self.ledger.ack(mid, self.topic, 0)
                self.stats.acked += len(msgs)
                return
            self.stats.attempts += 1
            if kind == "level":
                level = self.rng.choice((1, 2))
                nb = t0 + LEVEL_MS[level]
                res = await producer.send(Message(self.topic, self._next(kind, nb)[1], delay_level=level))
            elif kind == "timed":
                nb = t0 + 200 + int(self.rng.random() * (self.max_delay_s * 1000 - 200))
                res = await producer.send(Message(self.topic, self._next(kind, nb)[1], deliver_at=nb))
            else:
                nb = 0
                res = await producer.send(Message(self.topic, self._next(kind, 0)[1]))
        except Exception as e:  # a refused or failed send is simply not acknowledged
            self.stats.error(e)
            return
        if res.status != "SEND_OK":
            self.stats.errors[str(res.status)] = self.stats.errors.get(str(res.status), 0) + 1
            self.stats.failed += 1
            return
        self.ledger.ack(res.msg_id, self.topic, nb)
        self.stats.acked += 1
        if kind == "timed":
            self.timed += 1
            if nb - now_ms() <= 500:
                return
            if self.cancel_every and self.timed % self.cancel_every == 0:
                await self._cancel(admin, res.msg_id)
            elif self.reschedule_every and self.timed % self.reschedule_every == 0:
                await self._reschedule(admin, res.msg_id, nb + self.rng.randint(1_000, 3_000))

    async def _cancel(self, admin: Admin, msg_id: str) -> None:
        self.stats.cancel_asked += 1
        try:
            results = await admin.cancel(msg_id)
        except Exception as e:  # no answer (or not a definite one): the cancel may have taken effect
            self.stats.error(e)
            self.ledger.cancel_undecided(msg_id)
            return
        if any(str(r.outcome) in CANCELLED_OUTCOMES for r in results):
            self.ledger.cancel(msg_id)

    async def _reschedule(self, admin: Admin, msg_id: str, deliver_ms: int) -> None:
        self.stats.reschedule_asked += 1
        try:
            results = await admin.reschedule(msg_id, deliver_ms)
        except Exception as e:  # no answer (or not a definite one): the reschedule may have taken effect
            self.stats.error(e)
            self.ledger.reschedule_undecided(msg_id, deliver_ms)
            return
        if any(str(r.outcome) == "RESCHEDULED" for r in results):
            self.ledger.reschedule(msg_id, deliver_ms)

    async def settle(self, admin: Admin, timeout: float = 60.0) -> int:
        """Ask every undecided cancel and reschedule again until each has a definite answer or ``timeout`` s
        have passed (a broker still starting, a cut connection: ask again). Returns how many remain
        undecided."""
        deadline = time.monotonic() + timeout
        todo = [("cancel", m) for m in sorted(self.ledger.undecided - self.ledger.settled.keys())]
        todo += [("reschedule", m) for m in sorted(self.ledger.reschedules_undecided.keys()
                                                    - self.ledger.reschedules_settled.keys())]
        while todo and time.monotonic() < deadline:
            op, msg_id = todo[0]
            try:
                if op == "cancel":
                    results = await admin.cancel(msg_id)
                else:
                    results = await admin.reschedule(msg_id, self.ledger.reschedules_undecided[msg_id])
            except Exception:
                await asyncio.sleep(0.2)  # no answer yet: ask again, within the deadline
                continue
            todo.pop(0)
            outcomes = [str(r.outcome) for r in results]
            decisive = CANCELLED_OUTCOMES if op == "cancel" else ("RESCHEDULED",)
            outcome = next((o for o in outcomes if o in decisive), outcomes[0] if outcomes else "UNKNOWN")
            if op == "cancel":
                self.ledger.settle(msg_id, outcome)
            else:
                self.ledger.settle_reschedule(msg_id, outcome)
        return len(todo)

    async def run(self, producer: Producer, admin: Admin, rate: float, seconds: float,
                  stop: asyncio.Event | None = None, max_inflight: int = 256) -> None:
        """Send at ``rate`` messages/s (a batch counts as its messages) for ``seconds`` or until ``stop``."""
        start = time.monotonic()
        sent = 0
        kinds = ("now", "level", "timed", "timed", "now", "batch")
        i = 0
        while time.monotonic() - start < seconds and not (stop and stop.is_set()):
            kind = kinds[i % len(kinds)]
            i += 1
            if len(self._tasks) < max_inflight:
                t = asyncio.create_task(self.one(producer, admin, kind))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)
            sent += self.batch if kind == "batch" else 1
            ahead = sent / rate - (time.monotonic() - start)
            if ahead > 0:
                await asyncio.sleep(ahead)  # pacing, not waiting for a condition
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.send_timeout * 3)


DELAY_SOURCE = "__CHRONOMQ_DELAY_SRC"  # "<level>:..." on a message the level service delivered


def receipt_of(ledger: Ledger, message: Any) -> Receipt:
    """Record a message a consumer of ours was handed. A delay-level message is due no earlier than its
    born time plus its level's delay, whichever client sent it."""
    r = ledger.receive(message.id, message.topic, message.queue.queue_id, message.queue_offset,
                       message.body, now_ms())
    level = message.properties.get(DELAY_SOURCE, "").partition(":")[0]
    if level.isdigit() and int(level) in LEVEL_MS:
        r.due_ms = max(r.due_ms, message.born_timestamp + LEVEL_MS[int(level)])
    return r


def proc_sample(pid: int, data_dir: Path | None = None) -> dict[str, float]:
    """RSS and heap (MiB), open files, threads and CPU seconds of a process, from /proc. With
    ``data_dir``: ``data_fds``, how many of the open files are below it (the store's segment files, which
    grow with the data kept)."""
    out: dict[str, float] = {}
    status = Path(f"/proc/{pid}/status").read_text()
    for line in status.splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon"):
            out[k] = int(v.split()[0]) / 1024
        elif k == "Threads":
            out["threads"] = int(v)
    fds = list(Path(f"/proc/{pid}/fd").iterdir())
    out["fds"] = len(fds)
    if data_dir is not None:
        root = str(data_dir.resolve()) + os.sep
        n = 0
        for fd in fds:
            try:
                n += os.readlink(fd).startswith(root)
            except OSError:  # closed meanwhile
                pass
        out["data_fds"] = n
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    out["cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out
