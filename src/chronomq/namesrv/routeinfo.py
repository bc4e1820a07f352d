"""The name server's route table (RocketMQ's RouteInfoManager).

Brokers register their topic configs (REGISTER_BROKER, every 30 s); a broker that stays silent for
120 s, or whose connection closes, is dropped with its queues. Several brokers can register: different
broker names, and a master (brokerId 0) with slaves (brokerId >= 1) under one name. Only a master's
registration updates the topic queues (as in RocketMQ). Pure logic, no I/O; ``now_ms`` comes from the
caller's clock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

BROKER_EXPIRE_MS = 120_000
MASTER_ID = 0


@dataclass
class QueueData:
    brokerName: str
    readQueueNums: int
    writeQueueNums: int
    perm: int
    topicSysFlag: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "brokerName": self.brokerName,
            "readQueueNums": self.readQueueNums,
            "writeQueueNums": self.writeQueueNums,
            "perm": self.perm,
            "topicSysFlag": self.topicSysFlag,
        }


@dataclass
class BrokerData:
    cluster: str
    brokerName: str
    brokerAddrs: dict[int, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "brokerName": self.brokerName,
            "brokerAddrs": {str(k): v for k, v in sorted(self.brokerAddrs.items())},
        }


@dataclass
class BrokerLive:
    last_update_ms: int
    data_version: dict[str, Any]
    ha_server_addr: str
    conn_id: int | None


class RouteInfoManager:
    def __init__(self, expire_ms: int = BROKER_EXPIRE_MS) -> None:
        self.expire_ms = expire_ms
        self._lock = threading.RLock()
        self.topic_queues: dict[str, dict[str, QueueData]] = {}
        self.brokers: dict[str, BrokerData] = {}
        self.clusters: dict[str, set[str]] = {}
        self.live: dict[str, BrokerLive] = {}  # broker address -> liveness

    # --- registration -------------------------------------------------------------------------------
    def register_broker(
        self,
        cluster: str,
        broker_name: str,
        broker_addr: str,
        broker_id: int,
        ha_server_addr: str,
        topic_configs: dict[str, dict[str, Any]] | None,
        data_version: dict[str, Any] | None,
        now_ms: int,
        conn_id: int | None = None,
    ) -> dict[str, str]:
        """Register (or refresh) a broker. Returns {"masterAddr", "haServerAddr"} for slaves."""
        with self._lock:
            self.clusters.setdefault(cluster, set()).add(broker_name)
            bd = self.brokers.get(broker_name)
            if bd is None:
                bd = self.brokers[broker_name] = BrokerData(cluster, broker_name)
            bd.cluster = cluster
            # one address holds one id: a broker that switched role replaces its old entry
            for bid, addr in list(bd.brokerAddrs.items()):
                if addr == broker_addr and bid != broker_id:
                    del bd.brokerAddrs[bid]
            bd.brokerAddrs[broker_id] = broker_addr
            prev = self.live.get(broker_addr)
            changed = prev is None or prev.data_version != (data_version or {})
            self.live[broker_addr] = BrokerLive(now_ms, dict(data_version or {}), ha_server_addr, conn_id)
            if broker_id == MASTER_ID and topic_configs is not None and changed:
                self._replace_topics(broker_name, topic_configs)
            elif broker_id == MASTER_ID and topic_configs is not None:
                # same data version: only add what is missing (cheap refresh)
                for name, topic_config in topic_configs.items():
                    if broker_name not in self.topic_queues.get(name, {}):
                        self._put_queue(broker_name, name, topic_config)
            result = {"masterAddr": "", "haServerAddr": ""}
            if broker_id != MASTER_ID:
                master = bd.brokerAddrs.get(MASTER_ID)
                if master:
                    result["masterAddr"] = master
                    live = self.live.get(master)
                    result["haServerAddr"] = live.ha_server_addr if live else ""
            return result

    def _put_queue(self, broker_name: str, topic: str, topic_config: dict[str, Any]) -> None:
        self.topic_queues.setdefault(topic, {})[broker_name] = QueueData(
            broker_name,
            int(topic_config.get("readQueueNums", 0)),
            int(topic_config.get("writeQueueNums", 0)),
            int(topic_config.get("perm", 6)),
            int(topic_config.get("topicSysFlag", 0)),
        )

    def _replace_topics(self, broker_name: str, topic_configs: dict[str, dict[str, Any]]) -> None:
        for name, topic_config in topic_configs.items():
            self._put_queue(broker_name, name, topic_config)
        for name in list(self.topic_queues):
            if name not in topic_configs:
                self._drop_queue(name, broker_name)

    def _drop_queue(self, topic: str, broker_name: str) -> None:
        qs = self.topic_queues.get(topic)
        if qs is not None:
            qs.pop(broker_name, None)
            if not qs:
                del self.topic_queues[topic]

    def unregister_broker(self, cluster: str, broker_name: str, broker_addr: str, broker_id: int) -> None:
        with self._lock:
            self.live.pop(broker_addr, None)
            bd = self.brokers.get(broker_name)
            if bd is not None:
                if bd.brokerAddrs.get(broker_id) == broker_addr:
                    del bd.brokerAddrs[broker_id]
                else:
                    for bid, addr in list(bd.brokerAddrs.items()):
                        if addr == broker_addr:
                            del bd.brokerAddrs[bid]
                if not bd.brokerAddrs:
                    del self.brokers[broker_name]
                    names = self.clusters.get(bd.cluster)
                    if names is not None:
                        names.discard(broker_name)
                        if not names:
                            del self.clusters[bd.cluster]
                    for topic in list(self.topic_queues):
                        self._drop_queue(topic, broker_name)

    def delete_topic(self, topic: str, cluster: str | None = None) -> None:
        """DELETE_TOPIC_IN_NAMESRV (RocketMQ's deleteTopic): the topic's route, or with ``cluster`` only
        its queues on that cluster's brokers. A broker that still has the topic registers it again."""
        with self._lock:
            if not cluster:
                self.topic_queues.pop(topic, None)
                return
            for name in self.clusters.get(cluster) or ():
                self._drop_queue(topic, name)

    def _remove_addr(self, addr: str) -> None:
        for bd in list(self.brokers.values()):
            for bid, a in list(bd.brokerAddrs.items()):
                if a == addr:
                    self.unregister_broker(bd.cluster, bd.brokerName, addr, bid)
                    return
        self.live.pop(addr, None)

    def expire(self, now_ms: int) -> list[str]:
        """Drop brokers silent for longer than expire_ms; returns their addresses."""
        with self._lock:
            dead = [a for a, lv in self.live.items() if now_ms - lv.last_update_ms > self.expire_ms]
            for a in dead:
                self._remove_addr(a)
            return dead

    def on_connection_closed(self, conn_id: int) -> list[str]:
        with self._lock:
            dead = [a for a, lv in self.live.items() if lv.conn_id == conn_id]
            for a in dead:
                self._remove_addr(a)
            return dead

    # --- queries --------------------------------------------------------------------------------------
    def topic_route(self, topic: str) -> dict[str, Any] | None:
        with self._lock:
            qs = self.topic_queues.get(topic)
            if not qs:
                return None
            queue_datas = [q.to_json() for _, q in sorted(qs.items())]
            broker_datas = [self.brokers[b].to_json() for b in sorted(qs) if b in self.brokers]
            if not broker_datas:
                return None
            return {
                "orderTopicConf": None,
                "queueDatas": queue_datas,
                "brokerDatas": broker_datas,
                "filterServerTable": {},
            }

    def cluster_info(self) -> dict[str, Any]:
        with self._lock:
            return {
                "brokerAddrTable": {n: b.to_json() for n, b in sorted(self.brokers.items())},
                "clusterAddrTable": {c: sorted(ns) for c, ns in sorted(self.clusters.items())},
            }

    def topic_list(self) -> list[str]:
        """Every topic with a route, as RocketMQ's getAllTopicList: the brokers' built-in topics (named
        after their cluster and broker) included; system_topic_list tells them apart."""
        with self._lock:
            return sorted(self.topic_queues)

    def system_topic_list(self) -> dict[str, Any]:
        """RocketMQ's getSystemTopicList (GET_SYSTEM_TOPIC_LIST_FROM_NS): the cluster names and broker
        names (the topics brokers register after them), and one broker address to ask for more."""
        with self._lock:
            topics: list[str] = []
            for cluster, names in sorted(self.clusters.items()):
                topics.append(cluster)
                topics.extend(sorted(names))
            addr = next((bd.brokerAddrs[min(bd.brokerAddrs)] for _, bd in sorted(self.brokers.items())
                         if bd.brokerAddrs), None)
            out: dict[str, Any] = {"topicList": topics}
            if addr is not None:
                out["brokerAddr"] = addr
            return out

    def topics_by_cluster(self, cluster: str) -> list[str]:
        """The topics with queues on a broker of ``cluster`` (GET_TOPICS_BY_CLUSTER; none for a cluster
        the name server does not know, as RocketMQ answers)."""
        with self._lock:
            names = self.clusters.get(cluster) or set()
            return sorted(t for t, qs in self.topic_queues.items() if not names.isdisjoint(qs))
