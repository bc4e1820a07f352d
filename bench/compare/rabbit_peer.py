"""RabbitMQ delayed delivery the way its documentation describes it without plugins: a durable delay queue
whose messages carry a per-message TTL (``expiration``) and whose dead-letter exchange routes expired
messages to a durable ready queue the consumer reads.

Durability: durable classic queues, persistent messages (delivery_mode 2), publisher confirms awaited per
batch, consumer acknowledgements. The node runs from Debian's rabbitmq-server package with its own node
name, ports, mnesia/log dirs, Erlang cookie (temporary HOME) and its own epmd, all started and stopped by
PID."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .base import Consumer, PayloadFn, Peer, Producer, Sink, need_module
from .procs import PeerUnavailable, find_binary, free_ports, require_binary, spawn, stop_group, wait_port
from .workloads import now_ms

RABBIT_DIRS = ("/usr/lib/rabbitmq/bin",)
ACK_EVERY = 100
BOOT_TIMEOUT_S = 900  # a node recovering millions of messages after kill -9 takes minutes
ERLANG_DIRS = tuple(str(p) for p in sorted(Path("/usr/lib/erlang").glob("erts-*/bin"))) \
    if Path("/usr/lib/erlang").exists() else ()


def queue_names(dest: str) -> tuple[str, str]:
    return f"{dest}.delay", f"{dest}.ready"


def declare(channel: Any, dest: str) -> None:
    delay_q, ready_q = queue_names(dest)
    channel.queue_declare(ready_q, durable=True)
    # lazy: RabbitMQ 3.10's documented mode for queues that grow to millions of messages (they go to disk
    # at once instead of filling RAM until the memory alarm blocks every publisher)
    channel.queue_declare(delay_q, durable=True, arguments={
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": ready_q, "x-queue-mode": "lazy"})


class ConfirmingPublisher(Producer):
    """pika's asynchronous adapter (SelectConnection) on its own I/O thread: a batch is published in one go
    and ``schedule`` returns when the broker confirmed every message of it (a nack raises)."""

    def __init__(self, params: Any, dest: str, payload: PayloadFn) -> None:
        self.pika = need_module("pika", "pika, the RabbitMQ client")
        self.delay_q, _ = queue_names(dest)
        self.payload = payload
        self._opened = threading.Event()
        self._batch_done = threading.Event()
        self._error: str | None = None
        self._next_tag = 1
        self._pending: set[int] = set()
        self._nacked = 0
        self.channel: Any = None
        self.conn = self.pika.SelectConnection(params, on_open_callback=self._on_open,
                                               on_open_error_callback=self._on_open_error,
                                               on_close_callback=self._on_closed)
        self._thread = threading.Thread(target=self.conn.ioloop.start, name="pika-publisher", daemon=True)
        self._thread.start()
        if not self._opened.wait(30) or self._error:
            self.close()
            raise RuntimeError(f"RabbitMQ publisher did not open: {self._error or 'timeout'}")

    # -- callbacks (I/O thread)
    def _on_open(self, conn: Any) -> None:
        conn.channel(on_open_callback=self._on_channel)

    def _on_open_error(self, _conn: Any, err: Any) -> None:
        self._error = str(err)
        self._opened.set()
        self._batch_done.set()

    def _on_closed(self, _conn: Any, reason: Any) -> None:
        if self._error is None:
            self._error = f"connection closed: {reason}"
        self._batch_done.set()
        self.conn.ioloop.stop()

    def _on_channel(self, channel: Any) -> None:
        self.channel = channel
        channel.confirm_delivery(self._on_confirm, callback=lambda _frame: self._opened.set())

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tag = method.delivery_tag
        if isinstance(method, self.pika.spec.Basic.Nack):
            self._nacked += 1 if not method.multiple else sum(1 for t in self._pending if t <= tag)
        if method.multiple:
            self._pending = {t for t in self._pending if t > tag}
        else:
            self._pending.discard(tag)
        if not self._pending:
            self._batch_done.set()

    def _publish(self, bodies: list[tuple[bytes, int]]) -> None:
        try:
            for body, due in bodies:
                # the TTL runs from the moment the queue gets the message: compute it as late as possible
                ttl = max(0, due - now_ms())
                self.channel.basic_publish(
                    "", self.delay_q, body,
                    self.pika.BasicProperties(delivery_mode=2, expiration=str(ttl)))
                self._pending.add(self._next_tag)
                self._next_tag += 1
        except Exception as e:
            self._error = f"publish failed: {e!r}"
            self._batch_done.set()

    # -- caller thread
    def schedule(self, items: Sequence[tuple[int, int]]) -> list[int]:
        if self._error:
            raise RuntimeError(self._error)
        bodies = [(self.payload(seq, due), due) for seq, due in items]
        self._batch_done.clear()
        self.conn.ioloop.add_callback_threadsafe(lambda: self._publish(bodies))
        if not self._batch_done.wait(120):
            raise RuntimeError("RabbitMQ did not confirm a batch within 120 s")
        if self._error:
            raise RuntimeError(self._error)
        if self._nacked:
            raise RuntimeError(f"RabbitMQ nacked {self._nacked} messages")
        return [due for _, due in items]

    def close(self) -> None:
        def _close() -> None:
            if self.conn.is_open:
                self.conn.close()
            else:
                self.conn.ioloop.stop()
        with contextlib.suppress(Exception):
            self.conn.ioloop.add_callback_threadsafe(_close)
        self._thread.join(15)


class RabbitConsumer(Consumer):
    """A BlockingConnection consumer on its own thread (prefetch 1000, manual acks with ``multiple=True``
    every ACK_EVERY messages and after each I/O round); reconnects when the node goes away (the restart
    workload) until closed."""

    def __init__(self, params: Any, dest: str, sink: Sink) -> None:
        self.pika = need_module("pika", "pika, the RabbitMQ client")
        self.params = params
        self.dest = dest
        self.ready_q = queue_names(dest)[1]
        self.sink = sink
        self.reconnects = 0
        self.last_error = ""
        self._unacked = 0
        self._last_tag = 0
        self._stop = threading.Event()
        self._subscribed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pika-consumer-{dest}", daemon=True)
        self._thread.start()
        if not self._subscribed.wait(30):
            self.close()
            raise RuntimeError(f"RabbitMQ consumer on {self.ready_q} did not subscribe within 30 s")

    def _on_message(self, ch: Any, method: Any, _props: Any, body: bytes) -> None:
        self.sink(body, now_ms())
        self._last_tag = method.delivery_tag
        self._unacked += 1
        if self._unacked >= ACK_EVERY:
            self._ack(ch)

    def _ack(self, ch: Any) -> None:
        """One acknowledgement for everything received so far (``multiple=True``), as RabbitMQ's
        documentation suggests to cut per-message ack traffic."""
        if self._unacked:
            ch.basic_ack(self._last_tag, multiple=True)
            self._unacked = 0

    def _run(self) -> None:
        pika = self.pika
        while not self._stop.is_set():
            conn = None
            try:
                conn = pika.BlockingConnection(self.params)
                ch = conn.channel()
                declare(ch, self.dest)
                ch.basic_qos(prefetch_count=1000)
                self._unacked = 0
                ch.basic_consume(self.ready_q, self._on_message)
                self._subscribed.set()
                while not self._stop.is_set():
                    conn.process_data_events(time_limit=0.05)
                    self._ack(ch)  # whatever arrived in this round
            except Exception as e:  # the node went away (or is still booting): reconnect until closed
                self.reconnects += 1
                self.last_error = f"{type(e).__name__}: {e}"
                self._stop.wait(0.1)
            finally:
                if conn is not None and conn.is_open:
                    with contextlib.suppress(Exception):
                        conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)


class RabbitPeer(Peer):
    name = "rabbitmq"
    label = "RabbitMQ TTL+DLX"
    durability = "durable queues (delay queue lazy), persistent msgs, confirms per batch"
    client = "pika (SelectConnection confirms per batch; BlockingConnection consumer, batched acks)"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.port = self.dist_port = self.epmd_port = 0
        self.proc: subprocess.Popen | None = None
        self.epmd: subprocess.Popen | None = None
        self.node = ""
        self._server = self._epmd_bin = ""

    def check(self) -> None:
        self._server = require_binary("rabbitmq-server", RABBIT_DIRS, package="rabbitmq-server")
        # the real server script, not Debian's /usr/sbin wrapper that switches to the rabbitmq user
        direct = Path(RABBIT_DIRS[0]) / "rabbitmq-server"
        if direct.exists():
            self._server = str(direct)
        epmd = find_binary("epmd", ERLANG_DIRS)
        if epmd is None:
            raise PeerUnavailable("epmd (Erlang) not found; install RabbitMQ with: "
                                  "apt-get install -y redis-server rabbitmq-server")
        self._epmd_bin = epmd
        need_module("pika", "pika, the RabbitMQ client")

    def version(self) -> str:
        try:
            out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "rabbitmq-server"],
                                 capture_output=True, text=True, timeout=10).stdout
        except OSError:
            return ""
        return f"rabbitmq-server {out.strip()}" if out.strip() else ""

    def params(self) -> Any:
        pika = need_module("pika", "pika, the RabbitMQ client")
        return pika.ConnectionParameters("127.0.0.1", self.port, heartbeat=0, blocked_connection_timeout=300)

    def _env(self) -> dict[str, str]:
        home = self.workdir / "home"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update({
            "HOME": str(home),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_MNESIA_BASE": str(self.data_dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.workdir / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.workdir / "rabbitmq"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.workdir / "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": str(self.workdir / "rabbitmq-env.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.workdir / "advanced.config"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        })
        return env

    def _launch(self) -> None:
        self.proc = spawn([self._server], self.workdir / "rabbitmq.out", env=self._env(), cwd=self.workdir)
        wait_port(self.port, BOOT_TIMEOUT_S, self.proc, "rabbitmq-server")
        pika = need_module("pika", "pika")
        # after kill -9 the node recovers its queue indexes (minutes with a million messages in a lazy
        # queue) before it accepts logins: that wait is part of the restart time the bench reports
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while True:  # the listener can be up a moment before the node accepts logins
            try:
                pika.BlockingConnection(self.params()).close()
                return
            except pika.exceptions.AMQPError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"rabbitmq did not accept connections; see {self.workdir}/log") from None
                time.sleep(0.1)

    def start(self) -> None:
        if not self._server:
            self.check()
        home = self.workdir / "home"
        home.mkdir(parents=True, exist_ok=True)
        cookie = home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(16).upper())
        cookie.chmod(0o600)
        (self.workdir / "enabled_plugins").write_text("[].\n")
        (self.workdir / "rabbitmq-env.conf").write_text("")
        (self.workdir / "advanced.config").write_text("[].\n")
        self.port, self.dist_port, self.epmd_port = free_ports(3)
        (self.workdir / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "loopback_users = none\n"
            "disk_free_limit.absolute = 50MB\n"
            "log.file.level = warning\n"
            "log.console = false\n")
        self.node = f"cmp{self.port}@localhost"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.epmd = spawn([self._epmd_bin, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                          self.workdir / "epmd.log", env={**os.environ, "HOME": str(home)})
        wait_port(self.epmd_port, 15, self.epmd, "epmd")
        self._launch()

    def stop(self) -> None:
        try:
            stop_group(self.proc, timeout=60)
        finally:
            self.proc = None
            stop_group(self.epmd)
            self.epmd = None

    def kill9(self) -> None:
        stop_group(self.proc, kill=True)
        self.proc = None

    def restart(self) -> None:
        self._launch()

    def server_pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None else []

    def producer(self, dest: str, payload: PayloadFn) -> Producer:
        pika = need_module("pika", "pika")
        conn = pika.BlockingConnection(self.params())
        try:
            declare(conn.channel(), dest)
        finally:
            conn.close()
        return ConfirmingPublisher(self.params(), dest, payload)

    def consumer(self, dest: str, sink: Sink) -> Consumer:
        return RabbitConsumer(self.params(), dest, sink)

    def backlog(self, dest: str) -> dict[str, Any]:
        pika = need_module("pika", "pika")
        conn = pika.BlockingConnection(self.params())
        try:
            ch = conn.channel()
            return {q: ch.queue_declare(q, durable=True, passive=True).method.message_count
                    for q in queue_names(dest)}
        finally:
            conn.close()
