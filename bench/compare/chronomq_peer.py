"""chronomq from this checkout: ``chronomq start`` (contract A) through the compat harness's
ChronomqProcess (contract C), driven with chronomq's own client (chronomq.client): an asyncio Producer
with a window of concurrent sends per batch, and a PushConsumer with a coroutine listener.

RocketMQ 4.x delayed messages use fixed delay levels (``messageDelayLevel``). Its documented way to get
other delays is to configure the level table, so the bench runs the broker with 1 s steps up to 40 s and
coarser levels up to 2 h (LEVELS below); each message takes the smallest level that reaches its intended
due time, and its real due time (send time + level delay) is what lateness is measured against. When the
broker honours arbitrary delivery times (``Message(deliver_at=...)``, the timer issue: probed at start
with one message, since the client may send the property before the broker acts on it), they are used
instead."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .base import Consumer, PayloadFn, Peer, Producer, Sink
from .procs import PeerUnavailable
from .workloads import Recorder, make_payload, now_ms, quantize_to_level

REPO = Path(__file__).resolve().parents[2]
LEVELS = " ".join([f"{s}s" for s in range(1, 41)] + ["50s", "1m", "2m", "5m", "10m", "30m", "1h", "2h"])
SEND_WINDOW = 64  # concurrent sends in flight per producer (more adds queueing latency, not throughput)
QUEUES = 4
BATCH_SIZE = 100  # timed messages per batch request (~100 KiB of 1 KiB payloads)
BATCH_WINDOW = 4  # batch requests in flight per producer


def _levels_ms() -> list[int]:
    from chronomq.config import parse_delay_levels

    return parse_delay_levels(LEVELS)


def _client() -> Any:
    try:
        import chronomq.client as client
    except ImportError as e:  # the client is another helper's work in progress
        raise PeerUnavailable(f"chronomq.client is not importable yet: {e}") from e
    for name in ("Producer", "PushConsumer", "Admin", "Message"):
        if not hasattr(client, name):
            raise PeerUnavailable(f"chronomq.client has no {name} yet")
    return client


def supports_deliver_at() -> bool:
    """True once the client (and so the broker's timer) accepts arbitrary delivery times."""
    client = _client()
    try:
        client.Message(topic="T", body=b"x", deliver_at=now_ms() + 60_000).wire_properties()
    except Exception:
        return False
    return True


def topic_of(dest: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in dest)[:120]


class ChronomqProducer(Producer):
    batch_timed = True  # timed messages in batch requests (False: one per request, SEND_WINDOW in flight)

    def __init__(self, namesrv: str, dest: str, payload: PayloadFn, levels_ms: list[int] | None,
                 batch_timed: bool = True) -> None:
        self.client = _client()
        self.topic = topic_of(dest)
        self.payload = payload
        self.levels_ms = levels_ms
        self.batch_timed = batch_timed
        self.proxy = self.client.Producer(f"cmp_p_{self.topic}"[:100], namesrv=namesrv, send_timeout=10.0,
                                          retries=2).blocking()
        self.producer = self.proxy.async_client

    def _message(self, seq: int, due: int) -> tuple[Any, int]:
        """The message for (seq, intended due), built right before it is sent: with delay levels the level
        is chosen from the current time, so its real due time (now + level delay) is what the broker
        computes from its store time (>= now), give or take the send's own latency."""
        if self.levels_ms is None:
            return self.client.Message(topic=self.topic, body=self.payload(seq, due), deliver_at=due), due
        level, real = quantize_to_level(self.levels_ms, now_ms(), due)
        return self.client.Message(topic=self.topic, body=self.payload(seq, real), delay_level=level), real

    async def _send_all(self, items: Sequence[tuple[int, int]]) -> list[int]:
        if self.levels_ms is None and self.batch_timed:
            return await self._send_batches(items)
        sem = asyncio.Semaphore(SEND_WINDOW)

        async def one(seq: int, due: int) -> int:
            async with sem:
                msg, real = self._message(seq, due)
                await self.producer.send(msg)
                return real

        return list(await asyncio.gather(*(one(s, d) for s, d in items)))

    async def _send_batches(self, items: Sequence[tuple[int, int]]) -> list[int]:
        """Timed messages go in batch requests (``Producer.send_batch``: one request per BATCH_SIZE
        messages, each with its own ``deliver_at``), BATCH_WINDOW requests in flight: the client's bulk
        path, as Redis gets a pipeline and RabbitMQ a confirm batch."""
        sem = asyncio.Semaphore(BATCH_WINDOW)

        async def one(chunk: Sequence[tuple[int, int]]) -> list[int]:
            async with sem:
                msgs = [self.client.Message(topic=self.topic, body=self.payload(seq, due), deliver_at=due)
                        for seq, due in chunk]
                await self.producer.send_batch(msgs)
                return [due for _seq, due in chunk]

        chunks = [items[i:i + BATCH_SIZE] for i in range(0, len(items), BATCH_SIZE)]
        out: list[int] = []
        for dues in await asyncio.gather(*(one(c) for c in chunks)):
            out.extend(dues)
        return out

    def schedule(self, items: Sequence[tuple[int, int]]) -> list[int]:
        return asyncio.run_coroutine_threadsafe(self._send_all(items), self.proxy.loop).result(300)

    def close(self) -> None:
        self.proxy.close()


class ChronomqConsumer(Consumer):
    def __init__(self, namesrv: str, dest: str, sink: Sink) -> None:
        client = _client()
        self.sink = sink
        topic = topic_of(dest)

        async def listener(msg: Any) -> Any:
            sink(msg.body, now_ms())
            return client.SUCCESS

        consumer = client.PushConsumer(f"cmp_c_{topic}"[:100], {topic: "*"}, listener, namesrv=namesrv,
                                       consume_from="first", concurrency=64, pull_batch_size=32,
                                       long_poll_timeout=5.0)
        self.proxy = consumer.blocking()

    def close(self) -> None:
        self.proxy.close()


class ChronomqPeer(Peer):
    name = "chronomq"
    client = "chronomq.client (asyncio Producer, 64 sends in flight; PushConsumer)"
    speaks_remoting = True

    def __init__(self, workdir: Path, flush: str = "ASYNC_FLUSH",
                 settings: dict[str, str] | None = None) -> None:
        super().__init__(workdir)
        if flush not in ("ASYNC_FLUSH", "SYNC_FLUSH"):
            raise ValueError(f"flush must be ASYNC_FLUSH or SYNC_FLUSH, not {flush!r}")
        self.flush = flush
        self.name = f"chronomq_{'sync' if flush == 'SYNC_FLUSH' else 'async'}"
        self.label = f"chronomq {'SYNC' if flush == 'SYNC_FLUSH' else 'ASYNC'}"
        self.settings = dict(settings or {})  # further broker settings (--set), stated with the durability
        self.durability = ", ".join([f"flushDiskType={flush}",
                                     *(f"{k}={v}" for k, v in self.settings.items())])
        self.proc: Any = None
        self._admin: Any = None
        self.timer_probe: dict[str, Any] | None = None
        self.batch_timed = True  # until after_start() has probed whether the broker honours timed batches

    def check(self) -> None:
        _client()
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        try:
            from tests.compat.harness import ChronomqProcess  # noqa: F401
        except ImportError as e:
            raise PeerUnavailable(f"tests/compat/harness.py (ChronomqProcess) is not importable: {e}") from e
        self.levels_ms = _levels_ms()  # until start() has probed the broker's timer

    def version(self) -> str:
        try:
            from chronomq import __version__
            from chronomq.store.speedups import describe
        except ImportError:
            return ""
        rev = ""
        with contextlib.suppress(OSError):
            head = (REPO / ".git" / "HEAD").read_text().strip()
            if head.startswith("ref: "):
                rev = (REPO / ".git" / head[5:]).read_text().strip()[:10]
            else:
                rev = head[:10]
        name = f"chronomq {__version__} ({rev})" if rev else f"chronomq {__version__}"
        return f"{name}, hot-path kernels {describe()}"  # the broker runs with this environment

    def start(self) -> None:
        self.check()
        from tests.compat.harness import ChronomqProcess

        self.workdir.mkdir(parents=True, exist_ok=True)
        overrides = {"flushDiskType": self.flush, "messageDelayLevel": LEVELS, **self.settings}
        self.proc = ChronomqProcess(self.data_dir, overrides)
        self.proc.start(timeout=60)
        self.levels_ms = _levels_ms()

    def after_start(self) -> None:
        """Probe the broker's timer (after the start-up figures were taken: not part of them)."""
        self.timer_probe = {"client_supports_deliver_at": supports_deliver_at()}
        if self.timer_probe["client_supports_deliver_at"]:
            self.timer_probe.update(self._probe_timer())
            if self.timer_probe.get("honoured"):
                self.levels_ms = None
                self.batch_timed = bool(self.timer_probe.get("batch_honoured"))

    def _probe_timer(self, delay_ms: int = 1_500) -> dict[str, Any]:
        """Does the broker honour ``deliver_at`` (the timer), or deliver such a message at once? The
        client may know the property before the broker does, so ask the broker: one message due in
        1.5 s, received early = not honoured (the bench then uses delay levels). The same for two timed
        messages in one batch request (Apache RocketMQ 5 stores a batch as it comes, its timer property
        unread, and delivers it at once): if not honoured, timed messages go one per request."""
        rec = Recorder("probe", "probe")
        consumer = self.consumer("cmp_timer_probe", rec.sink)
        try:
            payload = lambda seq, due: make_payload("probe", "probe", seq, due)  # noqa: E731
            single = ChronomqProducer(self.namesrv, "cmp_timer_probe", payload, None, batch_timed=False)
            batch = ChronomqProducer(self.namesrv, "cmp_timer_probe", payload, None, batch_timed=True)
            try:
                due = now_ms() + delay_ms
                sent = dict(zip([0], single.schedule([(0, due)]), strict=True))
                sent.update(zip([1, 2], batch.schedule([(1, due), (2, due)]), strict=True))
            finally:
                single.close()
                batch.close()
            got = rec.wait_for(3, time.monotonic() + delay_ms / 1000 + 10)
        finally:
            consumer.close()
        one = rec.summary(sent, only={0})
        two = rec.summary(sent, only={1, 2})
        return {"received": one["received"] == 1, "lateness_ms": one["max_ms"],
                "honoured": one["received"] == 1 and (one["min_ms"] or 0) >= 0,
                "batch_received": two["received"], "batch_lateness_ms": two["max_ms"],
                "batch_honoured": got and two["received"] == 2 and (two["min_ms"] or 0) >= 0}

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if self.levels_ms is None and self.batch_timed:
            d["client"] = (f"chronomq.client (asyncio Producer.send_batch: {BATCH_SIZE} timed messages per "
                           f"request, {BATCH_WINDOW} requests in flight; PushConsumer)")
        elif self.levels_ms is None:
            d["client"] = (f"chronomq.client (asyncio Producer.send: one timed message per request, "
                           f"{SEND_WINDOW} in flight, as the broker ignores the timer in batches; "
                           "PushConsumer)")
        d["delay_mode"] = "delay levels (messageDelayLevel)" if self.levels_ms is not None else \
            "deliver_at (timer)"
        d["timer_probe"] = self.timer_probe
        return d

    @property
    def namesrv(self) -> str:
        return self.proc.namesrv_addr

    def stop(self) -> None:
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close()
            self._admin = None
        if self.proc is not None:
            self.proc.stop(timeout=60)

    def kill9(self) -> None:
        self.proc.stop(kill=True)

    def restart(self) -> None:
        self.proc.start(timeout=120)

    def server_pids(self) -> list[int]:
        pid = self.proc.pid if self.proc is not None else None
        return [pid] if pid is not None and self.proc.running else []

    def log_tail(self) -> str:
        return self.proc.log_tail() if self.proc is not None else ""

    def _create_topic(self, topic: str) -> None:
        client = _client()
        if self._admin is None:
            self._admin = client.Admin(self.namesrv).blocking()
        self._admin.create_topic(topic, QUEUES)

    def producer(self, dest: str, payload: PayloadFn) -> Producer:
        self._create_topic(topic_of(dest))
        return ChronomqProducer(self.namesrv, dest, payload, self.levels_ms, self.batch_timed)

    def consumer(self, dest: str, sink: Sink) -> Consumer:
        self._create_topic(topic_of(dest))
        return ChronomqConsumer(self.namesrv, dest, sink)
