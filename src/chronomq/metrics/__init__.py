"""Prometheus metrics of a broker or a name server (prometheus-client), fed by them: ``MetricsServer(
snapshot, host, port)`` starts the HTTP endpoint, and at each scrape ``snapshot()`` returns the figures as
a plain dict (see ``families`` and ``namesrv_families`` for the keys), which become metric families.
The hot path only adds to the broker's traffic counters (a dict entry per request); the rest is read at
scrape time.

Names follow rocketmq-exporter and RocketMQ 5's own metrics where the thing is the same
(``rocketmq_producer_offset``, ``rocketmq_consumer_offset``, ``rocketmq_group_diff``,
``rocketmq_messages_in_total``, ``rocketmq_throughput_out_total``, ...; labels ``cluster``, ``broker``,
``topic``, ``group``, ``level``); what only chronomq has is ``chronomq_*`` (delay levels, the timer,
lateness, replication).

This package holds only what the broker uses without an endpoint (the lateness buckets); the families and
the endpoint live in ``prometheus.py``, imported when one of its names is first asked for
(``from chronomq.metrics import MetricsServer``): a broker started with metricsPort=-1 never loads
prometheus-client or its HTTP server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .prometheus import MetricsServer, families, namesrv_families

__all__ = ["DLQ_PREFIX", "LATENESS_BUCKETS_MS", "RETRY_PREFIX", "MetricsServer", "families",
           "namesrv_families"]

# Lateness histogram bounds, ms (due time -> put into the store)
LATENESS_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 30_000, 60_000)
DLQ_PREFIX, RETRY_PREFIX = "%DLQ%", "%RETRY%"

_LAZY = frozenset({"MetricsServer", "families", "namesrv_families"})


def __getattr__(name: str) -> Any:
    """The endpoint's names, from prometheus.py on first use (PEP 562)."""
    if name in _LAZY:
        from . import prometheus

        return getattr(prometheus, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
