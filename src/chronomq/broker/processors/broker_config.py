"""The broker's configuration and traffic figures as RocketMQ's admin tools ask for them:
GET_BROKER_CONFIG (26), UPDATE_BROKER_CONFIG (25) and VIEW_BROKER_STATS_DATA (315).

Rules: the configuration travels as Java properties text (``key=value`` lines), a secret's value (a
password, a secret key, credentials, a private key's path) as ``***`` when it is set. An update applies only
the keys in RUNTIME_KEYS (ones read afresh at each use), for this run: a request naming any other key
changes nothing and is refused with NO_PERMISSION, naming the keys it may change. The stats answer from
chronomq's traffic counters, which count since the broker started (there is no per-minute history): every
window's ``sum`` is the count since start, its ``tps`` the average rate since start.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import TYPE_CHECKING, Any

from chronomq.config import BrokerConfig, ConfigError, parse_properties
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode

from .base import Handler, ProcessorBase, RequestConnection, dump_json

if TYPE_CHECKING:
    from ..services import BrokerServices

log = logging.getLogger("chronomq.broker")

# keys the broker reads afresh at each use, so a change takes effect at once
RUNTIME_KEYS = frozenset({
    "autoCreateSubscriptionGroup", "longPollingEnable", "rejectTransactionMessage",
    "flushConsumerOffsetInterval", "storeReplyMessageEnable", "fileReservedTime", "deleteWhen",
    "diskMaxUsedSpaceRatio", "maxReconsumeTimes", "registerNameServerPeriod",
})
# VIEW_BROKER_STATS_DATA's statsName -> the counter's index (0 messages, 1 bytes): in by topic (statsKey
# the topic, summed over message types), out by topic and group (statsKey topic@group)
PUT_STATS = {"TOPIC_PUT_NUMS": 0, "TOPIC_PUT_SIZE": 1}
GET_STATS = {"GROUP_GET_NUMS": 0, "GROUP_GET_SIZE": 1}


# keys whose values are secrets (initAuthenticationUser's and innerClientAuthenticationCredentials' JSON
# hold a password and a secret key; tlsKeyPath and tlsClientKeyPath name private keys), and any other key,
# RocketMQ's or unknown, whose name says it holds one
SECRET_KEYS = frozenset({"initAuthenticationUser", "innerClientAuthenticationCredentials", "tlsKeyPath",
                         "tlsClientKeyPath"})
_SECRET_NAME = re.compile(r"password|secret|credential|keypath|privatekey", re.IGNORECASE)
MASK = "***"


def config_properties(config: BrokerConfig) -> str:
    """Every key and value of ``config`` as Java properties text, sorted by key; a secret's value that is
    set shows as ``***`` (an unset one stays empty)."""
    values: dict[str, Any] = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                              if f.name != "extra"}
    values.update(config.extra)
    lines = []
    for key in sorted(values):
        v = values[key]
        if v not in ("", None) and (key in SECRET_KEYS or _SECRET_NAME.search(key)):
            v = MASK
        lines.append(f"{key}={('true' if v else 'false') if isinstance(v, bool) else v}")
    return "\n".join(lines) + "\n"


class BrokerConfigProcessor(ProcessorBase):
    """The configuration read and changed at run time, and the traffic figures."""

    def __init__(self, services: BrokerServices) -> None:
        super().__init__(services)
        self._config_version = {"stateVersion": 0, "timestamp": self.clock.now_ms(), "counter": 0}
        self._stats_since_ms = self.clock.now_ms()

    def handlers(self) -> dict[int, Handler]:
        return {
            RequestCode.GET_BROKER_CONFIG: self.get_broker_config,
            RequestCode.UPDATE_BROKER_CONFIG: self.update_broker_config,
            RequestCode.VIEW_BROKER_STATS_DATA: self.view_broker_stats_data,
        }

    def get_broker_config(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        version = dump_json(self._config_version).decode()
        return req.response(ext_fields={"version": version}, body=config_properties(self.config).encode())

    def update_broker_config(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        try:
            values = parse_properties(req.body.decode("utf-8"))
        except UnicodeDecodeError as e:
            return req.response(ResponseCode.SYSTEM_ERROR, remark=f"the body is not UTF-8 text: {e}")
        refused = sorted(k for k in values if k not in RUNTIME_KEYS)
        if refused:
            return req.response(
                ResponseCode.NO_PERMISSION,
                remark=(f"chronomq cannot change {', '.join(refused)} while running (set it in broker.conf "
                        f"and restart); keys it changes at run time: {', '.join(sorted(RUNTIME_KEYS))}"))
        trial = dataclasses.replace(self.config, extra=dict(self.config.extra))
        try:
            trial.apply(values)
        except ConfigError as e:
            return req.response(ResponseCode.SYSTEM_ERROR, remark=str(e))
        for key in values:
            setattr(self.config, key, getattr(trial, key))
        if values:
            v = self._config_version
            self._config_version = {**v, "timestamp": self.clock.now_ms(), "counter": v["counter"] + 1}
            log.info("broker configuration changed by %s (until restart): %s", conn.remote_addr,
                     {k: getattr(self.config, k) for k in values})
        return req.response()

    def view_broker_stats_data(self, req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
        name = req.require_str("statsName")
        key = req.require_str("statsKey")
        traffic = self.services.traffic
        rows: list[int] = []
        if name in PUT_STATS:
            index = PUT_STATS[name]
            rows = [v[index] for (t, _), v in list(traffic.produced.items()) if t == key]
        elif name in GET_STATS:
            topic, _, group = key.partition("@")
            row = traffic.consumed.get((topic, group))
            rows = [row[GET_STATS[name]]] if row is not None else []
        total = sum(rows) if rows else None
        if total is None:
            return req.response(ResponseCode.SYSTEM_ERROR, remark=f"The stats <{name}> <{key}> not exist")
        seconds = max(1.0, (self.clock.now_ms() - self._stats_since_ms) / 1000)
        item = {"sum": total, "tps": round(total / seconds, 2), "avgpt": 0.0}
        return req.response(body=dump_json({"statsMinute": item, "statsHour": item, "statsDay": item}))
