"""ClientInstance: the part every producer/consumer/admin shares (RocketMQ's MQClientInstance): the
remoting connections, name-server lookups with failover, the route cache, heartbeats and background
tasks. Each Producer/PushConsumer/SimpleConsumer/Admin owns one (so two consumers in one process are
two clients, with two client ids). Its ``tls`` option (theirs too) puts every connection, to the name
servers and to the brokers, on TLS (``chronomq.remoting.tls.client_context``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from chronomq.clock import Clock, SystemClock
from chronomq.remoting.client import (
    RemotingClient,
    RemotingClosedError,
    RemotingConnectError,
    RemotingTimeoutError,
)
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode
from chronomq.remoting.signing import sign
from chronomq.remoting.tls import TlsOption, client_context

from .errors import ClientClosed, ConnectFailed, NoRouteError, RequestTimeout, error_for_code
from .model import TopicRoute

log = logging.getLogger("chronomq.client")

_instance_seq = itertools.count()
LANGUAGE = "PYTHON"
CLIENT_VERSION = 395  # V4_9_x: lets brokers honour maxReconsumeTimes in send-back headers


def local_ip() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def parse_namesrv(namesrv: str | Sequence[str]) -> list[str]:
    items = namesrv.split(";") if isinstance(namesrv, str) else list(namesrv)
    addrs = [a.strip() for a in items if a and a.strip()]
    if not addrs:
        raise ValueError("no name server address given")
    for a in addrs:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"name server address {a!r} is not host:port")
    return addrs


class ClientInstance:
    def __init__(self, namesrv: str | Sequence[str], *, instance_name: str | None = None,
                 request_timeout: float = 3.0, route_timeout: float = 5.0,
                 heartbeat_interval: float = 30.0, route_refresh_interval: float = 30.0,
                 request_handler: Callable[[str, RemotingCommand], Awaitable[RemotingCommand | None]]
                 | None = None, credentials: tuple[str, str] | None = None,
                 clock: Clock | None = None, tls: TlsOption = None) -> None:
        self.namesrv_addrs = parse_namesrv(namesrv)
        # None: plaintext; else the context of every connection (built now: a bad CA file fails here)
        self.ssl_context = client_context(tls)
        self.request_timeout = request_timeout
        self.route_timeout = route_timeout
        self.heartbeat_interval = heartbeat_interval
        self.route_refresh_interval = route_refresh_interval
        seq = next(_instance_seq)
        self.client_ip = local_ip()
        self.client_id = f"{self.client_ip}@{instance_name or f'{os.getpid()}#{seq}'}"
        self._handler = request_handler
        # (access key, secret key): every request is signed (RocketMQ ACL 1.0) just before it is sent
        self.credentials = credentials
        self._clock: Clock = clock or SystemClock()  # the signatures' Timestamp
        self._remoting: RemotingClient | None = None
        self._ns_index = 0
        self.routes: dict[str, TopicRoute] = {}
        self.broker_addrs: dict[str, dict[int, str]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = False
        self._closed = False
        self.heartbeat_body: Callable[[], dict[str, Any]] | None = None
        self._route_locks: dict[str, asyncio.Lock] = {}

    # --- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._closed:
            raise ClientClosed("this client was closed; create a new one")
        if self._started:
            return
        self._remoting = RemotingClient(self._handle_server_request, ssl_context=self.ssl_context)
        self._started = True
        self.spawn(self._timer(self.route_refresh_interval, self.refresh_routes), "route-refresh")
        if self.heartbeat_body is not None:
            self.spawn(self._timer(self.heartbeat_interval, self.send_heartbeat), "heartbeat")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._remoting is not None:
            await self._remoting.close()

    @property
    def running(self) -> bool:
        return self._started and not self._closed

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str = "") -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=f"chronomq-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed: %r", task.get_name(), task.exception())

    async def _timer(self, interval: float, fn: Callable[[], Awaitable[Any]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("%s: periodic %s failed: %s", self.client_id, getattr(fn, "__name__", fn), e)

    async def _handle_server_request(self, addr: str, cmd: RemotingCommand) -> RemotingCommand | None:
        if self._handler is not None:
            return await self._handler(addr, cmd)
        return cmd.response(ResponseCode.REQUEST_CODE_NOT_SUPPORTED,
                            remark=f"request code {cmd.code} not supported by this client")

    # --- requests ----------------------------------------------------------------------------------
    def request(self, code: int, ext: dict[str, Any] | None = None, body: bytes = b"",
                oneway: bool = False) -> RemotingCommand:
        cmd = RemotingCommand.request(code, ext, body, oneway=oneway)
        cmd.language = LANGUAGE
        cmd.version = CLIENT_VERSION
        return cmd

    async def invoke(self, addr: str, cmd: RemotingCommand, timeout: float | None = None,
                     what: str = "request") -> RemotingCommand:
        """Send one request; transport failures become ConnectFailed/RequestTimeout."""
        if not self.running or self._remoting is None:
            raise ClientClosed(f"{what}: the client is not running (start it, or it was closed)")
        try:
            if self.credentials is not None:
                sign(cmd, *self.credentials, self._clock.now_ms())
            return await self._remoting.invoke(addr, cmd, timeout or self.request_timeout)
        except RemotingTimeoutError as e:
            raise RequestTimeout(f"{what}: {e}") from None
        except RemotingClosedError:
            raise ClientClosed(f"{what}: the client was closed") from None
        except RemotingConnectError as e:
            raise ConnectFailed(f"{what}: {e}") from None

    async def invoke_oneway(self, addr: str, cmd: RemotingCommand, what: str = "request") -> None:
        if not self.running or self._remoting is None:
            raise ClientClosed(f"{what}: the client is not running")
        try:
            if self.credentials is not None:
                sign(cmd, *self.credentials, self._clock.now_ms())
            await self._remoting.invoke_oneway(addr, cmd)
        except RemotingClosedError:
            raise ClientClosed(f"{what}: the client was closed") from None
        except RemotingConnectError as e:
            raise ConnectFailed(f"{what}: {e}") from None

    async def invoke_ok(self, addr: str, cmd: RemotingCommand, timeout: float | None = None,
                        what: str = "request", ok: Sequence[int] = (ResponseCode.SUCCESS,),
                        ) -> RemotingCommand:
        resp = await self.invoke(addr, cmd, timeout, what)
        if resp.code not in ok:
            raise error_for_code(resp.code, resp.remark, what, addr)
        return resp

    async def invoke_namesrv(self, cmd_factory: Callable[[], RemotingCommand], timeout: float | None = None,
                             what: str = "name server request") -> RemotingCommand:
        """Try the name servers in turn, starting with the last one that worked."""
        errors: list[str] = []
        n = len(self.namesrv_addrs)
        for i in range(n):
            idx = (self._ns_index + i) % n
            addr = self.namesrv_addrs[idx]
            try:
                resp = await self.invoke(addr, cmd_factory(), timeout or self.route_timeout, what)
            except (ConnectFailed, RequestTimeout) as e:
                errors.append(str(e))
                continue
            self._ns_index = idx
            return resp
        if len(errors) == 1:
            raise ConnectFailed(errors[0])
        raise ConnectFailed(f"{what}: no name server answered: " + "; ".join(errors))

    # --- routes --------------------------------------------------------------------------------------
    async def fetch_route(self, topic: str) -> TopicRoute | None:
        """Ask the name server; None when it says TOPIC_NOT_EXIST."""
        resp = await self.invoke_namesrv(
            lambda: self.request(RequestCode.GET_ROUTEINFO_BY_TOPIC, {"topic": topic}),
            what=f"route lookup for topic {topic!r}")
        if resp.code == ResponseCode.TOPIC_NOT_EXIST:
            return None
        if resp.code != ResponseCode.SUCCESS:
            raise error_for_code(resp.code, resp.remark, f"route lookup for topic {topic!r}")
        try:
            route = TopicRoute.parse(topic, resp.body)
        except (ValueError, KeyError, TypeError) as e:
            raise NoRouteError(f"route data for topic {topic!r} is malformed: {e}") from None
        return route

    async def get_route(self, topic: str, refresh: bool = False) -> TopicRoute:
        route = self.routes.get(topic)
        if route is not None and not refresh:
            return route
        lock = self._route_locks.setdefault(topic, asyncio.Lock())
        async with lock:
            route = self.routes.get(topic)
            if route is not None and not refresh:
                return route
            route = await self.fetch_route(topic)
            if route is None:
                self.routes.pop(topic, None)
                raise NoRouteError(f"no route for topic {topic!r}: the name server does not know it")
            self._install_route(route)
            return route

    def _install_route(self, route: TopicRoute) -> None:
        self.routes[route.topic] = route
        for name, addrs in route.broker_addrs.items():
            self.broker_addrs[name] = dict(addrs)

    async def refresh_routes(self) -> None:
        for topic in list(self.routes):
            try:
                route = await self.fetch_route(topic)
            except Exception as e:
                log.debug("route refresh for %s failed: %s", topic, e)
                continue
            if route is not None:
                self._install_route(route)

    def master_addr(self, broker_name: str) -> str | None:
        return self.broker_addrs.get(broker_name, {}).get(0)

    def any_broker_addr(self, broker_name: str) -> str | None:
        addrs = self.broker_addrs.get(broker_name, {})
        if 0 in addrs:
            return addrs[0]
        return next(iter(sorted(addrs.items())), (None, None))[1]

    async def broker_addr(self, broker_name: str, topic: str | None = None) -> str:
        addr = self.master_addr(broker_name)
        if addr is None and topic is not None:
            with contextlib.suppress(Exception):
                await self.get_route(topic, refresh=True)
            addr = self.master_addr(broker_name)
        if addr is None:
            raise NoRouteError(f"no master address known for broker {broker_name!r}")
        return addr

    def read_target(self, broker_name: str, prefer: int = 0) -> tuple[str | None, bool]:
        """Where a consumer reads from (pulls, queue offsets, committed offsets): ``prefer`` (a broker id
        the master suggested) when the route lists it, else the master, else its slave with the lowest
        id, as RocketMQ's findBrokerAddressInSubscribe. Returns (address or None, whether it is a slave)."""
        addrs = self.broker_addrs.get(broker_name, {})
        if prefer and prefer in addrs:
            return addrs[prefer], True
        if 0 in addrs:
            return addrs[0], False
        if addrs:
            return addrs[min(addrs)], True
        return None, False

    async def read_addr(self, broker_name: str, topic: str | None = None, prefer: int = 0
                        ) -> tuple[str, bool]:
        """read_target, asking the name server again once when the route lists no broker of that name."""
        addr, slave = self.read_target(broker_name, prefer)
        if addr is None and topic is not None:
            with contextlib.suppress(Exception):
                await self.get_route(topic, refresh=True)
            addr, slave = self.read_target(broker_name, prefer)
        if addr is None:
            raise NoRouteError(f"no address known for broker {broker_name!r}")
        return addr, slave

    # --- heartbeat -----------------------------------------------------------------------------------
    async def send_heartbeat(self) -> None:
        if self.heartbeat_body is None:
            return
        hb = self.heartbeat_body()
        body = json.dumps(hb).encode()
        # a consumer also tells the slaves, which serve its reads while their master is down; a
        # producer only the masters (RocketMQ's sendHeartbeatToAllBroker)
        everyone = bool(hb.get("consumerDataSet"))
        addrs = {a for addrs in self.broker_addrs.values() for bid, a in addrs.items()
                 if bid == 0 or everyone}
        results = await asyncio.gather(
            *(self.invoke_ok(a, self.request(RequestCode.HEART_BEAT, body=body), what="heartbeat")
              for a in sorted(addrs)), return_exceptions=True)
        for a, r in zip(sorted(addrs), results, strict=True):
            if isinstance(r, BaseException):
                log.debug("heartbeat to %s failed: %s", a, r)

    async def unregister(self, producer_group: str = "", consumer_group: str = "") -> None:
        addrs = {a for addrs in self.broker_addrs.values() for a in addrs.values()}
        ext = {"clientID": self.client_id, "producerGroup": producer_group, "consumerGroup": consumer_group}
        await asyncio.gather(*(self.invoke(a, self.request(RequestCode.UNREGISTER_CLIENT, ext), 3.0,
                                           "unregister") for a in addrs), return_exceptions=True)
