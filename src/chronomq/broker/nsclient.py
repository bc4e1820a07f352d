"""The broker's client for its name servers: REGISTER_BROKER every 30 s (and at once when a topic is
created), UNREGISTER_BROKER at shutdown. One TCP connection per name server, reopened after errors; TLS
with an ``ssl_context`` (the broker's ``tlsEnable``, ``remoting.tls.outgoing_context``). A failure is logged
when a name server's state changes (registered or not), not at every round."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from typing import Any

from chronomq.config import BrokerConfig
from chronomq.remoting.codec import FrameDecoder, FrameError, RemotingCommand, encode
from chronomq.remoting.codes import RequestCode

log = logging.getLogger("chronomq.broker")


class RemotingClientConnection:
    """A minimal async request/response connection (opaque-matched, concurrent requests)."""

    def __init__(self, addr: str, ssl_context: ssl.SSLContext | None = None) -> None:
        self.addr = addr
        self.ssl_context = ssl_context
        self.answered = False  # the current connection has answered a request
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[RemotingCommand]] = {}
        self._read_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def _ensure(self) -> None:
        if self._writer is not None and not self._writer.is_closing():
            return
        host, _, port = self.addr.rpartition(":")
        opened = (asyncio.open_connection(host, int(port)) if self.ssl_context is None else
                  asyncio.open_connection(host, int(port), ssl=self.ssl_context, ssl_handshake_timeout=3))
        async with asyncio.timeout(3):
            reader, self._writer = await opened
        self._reader = reader
        self.answered = False
        self._read_task = asyncio.create_task(self._read_loop(reader))

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        dec = FrameDecoder()
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                for item in dec.feed(data):
                    if isinstance(item, FrameError):
                        continue
                    self.answered = True
                    fut = self._pending.pop(item.opaque, None)
                    if fut is not None and not fut.done():
                        fut.set_result(item)
        except (OSError, FrameError):
            pass
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(f"connection to {self.addr} closed"))
            self._pending.clear()
            if self._writer is not None:
                self._writer.close()

    async def invoke(self, cmd: RemotingCommand, timeout: float = 3.0) -> RemotingCommand:
        async with self._lock:
            await self._ensure()
        assert self._writer is not None
        fut: asyncio.Future[RemotingCommand] = asyncio.get_running_loop().create_future()
        self._pending[cmd.opaque] = fut
        self._writer.write(encode(cmd))
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            await self.close()  # like the official clients: a timed-out connection is replaced
            raise
        finally:
            self._pending.pop(cmd.opaque, None)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
            self._writer = None
        if self._read_task is not None:
            self._read_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._read_task
            self._read_task = None


class NamesrvClient:
    def __init__(self, addrs: list[str], ssl_context: ssl.SSLContext | None = None) -> None:
        self.conns = [RemotingClientConnection(a.strip(), ssl_context) for a in addrs]
        self.registered: dict[str, bool] = {}

    def _header(self, config: BrokerConfig, broker_addr: str) -> dict[str, Any]:
        return {
            "brokerName": config.brokerName,
            "brokerAddr": broker_addr,
            "clusterName": config.brokerClusterName,
            "brokerId": str(config.brokerId),
            "haServerAddr": f"{config.brokerIP1}:{config.ha_port}",
            "compressed": "false",
        }

    async def register_broker(
        self, config: BrokerConfig, broker_addr: str, topics: dict[str, Any], data_version: dict[str, Any]
    ) -> dict[str, str] | None:
        """Register with every name server; returns the first answer's masterAddr/haServerAddr (what a
        slave needs to find its master), or None when none answered."""
        answers: list[dict[str, str]] = []
        body = json.dumps(
            {
                "topicConfigSerializeWrapper": {"topicConfigTable": topics, "dataVersion": data_version},
                "filterServerList": [],
            },
            separators=(",", ":"),
        ).encode()

        async def one(conn: RemotingClientConnection) -> None:
            req = RemotingCommand.request(
                RequestCode.REGISTER_BROKER, self._header(config, broker_addr), body
            )
            try:
                resp = await conn.invoke(req, 3.0)
            except (OSError, TimeoutError, ConnectionError) as e:
                if self.registered.get(conn.addr, True):
                    why = str(e) or type(e).__name__
                    if isinstance(e, ssl.SSLError):
                        why = f"TLS handshake failed: {why}"
                    elif conn.ssl_context is None and not conn.answered and isinstance(e, ConnectionError):
                        why += (" before any answer (a name server whose tlsServerMode is enforcing closes "
                                "plaintext connections: set tlsEnable=true)")
                    log.warning("cannot register with name server %s: %s", conn.addr, why)
                self.registered[conn.addr] = False
                return
            if resp.code != 0:
                log.warning("name server %s refused the registration: %s", conn.addr, resp.remark)
                self.registered[conn.addr] = False
                return
            if not self.registered.get(conn.addr):
                log.info("registered with name server %s", conn.addr)
            self.registered[conn.addr] = True
            answers.append({k: resp.ext_str(k, "") or "" for k in ("masterAddr", "haServerAddr")})

        await asyncio.gather(*(one(c) for c in self.conns))
        return next((a for a in answers if a["haServerAddr"]), answers[0] if answers else None)

    async def unregister_broker(self, config: BrokerConfig, broker_addr: str) -> None:
        async def one(conn: RemotingClientConnection) -> None:
            h = self._header(config, broker_addr)
            req = RemotingCommand.request(
                RequestCode.UNREGISTER_BROKER,
                {k: h[k] for k in ("brokerName", "brokerAddr", "clusterName", "brokerId")},
            )
            with contextlib.suppress(OSError, TimeoutError, ConnectionError):
                await conn.invoke(req, 2.0)

        await asyncio.gather(*(one(c) for c in self.conns))

    async def close(self) -> None:
        for c in self.conns:
            await c.close()
