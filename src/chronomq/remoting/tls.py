"""TLS for the broker's ports, as RocketMQ serves it (docs/tls.md).

- ``load(config)``: the settings (mode, certificate, key, client trust store) read from a BrokerConfig and
  checked with the ``ssl`` module, or (``tlsTestModeEnable``, no certificate configured) the self-signed
  pair under ``<storePathRootDir>/tls/``; the remoting ports and the gRPC endpoint share them;
- ``ServerTls``: a server port's mode and the ``ssl.SSLContext`` its TLS connections are served with,
  rebuilt when one of its files changes (a stat of each as a TLS connection arrives);
- ``TlsSession``: the server side of TLS over one connection, sans-IO (two ``ssl.MemoryBIO`` and an
  ``SSLObject``): bytes from the network in, plaintext out, and the reverse;
- ``client_context``: a client's context from its ``tls`` option (RocketMQ's clients do not verify the
  server's certificate unless told to); ``outgoing_context``: the broker's own connections' context, from
  its client keys (``tlsEnable``, ``tlsClientAuthServer``, ...);
- ``StreamAcceptor``: the same first-byte choice for a port served with asyncio streams (the HA port):
  a TLS connection goes through a ``TlsSession`` behind a stream writer of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chronomq.clock import Clock

from . import selfsigned

log = logging.getLogger("chronomq.remoting")

DISABLED, PERMISSIVE, ENFORCING = "disabled", "permissive", "enforcing"
HANDSHAKE = 0x16  # a TLS record of type handshake: the first byte a TLS client sends
READ_CHUNK = 256 * 1024  # plaintext taken from the TLS layer per read call

# a client's ``tls`` option: off (None, False), on without verifying the server (True), on verifying
# against a CA file (its path), or a context of the caller's own
TlsOption = bool | str | os.PathLike[str] | ssl.SSLContext | None


@dataclass(frozen=True)
class TlsSettings:
    """``mode`` disabled | permissive | enforcing; the PEMs and paths are None when the mode is disabled.
    ``trust_pem``/``trust_path``: client certificates must chain to these (mutual TLS) when set."""

    mode: str
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    trust_pem: bytes | None = None
    cert_path: Path | None = None
    self_signed: bool = False
    key_path: Path | None = None
    trust_path: Path | None = None

    @property
    def serves_tls(self) -> bool:
        return self.mode != DISABLED

    @property
    def serves_plaintext(self) -> bool:
        return self.mode != ENFORCING


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise OSError(f"TLS: cannot read {what} {path}: {e.strerror or e}") from None


def _no_password() -> bytes:
    # given to load_cert_chain so that an encrypted key is an error, never a passphrase prompt on the tty
    raise ValueError("the private key is encrypted")


def load(config: Any, what: str = "TLS") -> TlsSettings:
    """The settings for ``config`` (a BrokerConfig, already validated); ``what`` names the port in the log
    line about the self-signed certificate. Raises OSError with the file and the reason when a file cannot
    be used."""
    mode = getattr(config, "tlsServerMode", PERMISSIVE)
    if mode == DISABLED:
        return TlsSettings(mode)
    cert_path = Path(config.tlsCertPath) if config.tlsCertPath else None
    key_path = Path(config.tlsKeyPath) if config.tlsKeyPath else None
    self_signed = cert_path is None
    if cert_path is None or key_path is None:
        hosts = ["localhost", "127.0.0.1", "::1", config.brokerIP1, socket.gethostname()]
        directory = Path(config.storePathRootDir) / "tls"
        try:
            cert_path, key_path, made = selfsigned.ensure(directory, f"chronomq {config.brokerName}", hosts)
        except OSError as e:
            raise OSError(f"TLS: cannot write the self-signed certificate under {directory}: "
                          f"{e.strerror or e}") from None
        log.info("%s TLS: %s self-signed certificate %s (set tlsCertPath and tlsKeyPath to serve your own)",
                 what, "made the" if made else "reusing the", cert_path)
    cert_pem = _read(cert_path, "the certificate (tlsCertPath)")
    key_pem = _read(key_path, "the private key (tlsKeyPath)")
    if b"ENCRYPTED" in key_pem:
        raise OSError(f"TLS: the private key {key_path} is encrypted; chronomq needs it unencrypted "
                      "(openssl pkey -in KEY -out PLAIN_KEY), readable by the broker only")
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        check.load_cert_chain(cert_path, key_path, password=_no_password)
    except (ssl.SSLError, ValueError) as e:
        raise OSError(f"TLS: the certificate {cert_path} and the key {key_path} cannot be used together: "
                      f"{e}") from None
    trust_pem = trust_path = None
    if config.tlsServerNeedClientAuth == "require":
        trust_path = Path(config.tlsServerTrustCertPath)
        trust_pem = _read(trust_path, "the client trust certificates (tlsServerTrustCertPath)")
        try:
            check.load_verify_locations(cadata=trust_pem.decode("ascii"))
        except (ssl.SSLError, ValueError, UnicodeDecodeError) as e:
            raise OSError(f"TLS: no usable PEM certificate in {trust_path} (tlsServerTrustCertPath): "
                          f"{e}") from None
    return TlsSettings(mode, cert_pem, key_pem, trust_pem, cert_path, self_signed, key_path, trust_path)


_Stamp = tuple[tuple[int, int, int] | None, ...]


class ServerTls:
    """A server port's TLS: its mode and, unless disabled, the context each TLS connection is served with.

    The context is built from the settings' files (certificate chain, key, and the client trust file under
    mutual TLS) and built anew when one of them has changed, checked by ``context()`` with a stat of each
    file as a TLS connection arrives (RocketMQ's servers watch the same files). Files that cannot be used
    together (a certificate renewed, its key not yet) are logged once and the context loaded before is kept.
    With ``later`` (and settings that name the mode only), the settings are loaded by the first
    ``context()`` call: a port whose clients never ask for TLS never makes a self-signed certificate.
    """

    def __init__(self, settings: TlsSettings, name: str = "remoting",
                 later: Callable[[], TlsSettings] | None = None) -> None:
        self.name = name
        self.mode = settings.mode
        self.serves_tls = settings.serves_tls
        self.serves_plaintext = settings.serves_plaintext
        self.reloads = 0
        self._later = later
        self._context: ssl.SSLContext | None = None
        self._use(settings)

    def _use(self, settings: TlsSettings) -> None:
        self.settings = settings
        files = (settings.cert_path, settings.key_path, settings.trust_path)
        self._paths = [p for p in files if p is not None]
        self._stamp = self._stamps()
        if self.serves_tls and self._later is None:
            self._context = self._build()

    @classmethod
    def from_config(cls, config: Any, name: str = "remoting") -> ServerTls:
        """The TLS of a port served with ``config``'s keys. Configured files are read and checked now
        (OSError as ``load`` raises it); the self-signed certificate (no ``tlsCertPath``) is made or read
        at the first TLS connection."""
        mode = getattr(config, "tlsServerMode", PERMISSIVE)
        if mode == DISABLED or config.tlsCertPath:
            return cls(load(config, name), name)
        return cls(TlsSettings(mode), name, later=lambda: load(config, name))

    def _stamps(self) -> _Stamp:
        out: list[tuple[int, int, int] | None] = []
        for p in self._paths:
            try:
                st = os.stat(p)
            except OSError:
                out.append(None)
            else:
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def _build(self) -> ssl.SSLContext:
        s = self.settings
        assert s.cert_path is not None and s.key_path is not None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.options |= ssl.OP_NO_RENEGOTIATION  # TLS 1.2: a client cannot make the server redo handshakes
        ctx.load_cert_chain(s.cert_path, s.key_path, password=_no_password)
        if s.trust_path is not None:
            ctx.load_verify_locations(cafile=str(s.trust_path))
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def context(self) -> ssl.SSLContext:
        """The context for a new TLS connection (rebuilt first when a file changed since the last look).
        Raises OSError when the settings loaded now (``later``) cannot be used."""
        if self._later is not None:
            settings = self._later()
            self._later = None
            self._use(settings)
            assert self._context is not None
            return self._context
        self.refresh()
        assert self._context is not None, "context() of a port whose TLS is disabled"
        return self._context

    def refresh(self) -> bool:
        """Looks at the files (a stat of each) and, when one changed since the last look, builds the context
        anew from them: True when it did (INFO), False when nothing changed or the changed files cannot be
        used together (WARNING, the context loaded before kept). ``context()`` calls it; the gRPC endpoint
        calls it too, before each TLS handshake."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            ctx = self._build()
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            log.warning("%s TLS: the changed certificate files cannot be used (%s); still serving "
                        "the ones loaded before", self.name, e)
            return False
        self._context = ctx
        self.reloads += 1
        log.info("%s TLS: certificate files changed, reloaded %s", self.name, self.settings.cert_path)
        return True


class TlsSession:
    """The server side of TLS over one connection, sans-IO. ``receive(data)`` takes bytes from the network
    and returns the plaintext they completed (b"" while the handshake runs); ``send(plaintext)`` returns
    the records that carry it; ``take()`` returns what the TLS layer itself has to send (handshake
    messages, session tickets, alerts). ``receive`` raises ``ssl.SSLError`` when the handshake or a record
    fails; ``eof`` is set once the peer has sent close_notify."""

    __slots__ = ("_incoming", "_obj", "_outgoing", "eof", "handshaken")

    def __init__(self, context: ssl.SSLContext) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._obj = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self.handshaken = False
        self.eof = False

    @property
    def ssl_object(self) -> ssl.SSLObject:
        return self._obj

    def extra_info(self, raw: Any, name: str, default: Any = None) -> Any:
        """``get_extra_info`` of a transport or writer carrying this session over ``raw``: the TLS names
        from the session, the others from ``raw``."""
        if name == "ssl_object":
            return self._obj
        if name == "peercert":
            return self._obj.getpeercert()
        return raw.get_extra_info(name, default)

    def receive(self, data: bytes) -> bytes:
        self._incoming.write(data)
        obj = self._obj
        if not self.handshaken:
            try:
                obj.do_handshake()
            except ssl.SSLWantReadError:
                return b""
            self.handshaken = True
        chunks = []
        while True:
            try:
                chunk = obj.read(READ_CHUNK)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                self.eof = True
                break
            if not chunk:  # close_notify
                self.eof = True
                break
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def send(self, data: bytes) -> bytes:
        """The records for ``data`` (with anything the layer had pending before them). Only after the
        handshake."""
        obj = self._obj
        view = memoryview(data)
        while view:
            view = view[obj.write(view):]
        return self._outgoing.read()

    def take(self) -> bytes:
        return self._outgoing.read()

    def close_notify(self) -> bytes:
        """The close_notify alert to send before closing (b"" when the layer cannot send one any more)."""
        try:
            self._obj.unwrap()
        except (ssl.SSLError, ValueError):  # SSLWantReadError: it waits for the peer's, which we do not
            pass
        return self._outgoing.read()


def client_context(tls: TlsOption) -> ssl.SSLContext | None:
    """A client's context for its ``tls`` option: None (plaintext) for None/False; for True, TLS without
    verifying the server's certificate, as RocketMQ's clients connect by default
    (``tls.client.authServer=false``); for a path, TLS verifying the server's certificate chain against
    that PEM file (not the host name: brokers are reached at the addresses they register, which a
    certificate seldom names; RocketMQ's clients do not check it either); an ``ssl.SSLContext`` is used as
    it is (a client certificate for mutual TLS goes there: ``load_cert_chain``)."""
    if tls is None or tls is False:
        return None
    if isinstance(tls, ssl.SSLContext):
        return tls
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    if tls is True:
        ctx.verify_mode = ssl.CERT_NONE
    else:
        try:
            ctx.load_verify_locations(cafile=os.fspath(tls))
        except (OSError, ValueError) as e:
            raise ValueError(f"tls: cannot use {os.fspath(tls)} as the certificates to verify the server "
                             f"with: {e}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def outgoing_context(config: Any) -> ssl.SSLContext | None:
    """The context of a broker's own connections (its registrations with name servers, a slave's links to
    its master) from the client keys of ``config``, as RocketMQ's clients read them: None (plaintext)
    without ``tlsEnable``; TLS not verifying the server unless ``tlsClientAuthServer``, then verifying its
    chain against ``tlsClientTrustCertPath`` (the system's roots without one; never the host name, see
    ``client_context``); ``tlsClientCertPath``/``tlsClientKeyPath`` presented for mutual TLS. The config's
    validation checked the files; OSError naming the key when they cannot be used now."""
    if not getattr(config, "tlsEnable", False):
        return None
    try:
        if not config.tlsClientAuthServer:
            ctx = client_context(True)
        elif config.tlsClientTrustCertPath:
            ctx = client_context(config.tlsClientTrustCertPath)
        else:  # verify against the system's roots
            ctx = client_context(ssl.create_default_context(ssl.Purpose.SERVER_AUTH))
            assert ctx is not None
            ctx.check_hostname = False
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    except ValueError as e:
        raise OSError(f"TLS (tlsClientTrustCertPath): {e}") from None
    assert ctx is not None
    if config.tlsClientCertPath:
        try:
            ctx.load_cert_chain(config.tlsClientCertPath, config.tlsClientKeyPath, password=_no_password)
        except (OSError, ValueError) as e:
            raise OSError(f"TLS: the client certificate {config.tlsClientCertPath} and key "
                          f"{config.tlsClientKeyPath} (tlsClientCertPath, tlsClientKeyPath) cannot be used "
                          f"together: {e}") from None
    return ctx


class TlsStreamWriter:
    """The writer of a TLS connection accepted by ``StreamAcceptor``: what is written is encrypted by the
    connection's ``TlsSession`` and the records written to the socket's writer in one call; ``close`` sends
    close_notify and stops the task that decrypts what arrives (into the connection's reader)."""

    def __init__(self, raw: asyncio.StreamWriter, session: TlsSession) -> None:
        self.raw = raw
        self.session = session
        self.pump: asyncio.Task[None] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            records = self.session.send(bytes(data))
        except ssl.SSLError as e:  # the layer failed on a read before: nothing more can be sent
            self.raw.transport.abort()
            raise ConnectionError(f"TLS stream failed: {_reason(e)}") from None
        self.raw.write(records)

    async def drain(self) -> None:
        await self.raw.drain()

    def is_closing(self) -> bool:
        return self.raw.is_closing()

    def close(self) -> None:
        if self.pump is not None:
            self.pump.cancel()
        if self.raw.is_closing():
            return
        bye = self.session.close_notify()
        if bye:
            self.raw.write(bye)
        self.raw.close()

    async def wait_closed(self) -> None:
        with contextlib.suppress(Exception):
            await self.raw.wait_closed()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.session.extra_info(self.raw, name, default)


# a stream connection as StreamAcceptor hands it on: its reader, its writer, and the plaintext already read
# from it (a plaintext connection's first bytes: the handler reads them before the reader's)
Accepted = tuple[asyncio.StreamReader, asyncio.StreamWriter | TlsStreamWriter, bytes]


def _reason(e: ssl.SSLError) -> str:
    """One line for a TLS failure: OpenSSL's reason (or the certificate check's message)."""
    why = getattr(e, "verify_message", None) or getattr(e, "reason", None) or str(e)
    return why.lower().replace("_", " ")


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)


class StreamAcceptor:
    """TLS and plaintext on one port served with asyncio streams (the HA port), as ``RemotingServer`` serves
    them on the remoting ports: the first bytes of a connection tell (0x16, a TLS handshake record, else
    the port's own protocol in plaintext) and ``tls``'s mode may refuse either.

    ``await acceptor(reader, writer)`` (a stream server's new connection) reads its first bytes and returns
    ``(reader, writer, head)`` to serve it with: the same reader and writer and the bytes read (``head``)
    for plaintext; for TLS, once the handshake is done (a ``TlsSession``, sans-IO), a reader of the
    decrypted bytes, a ``TlsStreamWriter`` and the plaintext that came with the handshake. None when the
    connection was refused by the mode (closed; a WARNING at once, then at most one every 10 s with the
    count since), when its handshake failed (INFO, one line) or when it closed first (DEBUG). A caller
    bounds the wait (the first bytes and the handshake) with its own timeout; cancelled, nothing is left
    open."""

    def __init__(self, tls: ServerTls, name: str, clock: Clock) -> None:
        self.tls = tls
        self.name = name
        self.clock = clock
        self.tls_connections = 0
        self.tls_failures = 0
        self.refused_by_tls_mode = 0
        self._unlogged = 0
        self._logged_at: float | None = None

    def _refuse(self, writer: asyncio.StreamWriter, why: str) -> None:
        writer.close()
        self.refused_by_tls_mode += 1
        self._unlogged += 1
        now = self.clock.monotonic()
        last = self._logged_at
        if last is None or now - last >= 10.0:
            log.warning("%s: refused %d connection(s)%s, the last from %s: %s", self.name, self._unlogged,
                        "" if last is None else f" in {now - last:.0f} s", _peer(writer), why)
            self._unlogged = 0
            self._logged_at = now

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Accepted | None:
        try:
            return await self._accept(reader, writer)
        except BaseException:
            writer.close()
            raise

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Accepted | None:
        tls = self.tls
        try:
            first = await reader.read(READ_CHUNK)
        except (ConnectionError, OSError) as e:
            log.debug("%s: %s left before it sent anything: %s", self.name, _peer(writer), e)
            writer.close()
            return None
        if not first:
            log.debug("%s: %s closed before it sent anything", self.name, _peer(writer))
            writer.close()
            return None
        if first[0] != HANDSHAKE:
            if tls.serves_plaintext:
                return reader, writer, first
            self._refuse(writer, "plaintext refused: tlsServerMode is enforcing (TLS only)")
            return None
        if not tls.serves_tls:
            self._refuse(writer, "TLS refused: tlsServerMode is disabled (plaintext only)")
            return None
        try:
            context = tls.context()
        except OSError as e:  # the self-signed certificate, made at the first TLS connection
            log.error("%s: cannot serve TLS to %s: %s", self.name, _peer(writer), e)
            writer.close()
            return None
        session = TlsSession(context)
        data, head = first, b""
        try:
            while True:
                head += session.receive(data)
                out = session.take()
                if out:
                    writer.write(out)
                if session.handshaken:
                    break
                data = await reader.read(READ_CHUNK)
                if not data:
                    log.debug("%s: %s closed during the TLS handshake", self.name, _peer(writer))
                    writer.close()
                    return None
        except ssl.SSLError as e:
            self.tls_failures += 1
            log.info("%s: TLS handshake with %s failed: %s", self.name, _peer(writer), _reason(e))
            writer.close()
            return None
        except (ConnectionError, OSError) as e:
            log.debug("%s: %s left during the TLS handshake: %s", self.name, _peer(writer), e)
            writer.close()
            return None
        self.tls_connections += 1
        plain = asyncio.StreamReader()
        if session.eof:
            plain.feed_eof()
        out_writer = TlsStreamWriter(writer, session)
        out_writer.pump = asyncio.ensure_future(self._pump(reader, out_writer, plain))
        return plain, out_writer, head

    async def _pump(self, reader: asyncio.StreamReader, writer: TlsStreamWriter,
                    plain: asyncio.StreamReader) -> None:
        """What arrives on a TLS connection, decrypted into ``plain`` until either side ends it."""
        session = writer.session
        try:
            while not session.eof:
                data = await reader.read(READ_CHUNK)
                if not data:
                    break
                got = session.receive(data)
                out = session.take()
                if out and not writer.raw.is_closing():
                    writer.raw.write(out)
                if got:
                    plain.feed_data(got)
            plain.feed_eof()
        except ssl.SSLError as e:
            self.tls_failures += 1
            log.info("%s: TLS stream with %s failed: %s", self.name, _peer(writer.raw), _reason(e))
            plain.set_exception(ConnectionError(f"TLS stream failed: {_reason(e)}"))
            writer.raw.close()
        except (ConnectionError, OSError) as e:
            plain.set_exception(e)
        except asyncio.CancelledError:
            plain.feed_eof()
            raise
