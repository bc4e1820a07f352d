"""Serving the console: a uvicorn server on the caller's event loop. Rules: it binds 127.0.0.1 unless
told otherwise; on any other address it refuses to start without a users file (the login is
mandatory there); it leaves signal handling to its host process. With a certificate and key it serves
HTTPS only (TLS 1.2+, the key unencrypted, checked before it starts); ``broker_tls`` is the ``tls=`` of its
Admin: its connections to the name server and the brokers (docs/console.md, "HTTPS and TLS")."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

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
    """``tls_cert``/``tls_key``: PEM certificate chain and its unencrypted key, HTTPS only (both or neither).
    ``broker_tls``: the Admin's ``tls=``: None/False plaintext, True TLS without verifying the servers, a
    path (a CA file, the broker's selfsigned.crt) TLS verifying their certificates against it."""

    namesrv: str = "127.0.0.1:9876"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    users_file: str | None = None
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)  # never in a repr
    tls_cert: str | None = None
    tls_key: str | None = None
    broker_tls: bool | str | None = None


def _no_password() -> bytes:
    # an encrypted key is an error, never a passphrase prompt on the terminal
    raise ValueError("the private key is encrypted")


def https_context(cert: str, key: str) -> ssl.SSLContext:
    """The console's server context; ValueError naming the file and the reason when the pair cannot be
    used."""
    try:
        with open(key, "rb") as f:
            encrypted = b"ENCRYPTED" in f.read()
    except OSError as e:
        raise ValueError(f"cannot read the key --tls-key {key}: {e.strerror or e}") from None
    if encrypted:
        raise ValueError(f"the key --tls-key {key} is encrypted; the console needs it unencrypted "
                         "(openssl pkey -in KEY -out PLAIN_KEY), readable by its user only")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except FileNotFoundError as e:
        raise ValueError(f"cannot read {e.filename or cert}: {e.strerror}") from None
    except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
        raise ValueError(f"the certificate --tls-cert {cert} and the key --tls-key {key} cannot be used "
                         f"together: {e}") from None
    return ctx


class _Config(uvicorn.Config):
    """uvicorn's config with the console's own TLS context (uvicorn would build one from files, asking
    for a passphrase on the terminal for an encrypted key)."""

    def __init__(self, app: Any, https: ssl.SSLContext | None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.https = https

    def load(self) -> None:
        super().load()
        if self.https is not None:
            self.ssl = self.https


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the host process owns SIGINT/SIGTERM
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


class ConsoleServer:
    """``await start()`` serves the console until ``await stop()``. Raises ValueError for a setting it
    refuses (a non-loopback address without users, a bad users file, a certificate and key that cannot
    be used, a broker CA file without a certificate)."""

    def __init__(self, cfg: ConsoleConfig) -> None:
        accounts = Accounts(load_users(cfg.users_file)) if cfg.users_file else None
        if accounts is None and not is_loopback(cfg.host):
            raise ValueError(f"the console would listen on {cfg.host}, beyond this machine, without a login: "
                             "give a users file (--users FILE; make password hashes with "
                             "`chronomq dashboard --hash-password`) or listen on 127.0.0.1")
        if bool(cfg.tls_cert) != bool(cfg.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both (HTTPS) or neither (HTTP)")
        self.https = https_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert and cfg.tls_key else None
        if self.https is None and not is_loopback(cfg.host):
            log.warning("the console serves plain HTTP on %s: logins and session cookies cross the network "
                        "unencrypted; give --tls-cert and --tls-key to serve HTTPS", cfg.host)
        broker_tls = cfg.broker_tls or None
        creds = (cfg.access_key, cfg.secret_key) if cfg.access_key and cfg.secret_key else None
        try:
            self.admin = Admin(cfg.namesrv, credentials=creds, instance_name="chronomq-console",
                               tls=broker_tls)
        except ValueError as e:  # a CA file that holds no usable certificate
            raise ValueError(f"--broker-tls: {e}") from None
        self.app = create_app(self.admin, accounts=accounts, require_login=accounts is not None,
                              secure_cookies=self.https is not None, broker_tls=broker_tls is not None)
        self.cfg = cfg
        self._server = _Server(_Config(self.app, self.https, host=cfg.host, port=cfg.port,
                                       log_level="warning", access_log=False, lifespan="on",
                                       server_header=False))
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"{'https' if self.https is not None else 'http'}://{host}:{self.bound_port}/"

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
            async with asyncio.timeout(10):
                await self._task
        self._task = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
