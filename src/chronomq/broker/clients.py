"""Who is connected: consumer groups and their clients (from HEART_BEAT), producer groups, and the
queue locks of orderly consumers. A client is dropped after clientChannelMaxIdleTimeSeconds (120 s)
without a heartbeat, when it unregisters, or when its connection closes; the remaining consumers of its
group are then told (NOTIFY_CONSUMER_IDS_CHANGED) so they rebalance at once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from chronomq.remoting.codec import RemotingCommand

CLIENT_EXPIRE_MS = 120_000
LOCK_EXPIRE_MS = 60_000

_CONSUME_FROM = {
    "CONSUME_FROM_LAST_OFFSET": 0,
    "CONSUME_FROM_LAST_OFFSET_AND_FROM_MIN_WHEN_BOOT_FIRST": 1,
    "CONSUME_FROM_MIN_OFFSET": 2,
    "CONSUME_FROM_MAX_OFFSET": 3,
    "CONSUME_FROM_FIRST_OFFSET": 4,
    "CONSUME_FROM_TIMESTAMP": 5,
}


def message_model_is_clustering(v: Any) -> bool:
    """C++ sends 1 = CLUSTERING, 0 = BROADCASTING; Java sends the names."""
    if isinstance(v, str) and not v.lstrip("-").isdigit():
        return v.upper() != "BROADCASTING"
    try:
        return int(v) != 0
    except (TypeError, ValueError):
        return True


def consume_type_name(v: Any) -> str:
    if isinstance(v, str) and not v.isdigit():
        return v.upper()
    return "CONSUME_PASSIVELY" if str(v) == "1" else "CONSUME_ACTIVELY"


class ClientConnection(Protocol):
    """A client's connection as the managers keep it: a 4.x client's ``remoting.server.Connection``, a 5.x
    client's Telemetry stream (grpc/telemetry.py) or an in-process caller's (broker/inproc.py). The broker
    sends it commands oneway, or as requests whose answer it awaits (a 5.x stream and an in-process
    caller answer none: their ``invoke`` raises ConnectionError)."""

    @property
    def remote_addr(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def send_oneway(self, cmd: RemotingCommand) -> bool | None: ...

    async def invoke(self, cmd: RemotingCommand, timeout: float = ...) -> RemotingCommand: ...


@dataclass
class ClientInfo:
    client_id: str
    conn: ClientConnection | None
    last_update_ms: int
    language: str = ""
    version: int = 0


@dataclass
class ConsumerGroup:
    name: str
    clients: dict[str, ClientInfo] = field(default_factory=dict)
    subscriptions: dict[str, dict[str, Any]] = field(default_factory=dict)  # topic -> subscription data
    consume_type: str = "CONSUME_PASSIVELY"
    clustering: bool = True
    consume_from_where: Any = 0


class ConsumerManager:
    def __init__(self, expire_ms: int = CLIENT_EXPIRE_MS) -> None:
        self.expire_ms = expire_ms
        self.groups: dict[str, ConsumerGroup] = {}

    def register(self, group: str, client: ClientInfo, consumer_data: dict[str, Any]) -> bool:
        """Record a heartbeat. Returns True when the group's client list changed (new client)."""
        g = self.groups.get(group)
        if g is None:
            g = self.groups[group] = ConsumerGroup(group)
        g.consume_type = consume_type_name(consumer_data.get("consumeType", 1))
        g.clustering = message_model_is_clustering(consumer_data.get("messageModel", 1))
        g.consume_from_where = consumer_data.get("consumeFromWhere", 0)
        subs = consumer_data.get("subscriptionDataSet") or []
        if isinstance(subs, list):
            new = {str(s.get("topic")): s for s in subs if isinstance(s, dict) and s.get("topic")}
            if new:
                g.subscriptions = new
        old = g.clients.get(client.client_id)
        g.clients[client.client_id] = client
        return old is None or (old.conn is not client.conn and old.conn is not None and old.conn.closed)

    def unregister(self, group: str, client_id: str) -> bool:
        g = self.groups.get(group)
        if g is None or client_id not in g.clients:
            return False
        del g.clients[client_id]
        if not g.clients:
            del self.groups[group]
        return True

    def client_ids(self, group: str) -> list[str]:
        g = self.groups.get(group)
        return sorted(g.clients) if g else []

    def connections(self, group: str) -> list[ClientConnection]:
        g = self.groups.get(group)
        if g is None:
            return []
        return [c.conn for c in g.clients.values() if c.conn is not None and not c.conn.closed]

    def drop_connection(self, conn: ClientConnection) -> list[str]:
        """Remove every client registered through conn; returns the groups that changed."""
        return self._drop_where(lambda c: c.conn is conn)

    def expire(self, now_ms: int) -> list[str]:
        """Remove clients silent for longer than the expiry; returns the groups that changed."""
        return self._drop_where(lambda c: now_ms - c.last_update_ms > self.expire_ms)

    def _drop_where(self, pred: Callable[[Any], bool]) -> list[str]:
        changed = []
        for name, g in list(self.groups.items()):
            gone = [cid for cid, c in g.clients.items() if pred(c)]
            for cid in gone:
                del g.clients[cid]
            if gone:
                changed.append(name)
                if not g.clients:
                    del self.groups[name]
        return changed

    def groups_subscribing(self, topic: str) -> list[str]:
        return sorted(n for n, g in self.groups.items() if topic in g.subscriptions)


class ProducerManager:
    def __init__(self, expire_ms: int = CLIENT_EXPIRE_MS) -> None:
        self.expire_ms = expire_ms
        self.groups: dict[str, dict[str, ClientInfo]] = {}

    def register(self, group: str, client: ClientInfo) -> None:
        self.groups.setdefault(group, {})[client.client_id] = client

    def unregister(self, group: str, client_id: str) -> None:
        g = self.groups.get(group)
        if g is not None:
            g.pop(client_id, None)
            if not g:
                del self.groups[group]

    def find_connection(self, client_id: str) -> ClientConnection | None:
        """The connection of a producer by its client id, in any group (RocketMQ's
        ProducerManager.findChannel: where a reply to its request is pushed)."""
        for g in self.groups.values():
            c = g.get(client_id)
            if c is not None and c.conn is not None and not c.conn.closed:
                return c.conn
        return None

    def drop_connection(self, conn: ClientConnection) -> None:
        for name, g in list(self.groups.items()):
            for cid in [cid for cid, c in g.items() if c.conn is conn]:
                del g[cid]
            if not g:
                del self.groups[name]

    def expire(self, now_ms: int) -> None:
        for name, g in list(self.groups.items()):
            for cid in [cid for cid, c in g.items() if now_ms - c.last_update_ms > self.expire_ms]:
                del g[cid]
            if not g:
                del self.groups[name]


class QueueLockManager:
    """Orderly consumers lock (group, topic, broker, queue) for 60 s, renewed every 20 s."""

    def __init__(self, expire_ms: int = LOCK_EXPIRE_MS) -> None:
        self.expire_ms = expire_ms
        self.locks: dict[tuple[str, str, str, int], tuple[str, int]] = {}

    def try_lock(
        self, group: str, mqs: list[tuple[str, str, int]], client_id: str, now_ms: int
    ) -> list[tuple[str, str, int]]:
        granted = []
        for topic, broker, qid in mqs:
            key = (group, topic, broker, qid)
            owner = self.locks.get(key)
            if owner is None or owner[0] == client_id or now_ms - owner[1] > self.expire_ms:
                self.locks[key] = (client_id, now_ms)
                granted.append((topic, broker, qid))
        return granted

    def unlock(self, group: str, mqs: list[tuple[str, str, int]], client_id: str) -> None:
        for topic, broker, qid in mqs:
            key = (group, topic, broker, qid)
            owner = self.locks.get(key)
            if owner is not None and owner[0] == client_id:
                del self.locks[key]

    def is_locked_by(
        self, group: str, topic: str, broker: str, qid: int, client_id: str, now_ms: int
    ) -> bool:
        owner = self.locks.get((group, topic, broker, qid))
        return owner is not None and owner[0] == client_id and now_ms - owner[1] <= self.expire_ms
