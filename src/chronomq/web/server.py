"""Serving the console: a uvicorn server on the caller's event loop. Rules: it binds 127.0.0.1 unless
told otherwise; on any other address it refuses to start without a users file (the login is
mandatory there); it leaves signal handling to its host process."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from chronomq.client import Admin

from .app import create_app
from .auth import Accounts, load_users

log = logging.getLogger("chronomq.web")

DEFAULT_PORT = 8082


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ConsoleConfig:
    namesrv: str = "127.0.0.1:9876"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    users_file: str | None = None
    access_key: str | None = None
    secret_key: str | None = None


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the host process owns SIGINT/SIGTERM
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


class ConsoleServer:
    """``await start()`` serves the console until ``await stop()``. Raises ValueError for a setting it
    refuses (a non-loopback address without users, a bad users file)."""

    def __init__(self, cfg: ConsoleConfig) -> None:
        accounts = Accounts(load_users(cfg.users_file)) if cfg.users_file else None
        if accounts is None and not is_loopback(cfg.host):
            raise ValueError(f"the console would listen on {cfg.host}, beyond this machine, without a login: "
                             "give a users file (--users FILE; make password hashes with "
                             "`chronomq dashboard --hash-password`) or listen on 127.0.0.1")
        creds = (cfg.access_key, cfg.secret_key) if cfg.access_key and cfg.secret_key else None
        self.admin = Admin(cfg.namesrv, credentials=creds, instance_name="chronomq-console")
        self.app = create_app(self.admin, accounts=accounts, require_login=accounts is not None)
        self.cfg = cfg
        self._server = _Server(uvicorn.Config(self.app, host=cfg.host, port=cfg.port, log_level="warning",
                                              access_log=False, lifespan="on", server_header=False))
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"http://{host}:{self.bound_port}/"

    @property
    def bound_port(self) -> int:
        return int(self._sock.getsockname()[1]) if self._sock is not None else self.cfg.port

    async def start(self) -> None:
        # bind here, so that a busy port is an OSError for the caller (uvicorn would exit the process)
        family = socket.AF_INET6 if ":" in self.cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.cfg.host, self.cfg.port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            raise OSError(f"the console cannot listen on {self.cfg.host}:{self.cfg.port}: "
                          f"{e.strerror or e}") from None
        self._sock = sock
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # it could not bind or start: say why
                exc = self._task.exception()
                raise OSError(f"the console could not start on {self.cfg.host}:{self.cfg.port}: "
                              f"{exc or 'see the log'}")
            await asyncio.sleep(0.01)
        log.info("console at %s", self.url)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, 10)
        self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
