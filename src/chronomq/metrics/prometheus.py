"""The prometheus-client side of chronomq.metrics: the metric families of a broker's or a name server's
snapshot (``families``, ``namesrv_families``) and the HTTP endpoint serving them (``MetricsServer``).
Loaded only when a /metrics endpoint starts (see the package's docstring)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
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


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not worth a log line


class MetricsServer:
    """The HTTP endpoint (``/metrics``, prometheus-client's WSGI app) in a thread of its own; ``stop()``
    closes it within a poll interval (50 ms)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], host: str, port: int,
                 to_families: Callable[[dict[str, Any]], Iterator[Metric]] = families) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(snapshot, to_families))
        self._server = make_server(host, port, make_wsgi_app(self.registry), _Server, _QuietHandler)
        self.port = int(self._server.server_address[1])
        self.host = host
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="chronomq-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
