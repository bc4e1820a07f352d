"""TLS for the broker's ports, as RocketMQ serves it (docs/tls.md).

- ``load(config)``: the settings (mode, certificate, key, client trust store) read from a BrokerConfig and
  checked with the ``ssl`` module, or (``tlsTestModeEnable``, no certificate configured) the self-signed
  pair under ``<storePathRootDir>/tls/``; the remoting ports and the gRPC endpoint share them;
- ``ServerTls``: a server port's mode and the ``ssl.SSLContext`` its TLS connections are served with,
  rebuilt when one of its files changes (a stat of each as a TLS connection arrives);
- ``TlsSession``: the server side of TLS over one connection, sans-IO (two ``ssl.MemoryBIO`` and an
  ``SSLObject``): bytes from the network in, plaintext out, and the reverse;
- ``client_context``: a client's context from its ``tls`` option (RocketMQ's clients do not verify the
  server's certificate unless told to).
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        stamp = self._stamps()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                ctx = self._build()
            except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
                log.warning("%s TLS: the changed certificate files cannot be used (%s); still serving "
                            "the ones loaded before", self.name, e)
            else:
                self._context = ctx
                self.reloads += 1
                log.info("%s TLS: certificate files changed, reloaded %s", self.name, self.settings.cert_path)
        assert self._context is not None, "context() of a port whose TLS is disabled"
        return self._context


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
