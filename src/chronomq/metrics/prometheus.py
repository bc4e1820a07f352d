"""The prometheus-client side of chronomq.metrics: the metric families of a broker's or a name server's
snapshot (``families``, ``namesrv_families``) and the HTTP endpoint serving them (``MetricsServer``).
Loaded only when a /metrics endpoint starts (see the package's docstring).

The endpoint serves HTTP and HTTPS on one port by a connection's first byte (0x16: a TLS handshake), as
the broker's remoting port does, following its ``tlsServerMode`` (docs/metrics.md, "HTTPS")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from . import DLQ_PREFIX, RETRY_PREFIX

log = logging.getLogger("chronomq.metrics")


def families(s: dict[str, Any]) -> Iterator[Metric]:
    """The metric families of one snapshot. Keys: ``cluster``, ``broker``, ``role``, ``put_messages``,
    ``put_failures``, ``topics`` {topic: messages}, ``groups`` [{group, topic, offset, diff}],
    ``commitlog`` {max, min}, ``delay_levels`` {level: pending}, ``timer`` {pending {topic: n},
    delivered, cancelled, rescheduled, early, lateness {buckets [(bound, cumulative)], count, sum}},
    ``traffic`` (``_traffic_families``), ``storage`` (``_storage_families``), ``replication`` {lag_bytes,
    lag_ms} or None."""
    base = [s["cluster"], s["broker"]]
    g = GaugeMetricFamily("rocketmq_producer_offset", "messages stored in a topic on this broker (queues' "
                          "max offsets)", labels=["cluster", "broker", "topic"])
    dlq = GaugeMetricFamily("chronomq_dlq_messages", "messages in a group's dead-letter topic",
                            labels=["cluster", "broker", "group"])
    retry = GaugeMetricFamily("chronomq_retry_messages", "messages in a group's retry topic",
                              labels=["cluster", "broker", "group"])
    for topic, n in sorted(s["topics"].items()):
        g.add_metric([*base, topic], n)
        if topic.startswith(DLQ_PREFIX):
            dlq.add_metric([*base, topic[len(DLQ_PREFIX):]], n)
        elif topic.startswith(RETRY_PREFIX):
            retry.add_metric([*base, topic[len(RETRY_PREFIX):]], n)
    yield from (g, dlq, retry)
    co = GaugeMetricFamily("rocketmq_consumer_offset", "a group's committed offsets in a topic (sum over "
                           "queues)", labels=["cluster", "broker", "topic", "group"])
    diff = GaugeMetricFamily("rocketmq_group_diff", "messages a group has yet to consume in a topic",
                             labels=["cluster", "broker", "topic", "group"])
    for row in s["groups"]:
        co.add_metric([*base, row["topic"], row["group"]], row["offset"])
        diff.add_metric([*base, row["topic"], row["group"]], row["diff"])
    yield from (co, diff)
    for name, key, text in (("chronomq_put_messages", "put_messages", "sends stored"),
                            ("chronomq_put_failures", "put_failures", "sends the store refused"),
                            ("chronomq_dedup_replays", "dedup_replays", "sends that repeated a UNIQ_KEY "
                             "already stored and were answered as the original (de-duplication)")):
        c = CounterMetricFamily(name, text, labels=["cluster", "broker"])
        c.add_metric(base, s.get(key, 0))
        yield c
    role = GaugeMetricFamily("chronomq_broker_role", "1 for this broker's role", labels=["cluster", "broker",
                                                                                             "role"])
    role.add_metric([*base, s["role"]], 1)
    yield role
    for name, key, text in (("chronomq_commitlog_max_offset_bytes", "max", "the commit log's end"),
                            ("chronomq_commitlog_min_offset_bytes", "min", "the commit log's oldest offset")):
        m = GaugeMetricFamily(name, text, labels=["cluster", "broker"])
        m.add_metric(base, s["commitlog"][key])
        yield m
    lv = GaugeMetricFamily("chronomq_delay_level_pending", "messages waiting under a delay level",
                           labels=["cluster", "broker", "level"])
    for level, n in sorted(s["delay_levels"].items()):
        lv.add_metric([*base, str(level)], n)
    yield lv
    t = s["timer"]
    tp = GaugeMetricFamily("chronomq_timer_pending", "messages waiting in the timer store for their deliver "
                           "time", labels=["cluster", "broker", "topic"])
    for topic, n in sorted(t["pending"].items()):
        tp.add_metric([*base, topic], n)
    yield tp
    for name, key, text in (("chronomq_timer_delivered", "delivered", "timed messages delivered"),
                            ("chronomq_timer_cancelled", "cancelled", "timed messages cancelled"),
                            ("chronomq_timer_rescheduled", "rescheduled", "timed messages rescheduled"),
                            ("chronomq_early_deliveries", "early", "deliveries before their time (stays 0)")):
        c = CounterMetricFamily(name, text, labels=["cluster", "broker"])
        c.add_metric(base, t[key])
        yield c
    yield _histogram("chronomq_timer_lateness_ms",
                     "from a timed message's due time to its put into the store, ms", base, t["lateness"])
    yield from _traffic_families(base, s["traffic"])
    yield from _storage_families(base, s["storage"])
    rep = s.get("replication")
    if rep is not None:
        for name, key, text in (("chronomq_replication_lag_bytes", "lag_bytes", "bytes the best slave lacks"),
                                ("chronomq_replication_lag_ms", "lag_ms", "how long ago the oldest byte the "
                                 "best slave lacks was appended")):
            m = GaugeMetricFamily(name, text, labels=["cluster", "broker"])
            m.add_metric(base, rep[key])
            yield m


def _histogram(name: str, text: str, base: list[str], h: dict[str, Any]) -> HistogramMetricFamily:
    """h: {buckets [(bound, cumulative count)], count, sum}."""
    fam = HistogramMetricFamily(name, text, labels=["cluster", "broker"])
    fam.add_metric(base, [(str(b), n) for b, n in h["buckets"]] + [("+Inf", h["count"])], h["sum"])
    return fam


def _traffic_families(base: list[str], t: dict[str, Any]) -> Iterator[Metric]:
    """t: in [(topic, message type, messages, body bytes)], out [(topic, group, messages, record bytes)],
    pull_lateness {buckets, count, sum}."""
    for direction, label, rows, msgs_text, bytes_text in (
            ("in", "message_type", t["in"], "messages received from producers",
             "bytes of message bodies received from producers"),
            ("out", "group", t["out"], "messages handed to consumers by pulls",
             "bytes of stored messages handed to consumers")):
        labels = ["cluster", "broker", "topic", label]
        msgs_fam = CounterMetricFamily(f"rocketmq_messages_{direction}", msgs_text, labels=labels)
        bytes_fam = CounterMetricFamily(f"rocketmq_throughput_{direction}", bytes_text, labels=labels)
        for topic, key, msgs, size in sorted(rows):
            msgs_fam.add_metric([*base, topic, key], msgs)
            bytes_fam.add_metric([*base, topic, key], size)
        yield from (msgs_fam, bytes_fam)
    yield _histogram("chronomq_pull_lateness_ms",
                     "from a timed message's due time to a pull that hands it to a consumer (each group's "
                     "pulls counted), ms", base, t["pull_lateness"])


def _storage_families(base: list[str], st: dict[str, Any]) -> Iterator[Metric]:
    """st: disk_ratio (0..1), flush {buckets, count, sum} (ms), flush_behind, dispatch_behind (bytes)."""
    d = GaugeMetricFamily("rocketmq_brokeruntime_commitlog_disk_ratio",
                          "used share of the store's disk, 0..1", labels=["cluster", "broker"])
    d.add_metric(base, st["disk_ratio"])
    yield d
    yield _histogram("chronomq_commitlog_flush_ms", "time a commit-log flush (msync) took, ms", base,
                     st["flush"])
    for name, key, text in (
            ("rocketmq_storage_flush_behind_bytes", "flush_behind",
             "commit-log bytes written but not yet flushed to disk"),
            ("rocketmq_storage_dispatch_behind_bytes", "dispatch_behind",
             "commit-log bytes not yet in their consume queues")):
        g = GaugeMetricFamily(name, text, labels=["cluster", "broker"])
        g.add_metric(base, st[key])
        yield g


def namesrv_families(s: dict[str, Any]) -> Iterator[Metric]:
    """A name server's figures. Keys: ``brokers`` [{cluster, broker, id, addr}], ``topics`` (count),
    ``requests`` (served since start)."""
    b = GaugeMetricFamily("chronomq_namesrv_broker", "1 for each registered broker address",
                          labels=["cluster", "broker", "id", "addr"])
    for row in s["brokers"]:
        b.add_metric([row["cluster"], row["broker"], str(row["id"]), row["addr"]], 1)
    yield b
    t = GaugeMetricFamily("chronomq_namesrv_topics", "topics with a route")
    t.add_metric([], s["topics"])
    yield t
    r = CounterMetricFamily("chronomq_namesrv_requests", "requests served")
    r.add_metric([], s["requests"])
    yield r


class _Collector:
    def __init__(self, snapshot: Callable[[], dict[str, Any]],
                 to_families: Callable[[dict[str, Any]], Iterator[Metric]]) -> None:
        self.snapshot = snapshot
        self.to_families = to_families

    def collect(self) -> Iterator[Metric]:
        try:
            s = self.snapshot()
        except Exception as e:  # a scrape must not take the server down; Prometheus sees the gap
            log.error("metrics: the figures could not be read: %s", e or type(e).__name__)
            return
        yield from self.to_families(s)


HANDSHAKE = 0x16  # a TLS record of type handshake: the first byte a TLS client sends
FIRST_BYTES_TIMEOUT_S = 10.0  # the first byte and, for TLS, the handshake must arrive within this
REFUSED_LOG_EVERY_S = 10.0
_HTTPS_ONLY_TEXT = b"this port serves HTTPS only (tlsServerMode is enforcing): use https://\n"
_HTTPS_ONLY = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(_HTTPS_ONLY_TEXT), _HTTPS_ONLY_TEXT))


class PortTls(Protocol):
    """What the endpoint asks of a port's TLS (``chronomq.remoting.tls.ServerTls`` is one): the mode and
    the context a TLS connection is served with (made or reloaded by ``context()``)."""

    mode: str
    serves_tls: bool
    serves_plaintext: bool

    def context(self) -> ssl.SSLContext: ...


def _peer(address: Any) -> str:
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) and len(address) >= 2 else str(address)


def _reason(e: ssl.SSLError) -> str:
    why = getattr(e, "verify_message", None) or getattr(e, "reason", None) or str(e)
    return str(why).lower().replace("_", " ")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    endpoint: MetricsServer | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        # in the connection's own thread (ThreadingMixIn): a slow first byte or handshake holds only it
        endpoint = self.endpoint
        conn = request if endpoint is None else endpoint._accept(request, client_address)
        if conn is None:
            return
        try:
            super().finish_request(conn, client_address)
        finally:
            if isinstance(conn, ssl.SSLSocket):  # TLS: close_notify, without waiting for the peer's
                with contextlib.suppress(OSError, ValueError):
                    conn.settimeout(0)
                    conn.unwrap()
                conn.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        e = sys.exc_info()[1]  # a peer gone mid-request: one DEBUG line, not a traceback on stderr
        log.debug("metrics: a request from %s failed: %s", _peer(client_address), e or type(e).__name__)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not worth a log line


class MetricsServer:
    """The HTTP endpoint (``/metrics``, prometheus-client's WSGI app) in a thread of its own; ``stop()``
    closes it within a poll interval (50 ms).

    ``tls`` (a port's TLS, see ``PortTls``): None or mode ``disabled``, plain HTTP; ``permissive``, HTTP and
    HTTPS on the port, told apart by a connection's first byte; ``enforcing``, HTTPS only, a plaintext
    request answered 400 and closed (a WARNING at once, then at most one every 10 s with the count since).
    ``loop``: ``tls.context()`` is called on that event loop (where the port's owner makes the self-signed
    certificate and reloads changed files), else in the connection's thread under a lock. A failed
    handshake is an INFO line. Counted: ``tls_connections``, ``tls_failures``, ``refused_by_tls_mode``."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], host: str, port: int,
                 to_families: Callable[[dict[str, Any]], Iterator[Metric]] = families, *,
                 tls: PortTls | None = None, loop: asyncio.AbstractEventLoop | None = None,
                 monotonic: Callable[[], float] = time.monotonic, name: str = "metrics") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(snapshot, to_families))
        self.tls = tls if tls is not None and tls.serves_tls else None
        self.https_only = self.tls is not None and not self.tls.serves_plaintext
        self.name = name
        self.tls_connections = 0
        self.tls_failures = 0
        self.refused_by_tls_mode = 0
        self._loop = loop
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._unlogged = 0
        self._logged_at: float | None = None
        self._server = make_server(host, port, make_wsgi_app(self.registry), _Server, _QuietHandler)
        if self.tls is not None:
            self._server.endpoint = self
        self.port = int(self._server.server_address[1])
        self.host = host
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="chronomq-metrics", daemon=True)
        self._thread.start()

    @property
    def scheme(self) -> str:
        """``http``, ``https`` or ``http+https`` (both on the port)."""
        if self.tls is None:
            return "http"
        return "https" if self.https_only else "http+https"

    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.https_only else 'http'}://{host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- one connection, in its own thread ----------------------------------------------------------------
    def _accept(self, sock: socket.socket, address: Any) -> socket.socket | None:
        """The socket to serve the connection on (``sock`` for plain HTTP, an ``ssl.SSLSocket`` once the
        handshake is done), or None when it was refused, failed or left (closed by the caller's
        ``shutdown_request``)."""
        assert self.tls is not None
        try:
            sock.settimeout(FIRST_BYTES_TIMEOUT_S)
            first = sock.recv(1, socket.MSG_PEEK)
        except OSError as e:  # socket.timeout included
            log.debug("%s: %s sent nothing: %s", self.name, _peer(address), e)
            return None
        if not first:
            return None
        if first[0] != HANDSHAKE:
            if not self.https_only:
                sock.settimeout(None)  # plain HTTP, as without TLS
                return sock
            self._refuse(sock, address)
            return None
        try:
            context = self._context()
        except Exception as e:  # the self-signed certificate cannot be made, the loop is gone
            log.error("%s: cannot serve TLS to %s: %s", self.name, _peer(address), e or type(e).__name__)
            return None
        try:
            conn = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        except (OSError, ValueError) as e:
            log.debug("%s: %s left before TLS: %s", self.name, _peer(address), e)
            return None
        try:
            conn.do_handshake()
        except ssl.SSLEOFError as e:  # the client closed during the handshake
            log.debug("%s: %s closed during the TLS handshake: %s", self.name, _peer(address), e)
            conn.close()
            return None
        except ssl.SSLError as e:
            with self._lock:
                self.tls_failures += 1
            log.info("%s: TLS handshake with %s failed: %s", self.name, _peer(address), _reason(e))
            conn.close()
            return None
        except OSError as e:  # timeout, reset
            log.debug("%s: %s left during the TLS handshake: %s", self.name, _peer(address), e)
            conn.close()
            return None
        with self._lock:
            self.tls_connections += 1
        return conn

    def _context(self) -> ssl.SSLContext:
        tls = self.tls
        assert tls is not None
        loop = self._loop
        if loop is None:
            with self._lock:
                return tls.context()

        async def on_loop() -> ssl.SSLContext:
            return tls.context()

        return asyncio.run_coroutine_threadsafe(on_loop(), loop).result(FIRST_BYTES_TIMEOUT_S)

    def _refuse(self, sock: socket.socket, address: Any) -> None:
        """Plain HTTP under ``enforcing``: a 400 that says why, then the connection closed (after the
        peer's request is read, so that the close does not reset the answer away)."""
        with self._lock:
            self.refused_by_tls_mode += 1
            self._unlogged += 1
            now = self._monotonic()
            last = self._logged_at
            due = last is None or now - last >= REFUSED_LOG_EVERY_S
            if due:
                count, self._unlogged, self._logged_at = self._unlogged, 0, now
        if due:
            log.warning("%s: refused %d connection(s)%s, the last from %s: plain HTTP refused: tlsServerMode "
                        "is enforcing (HTTPS only)", self.name, count,
                        "" if last is None else f" in {now - last:.0f} s", _peer(address))
        try:
            sock.settimeout(1.0)
            sock.sendall(_HTTPS_ONLY)
            sock.shutdown(socket.SHUT_WR)
            for _ in range(16):  # what the request left unread, until the peer closes
                if not sock.recv(65536):
                    break
        except OSError:
            pass
