"""Subscription groups: the broker's consumer-group table, persisted to config/subscriptionGroup.json
(RocketMQ's SubscriptionGroupManager and its file layout: {"subscriptionGroupTable": {name: config},
"forbiddenTable": {}, "dataVersion": {...}}).

A group is created by UPDATE_AND_CREATE_SUBSCRIPTIONGROUP, or on its first heartbeat when
autoCreateSubscriptionGroup is on (``find``); RocketMQ's built-in groups (TOOLS_CONSUMER, ...) are
always present. Every change is written at once (atomically, with a .bak). A config keeps the keys
chronomq does not read (groupRetryPolicy, attributes, ...) as it was given, so it round-trips.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .persist import read_json, write_json_atomic

log = logging.getLogger("chronomq.broker")

FILE_NAME = "subscriptionGroup.json"
# RocketMQ's MixAll names of the groups its SubscriptionGroupManager always has; the ones after the
# first three may consume by broadcasting
BUILTIN_GROUPS = ("TOOLS_CONSUMER", "FILTERSRV_CONSUMER", "SELF_TEST_C_GROUP")
BUILTIN_BROADCAST_GROUPS = ("CID_ONS-HTTP-PROXY", "CID_ONSAPI_PULL", "CID_ONSAPI_PERMISSION",
                            "CID_ONSAPI_OWNER", "CID_RMQ_SYS_TRANS")
MAX_GROUP_NAME = 255  # RocketMQ's Validators.CHARACTER_MAX_LENGTH
_LEGAL = re.compile(r"^[%|a-zA-Z0-9_-]+$")  # TopicValidator.isTopicOrGroupIllegal's characters


def illegal_group_name(name: str) -> str | None:
    """Why RocketMQ would refuse ``name`` as a group name, or None."""
    if not name:
        return "the group name is empty"
    if len(name) > MAX_GROUP_NAME:
        return f"the group name is longer than {MAX_GROUP_NAME} characters"
    if not _LEGAL.match(name):
        return f"the group name {name!r} contains characters outside [%|a-zA-Z0-9_-]"
    return None


class SubscriptionGroupError(ValueError):
    """A config that cannot be stored (no name, a name RocketMQ would refuse, a field of the wrong type)."""


@dataclass
class SubscriptionGroupConfig:
    """RocketMQ 5's SubscriptionGroupConfig, its field names and defaults; ``extra`` holds the other
    keys of the JSON it came from."""

    groupName: str
    consumeEnable: bool = True
    consumeFromMinEnable: bool = True
    consumeBroadcastEnable: bool = True
    consumeMessageOrderly: bool = False
    retryQueueNums: int = 1
    retryMaxTimes: int = 16
    brokerId: int = 0
    whichBrokerWhenConsumeSlowly: int = 1
    notifyConsumerIdsChangedEnable: bool = True
    groupSysFlag: int = 0
    consumeTimeoutMinute: int = 15
    extra: dict[str, Any] = field(default_factory=lambda: {
        "groupRetryPolicy": {"type": "CUSTOMIZED"}, "subscriptionDataSet": None, "attributes": {}})

    def to_json(self) -> dict[str, Any]:
        out = dict(self.extra)
        out.update({f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"})
        return out

    @classmethod
    def from_json(cls, d: Any) -> SubscriptionGroupConfig:
        if not isinstance(d, dict):
            raise SubscriptionGroupError("a subscription group config is a JSON object")
        name = d.get("groupName")
        if not isinstance(name, str) or not name:
            raise SubscriptionGroupError("the subscription group config has no groupName")
        cfg = cls(name)
        known = {f.name: f for f in fields(cls) if f.name not in ("extra", "groupName")}
        extra = dict(cfg.extra)
        for key, value in d.items():
            f = known.get(key)
            if f is None:
                if key != "groupName":
                    extra[key] = value
                continue
            if value is None:
                continue
            if f.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise SubscriptionGroupError(f"{key}: {value!r} is not a boolean")
            elif isinstance(value, bool) or not isinstance(value, int):
                raise SubscriptionGroupError(f"{key}: {value!r} is not an integer")
            setattr(cfg, key, value)
        cfg.extra = extra
        return cfg


class SubscriptionGroupManager:
    """``get`` looks a group up; ``find`` also creates it when ``auto_create()`` says so (a heartbeat);
    ``update`` and ``delete`` are the admin's."""

    def __init__(self, config_dir: Path, now_ms: Callable[[], int],
                 auto_create: Callable[[], bool] = lambda: True) -> None:
        self.path = config_dir / FILE_NAME
        self.now_ms = now_ms
        self.auto_create = auto_create
        self._lock = threading.Lock()
        self.table: dict[str, SubscriptionGroupConfig] = {}
        self.data_version = {"stateVersion": 0, "timestamp": now_ms(), "counter": 0}
        for name in BUILTIN_GROUPS:
            self.table[name] = SubscriptionGroupConfig(name, consumeBroadcastEnable=False)
        for name in BUILTIN_BROADCAST_GROUPS:
            self.table[name] = SubscriptionGroupConfig(name)
        obj = read_json(self.path) or {}
        for name, d in (obj.get("subscriptionGroupTable") or {}).items():
            try:
                self.table[str(name)] = SubscriptionGroupConfig.from_json(d)
            except SubscriptionGroupError as e:
                log.error("%s: group %s skipped: %s", self.path, name, e)
        version = obj.get("dataVersion")
        if isinstance(version, dict):
            self.data_version.update({k: v for k, v in version.items() if isinstance(v, int)})

    def get(self, group: str) -> SubscriptionGroupConfig | None:
        return self.table.get(group)

    def __contains__(self, group: str) -> bool:
        return group in self.table

    def find(self, group: str) -> SubscriptionGroupConfig | None:
        """The group's config; a group not in the table is created (with RocketMQ's defaults) when
        autoCreateSubscriptionGroup is on and its name is legal, else None."""
        cfg = self.table.get(group)
        if cfg is not None or not self.auto_create():
            return cfg
        if illegal_group_name(group) is not None:
            return None
        cfg = SubscriptionGroupConfig(group)
        log.info("subscription group %s created on its first heartbeat", group)
        self._put(cfg)
        return cfg

    def update(self, cfg: SubscriptionGroupConfig) -> None:
        why = illegal_group_name(cfg.groupName)
        if why is not None:
            raise SubscriptionGroupError(why)
        self._put(cfg)

    def delete(self, group: str) -> bool:
        with self._lock:
            if self.table.pop(group, None) is None:
                return False
            self._next_version()
        self.persist()
        return True

    def _put(self, cfg: SubscriptionGroupConfig) -> None:
        with self._lock:
            self.table[cfg.groupName] = cfg
            self._next_version()
        self.persist()

    def _next_version(self) -> None:
        self.data_version = {**self.data_version, "timestamp": self.now_ms(),
                             "counter": int(self.data_version.get("counter", 0)) + 1}

    def snapshot(self) -> dict[str, Any]:
        """What GET_ALL_SUBSCRIPTIONGROUP_CONFIG answers and the file holds."""
        with self._lock:
            return {"subscriptionGroupTable": {n: c.to_json() for n, c in self.table.items()},
                    "forbiddenTable": {}, "dataVersion": dict(self.data_version)}

    def persist(self) -> None:
        try:
            write_json_atomic(self.path, self.snapshot())
        except OSError as e:
            log.error("cannot persist subscription groups to %s: %s", self.path, e)
