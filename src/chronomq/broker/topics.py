"""Topic configuration: the broker's topic table, auto-creation and persistence (config/topics.json).

Built-in topics, present from the start whatever topics.json says (their shape follows the current
configuration), as RocketMQ's TopicConfigManager makes them: TBW102 (the default topic auto-created
topics inherit from; perm RW + INHERIT when autoCreateTopicEnable), SCHEDULE_TOPIC_XXXX (one queue per
delay level), the topic named after the cluster (16 queues) and the one named after this broker (1
queue), both INHERIT, plus RW when clusterTopicEnable / brokerTopicEnable. The last two give the name
server a route for the cluster and broker names: the Java admin's createTopic(key=clusterName, ...)
looks the cluster-named topic up to find the masters it sends UPDATE_AND_CREATE_TOPIC to.

Made on demand: %RETRY%<group> (1 queue, created on a clustering consumer's heartbeat or on
send-back) and %DLQ%<group> (1 queue).

System topics (``is_system_topic``, RocketMQ's TopicValidator.isSystemTopic): the fixed names below,
every name starting with rmq_sys_, and the built-in topics of this broker (its cluster and broker
names). UPDATE_AND_CREATE_TOPIC refuses them; %RETRY% and %DLQ% topics are not system topics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chronomq.message import (
    DEFAULT_TOPIC,
    DLQ_GROUP_TOPIC_PREFIX,
    REPLY_TOPIC_POSTFIX,
    RETRY_GROUP_TOPIC_PREFIX,
    SCHEDULE_TOPIC,
    validate_topic,
)
from chronomq.remoting.codes import PERM_INHERIT, PERM_READ, PERM_WRITE

from .persist import read_json, write_json_atomic

log = logging.getLogger("chronomq.broker")

PERM_RW = PERM_READ | PERM_WRITE

# RocketMQ's TopicValidator: its fixed system topic names and prefix
SYSTEM_TOPIC_PREFIX = "rmq_sys_"
SYSTEM_TOPICS = frozenset({
    DEFAULT_TOPIC, SCHEDULE_TOPIC, "BenchmarkTest", "RMQ_SYS_TRANS_HALF_TOPIC", "RMQ_SYS_TRACE_TOPIC",
    "RMQ_SYS_TRANS_OP_HALF_TOPIC", "TRANS_CHECK_MAX_TIME_TOPIC", "SELF_TEST_TOPIC", "OFFSET_MOVED_EVENT",
})
# the cluster-named topic keeps RocketMQ's TopicConfig default queue numbers
CLUSTER_TOPIC_QUEUE_NUMS = 16


@dataclass
class TopicConfig:
    topicName: str
    readQueueNums: int = 4
    writeQueueNums: int = 4
    perm: int = PERM_RW
    topicFilterType: str = "SINGLE_TAG"
    topicSysFlag: int = 0
    order: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TopicConfig:
        return cls(
            topicName=str(d["topicName"]),
            readQueueNums=int(d.get("readQueueNums", 4)),
            writeQueueNums=int(d.get("writeQueueNums", 4)),
            perm=int(d.get("perm", PERM_RW)),
            topicFilterType=str(d.get("topicFilterType", "SINGLE_TAG")),
            topicSysFlag=int(d.get("topicSysFlag", 0)),
            order=bool(d.get("order", False)),
        )


class TopicError(ValueError):
    pass


class TopicConfigManager:
    def __init__(
        self,
        config_dir: Path,
        default_queue_nums: int,
        auto_create: bool,
        schedule_queue_nums: int,
        now_ms: Callable[[], int],
        cluster_name: str = "",
        broker_name: str = "",
        cluster_topic_enable: bool = True,
        broker_topic_enable: bool = True,
    ) -> None:
        self.path = config_dir / "topics.json"
        self.default_queue_nums = default_queue_nums
        self.auto_create = auto_create
        self._now_ms = now_ms
        self._lock = threading.RLock()
        self._file_lock = threading.Lock()
        self._persist_queued = False
        self.table: dict[str, TopicConfig] = {}
        self.data_version = {"timestamp": now_ms(), "counter": 0}
        self.on_change: list[Callable[[TopicConfig], None]] = []
        self._dirty = False
        self._load()
        # system topics (always present, their shape follows the current config)
        default_perm = PERM_RW | (PERM_INHERIT if auto_create else 0)
        self.table[DEFAULT_TOPIC] = TopicConfig(
            DEFAULT_TOPIC, default_queue_nums, default_queue_nums, default_perm
        )
        self.table[SCHEDULE_TOPIC] = TopicConfig(
            SCHEDULE_TOPIC, schedule_queue_nums, schedule_queue_nums, PERM_RW
        )
        builtin = [DEFAULT_TOPIC, SCHEDULE_TOPIC]
        # request-reply: where replies are sent (RocketMQ's TopicConfigManager: 1 queue, perm 6)
        if cluster_name:
            reply = f"{cluster_name}_{REPLY_TOPIC_POSTFIX}"
            self.table[reply] = TopicConfig(reply, 1, 1, PERM_RW)
            builtin.append(reply)
        # the cluster's and the broker's own topics (the broker's wins when the two names are the same)
        for name, nums, enabled in ((cluster_name, CLUSTER_TOPIC_QUEUE_NUMS, cluster_topic_enable),
                                    (broker_name, 1, broker_topic_enable)):
            if name:
                self.table[name] = TopicConfig(name, nums, nums, PERM_INHERIT | (PERM_RW if enabled else 0))
                builtin.append(name)
        self.builtin: tuple[str, ...] = tuple(builtin)  # kept when a slave takes its master's table

    def _load(self) -> None:
        obj = read_json(self.path)
        if not obj:
            return
        for name, d in (obj.get("topicConfigTable") or {}).items():
            try:
                self.table[name] = TopicConfig.from_json(d)
            except (KeyError, TypeError, ValueError) as e:
                log.error("topics.json: skipping bad entry %r: %s", name, e)
        dv = obj.get("dataVersion")
        if isinstance(dv, dict):
            self.data_version = {
                "timestamp": int(dv.get("timestamp", 0)),
                "counter": int(dv.get("counter", 0)),
            }

    def persist(self) -> None:
        with self._file_lock:  # one writer of the file at a time
            with self._lock:
                snapshot = {
                    "topicConfigTable": {n: t.to_json() for n, t in self.table.items()},
                    "dataVersion": dict(self.data_version),
                }
                self._dirty = False
            write_json_atomic(self.path, snapshot)

    def _persist_soon(self) -> None:
        """Write topics.json in a background thread (an fsync on a busy disk must not stall the event
        loop); writes coalesce, and shutdown calls persist() to be sure the last state is on disk."""
        with self._lock:
            if self._persist_queued:
                return
            self._persist_queued = True

        def run() -> None:
            with self._lock:
                self._persist_queued = False
            try:
                self.persist()
            except OSError as e:
                log.error("cannot persist %s: %s", self.path, e)

        threading.Thread(target=run, name="topics-persist", daemon=True).start()

    def _changed(self, topic_config: TopicConfig) -> None:
        self.data_version = {"timestamp": self._now_ms(), "counter": self.data_version["counter"] + 1}
        self._dirty = True
        self._persist_soon()
        for cb in self.on_change:
            try:
                cb(topic_config)
            except Exception:
                log.exception("topic change callback failed")

    # --- lookups ------------------------------------------------------------------------------------------
    def get(self, topic: str) -> TopicConfig | None:
        return self.table.get(topic)

    def is_system_topic(self, topic: str) -> bool:
        """RocketMQ's TopicValidator.isSystemTopic on this broker: the fixed names, the rmq_sys_ prefix,
        and this broker's built-in topics (its cluster and broker names)."""
        return topic in SYSTEM_TOPICS or topic.startswith(SYSTEM_TOPIC_PREFIX) or topic in self.builtin

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {n: t.to_json() for n, t in self.table.items()}

    # --- creation -----------------------------------------------------------------------------------------
    def update(self, topic_config: TopicConfig) -> TopicConfig:
        reason = validate_topic(topic_config.topicName)
        if reason:
            raise TopicError(reason)
        with self._lock:
            old = self.table.get(topic_config.topicName)
            if old == topic_config:
                return old
            self.table[topic_config.topicName] = topic_config
            self._changed(topic_config)
            log.info(
                "topic %s %s: %d/%d queues, perm %d",
                topic_config.topicName,
                "updated" if old else "created",
                topic_config.readQueueNums,
                topic_config.writeQueueNums,
                topic_config.perm,
            )
            return topic_config

    def replace_all(self, configs: dict[str, TopicConfig], data_version: dict[str, int]) -> list[TopicConfig]:
        """A slave takes its master's whole table and data version (slave_sync.py); the system topics stay
        if the master's table lacks them. Returns the configs that were added, changed or removed; the
        change callbacks run once for them, and the caller persists."""
        with self._lock:
            new = dict(configs)
            for name in self.builtin:
                if name not in new and name in self.table:
                    new[name] = self.table[name]
            changed = [cfg for name, cfg in new.items() if self.table.get(name) != cfg]
            changed += [cfg for name, cfg in self.table.items() if name not in new]
            self.table = new
            self.data_version = {"timestamp": int(data_version["timestamp"]),
                                 "counter": int(data_version["counter"])}
            self._dirty = True
        if changed:
            log.info("topic config taken from the master: %d topics, %d changed", len(new), len(changed))
        for cfg in changed[:1]:  # one call is enough: the callbacks re-register the whole table
            for cb in self.on_change:
                try:
                    cb(cfg)
                except Exception:
                    log.exception("topic change callback failed")
        return changed

    def delete(self, topic: str) -> bool:
        with self._lock:
            topic_config = self.table.pop(topic, None)
            if topic_config is None:
                return False
            self._changed(topic_config)
            return True

    def create_in_send(
        self, topic: str, default_topic: str | None, client_queue_nums: int
    ) -> TopicConfig | None:
        """The topic a producer sends to; auto-created from its default topic when that one has
        INHERIT (RocketMQ's createTopicInSendMessageMethod): TBW102 has it when autoCreateTopicEnable,
        the cluster- and broker-named topics always (a producer's createTopicKey may name them).
        Returns None when the topic does not exist and cannot be created. A retry or dead-letter topic
        that the default topic cannot create gets one queue, as RocketMQ's send-back creates it; when the
        default topic can, it is created from it like any other (a producer that resends to a retry
        topic picks its queue from the default topic's route)."""
        topic_config = self.table.get(topic)
        if topic_config is not None:
            return topic_config
        with self._lock:
            topic_config = self.table.get(topic)
            if topic_config is not None:
                return topic_config
            default = self.table.get(default_topic or DEFAULT_TOPIC)
            if default is not None and default.perm & PERM_INHERIT and (
                    default.topicName != DEFAULT_TOPIC or self.auto_create):
                nums = min(max(1, client_queue_nums or self.default_queue_nums), default.writeQueueNums)
                return self.update(TopicConfig(topic, nums, nums, default.perm & ~PERM_INHERIT))
        if topic.startswith((RETRY_GROUP_TOPIC_PREFIX, DLQ_GROUP_TOPIC_PREFIX)):
            return self.create_system(topic, 1)
        return None

    def create_system(self, topic: str, queue_nums: int, perm: int = PERM_RW) -> TopicConfig:
        topic_config = self.table.get(topic)
        if topic_config is not None:
            return topic_config
        with self._lock:
            topic_config = self.table.get(topic)
            if topic_config is not None:
                return topic_config
            return self.update(TopicConfig(topic, queue_nums, queue_nums, perm))
