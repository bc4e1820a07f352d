"""The name server: route lookups for clients, registration and expiry of brokers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import zlib
from collections.abc import Callable
from typing import Any

from chronomq.clock import Clock, SystemClock
from chronomq.remoting.codec import HeaderError, RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode
from chronomq.remoting.server import Connection, ConnectionLimits, RemotingServer, UnsupportedCode
from chronomq.remoting.tls import ServerTls

from .routeinfo import BROKER_EXPIRE_MS, RouteInfoManager

log = logging.getLogger("chronomq.namesrv")

SCAN_INTERVAL_MS = 10_000


def _json_body(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def parse_register_body(
    body: bytes, compressed: bool = False
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """RegisterBrokerBody JSON: {"topicConfigSerializeWrapper": {"topicConfigTable": {...},
    "dataVersion": {...}}, "filterServerList": []}. Returns (topic configs, data version)."""
    if not body:
        return {}, {}
    if compressed:
        try:
            body = zlib.decompress(body)
        except zlib.error as e:
            raise HeaderError(f"REGISTER_BROKER body is not zlib data: {e}") from None
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise HeaderError(f"REGISTER_BROKER body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise HeaderError("REGISTER_BROKER body is not a JSON object")
    wrapper = obj.get("topicConfigSerializeWrapper") or {}
    table = wrapper.get("topicConfigTable") or {}
    if not isinstance(table, dict):
        raise HeaderError("topicConfigTable is not an object")
    version = wrapper.get("dataVersion") or {}
    return {str(k): v for k, v in table.items() if isinstance(v, dict)}, version if isinstance(
        version, dict
    ) else {}


class NameServer:
    """The name server on host:port. ``tls`` (``ServerTls.from_config(config, "namesrv")``): TLS and
    plaintext on its port as the broker's (docs/tls.md); None: plaintext only."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 9876,
        clock: Clock | None = None,
        expire_ms: int = BROKER_EXPIRE_MS,
        limits: ConnectionLimits | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        self.clock = clock or SystemClock()
        self.routes = RouteInfoManager(expire_ms)
        self.server = RemotingServer(self.handle, host, port, name="namesrv", sync_handler=self.handle_sync,
                                     limits=limits, tls=tls)
        self.server.close_callbacks.append(self._on_close)
        self.kv: dict[str, dict[str, str]] = {}
        self._scan_task: asyncio.Task[None] | None = None
        # (request, client address) -> a refusal to answer instead, or None (the ACL check, when on)
        self.request_check: Callable[[RemotingCommand, str], RemotingCommand | None] | None = None

    def metrics_snapshot(self) -> dict[str, Any]:
        """This name server's figures for metrics.namesrv_families (thread-safe: the route table locks)."""
        info = self.routes.cluster_info()
        brokers = [{"cluster": data.get("cluster", ""), "broker": name, "id": int(bid), "addr": addr}
                   for name, data in info["brokerAddrTable"].items()
                   for bid, addr in sorted((data.get("brokerAddrs") or {}).items())]
        return {"brokers": brokers, "topics": len(self.routes.topic_list()), "requests": self.server.requests}

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> None:
        await self.server.start()
        self._scan_task = asyncio.create_task(self._scan_loop())

    async def stop(self) -> None:
        if self._scan_task is not None:
            self._scan_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scan_task
        await self.server.stop()

    async def _scan_loop(self) -> None:
        while True:
            await self.clock.sleep(SCAN_INTERVAL_MS / 1000)
            for addr in self.routes.expire(self.clock.now_ms()):
                log.warning(
                    "broker %s expired: no registration for %d s", addr, self.routes.expire_ms // 1000
                )

    def _on_close(self, conn: Connection) -> None:
        for addr in self.routes.on_connection_closed(conn.id):
            log.info("broker %s unregistered: its connection closed", addr)

    async def handle(self, req: RemotingCommand, conn: Connection) -> RemotingCommand | None:
        resp = self.handle_sync(req, conn)
        if resp is None:
            raise UnsupportedCode(req.code)
        return resp

    def handle_sync(self, req: RemotingCommand, conn: Connection | None) -> RemotingCommand | None:
        if self.request_check is not None and conn is not None:
            refused = self.request_check(req, conn.remote_addr)
            if refused is not None:
                return refused
        code = req.code
        if code == RequestCode.GET_ROUTEINFO_BY_TOPIC:
            topic = req.require_str("topic")
            route = self.routes.topic_route(topic)
            if route is None:
                return req.response(
                    ResponseCode.TOPIC_NOT_EXIST,
                    remark=f"No topic route info in name server for the topic: {topic}",
                )
            return req.response(body=_json_body(route))
        if code == RequestCode.REGISTER_BROKER:
            return self._register(req, conn)
        if code == RequestCode.UNREGISTER_BROKER:
            self.routes.unregister_broker(
                req.ext_str("clusterName", "") or "",
                req.require_str("brokerName"),
                req.require_str("brokerAddr"),
                req.ext_int("brokerId", 0),
            )
            log.info("broker %s unregistered", req.ext_str("brokerAddr"))
            return req.response()
        if code == RequestCode.GET_BROKER_CLUSTER_INFO:
            return req.response(body=_json_body(self.routes.cluster_info()))
        if code == RequestCode.GET_ALL_TOPIC_LIST_FROM_NAMESERVER:
            return req.response(body=_json_body({"topicList": self.routes.topic_list()}))
        if code == RequestCode.GET_SYSTEM_TOPIC_LIST_FROM_NS:
            return req.response(body=_json_body(self.routes.system_topic_list()))
        if code == RequestCode.GET_TOPICS_BY_CLUSTER:
            topics = self.routes.topics_by_cluster(req.require_str("cluster"))
            return req.response(body=_json_body({"topicList": topics}))
        if code == RequestCode.DELETE_TOPIC_IN_NAMESRV:
            self.routes.delete_topic(req.require_str("topic"), req.ext_str("clusterName"))
            return req.response()
        if code == RequestCode.PUT_KV_CONFIG:
            self.kv.setdefault(req.require_str("namespace"), {})[req.require_str("key")] = req.require_str(
                "value"
            )
            return req.response()
        if code == RequestCode.GET_KV_CONFIG:
            value = self.kv.get(req.require_str("namespace"), {}).get(req.require_str("key"))
            if value is None:
                return req.response(ResponseCode.QUERY_NOT_FOUND, remark="no such key")
            return req.response(ext_fields={"value": value})
        if code == RequestCode.DELETE_KV_CONFIG:
            self.kv.get(req.require_str("namespace"), {}).pop(req.require_str("key"), None)
            return req.response()
        return None

    def _register(self, req: RemotingCommand, conn: Connection | None) -> RemotingCommand:
        name = req.require_str("brokerName")
        addr = req.require_str("brokerAddr")
        cluster = req.require_str("clusterName")
        broker_id = req.ext_int("brokerId")
        topics, version = parse_register_body(req.body, req.ext_bool("compressed"))
        result = self.routes.register_broker(
            cluster,
            name,
            addr,
            broker_id,
            req.ext_str("haServerAddr", "") or "",
            topics,
            version,
            self.clock.now_ms(),
            conn.id if conn is not None else None,
        )
        return req.response(ext_fields=result)
