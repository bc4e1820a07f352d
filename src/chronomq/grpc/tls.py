"""What the gRPC endpoint's TLS uses (docs/grpc.md, "TLS"): the broker's TLS settings, read by
``chronomq.remoting.tls.load`` (shared with the remoting ports: the same keys, files and self-signed
certificate), as grpc's server credentials.

``Certificates`` reloads the files as the remoting ports do (``remoting.tls.ServerTls``: a stat of each as a
TLS connection arrives, the pair checked with the ``ssl`` module before it is served): grpc asks before each
TLS handshake, on its own threads, and is handed the files' new contents only once they changed and can be
used together; otherwise it keeps serving what it has.
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
import threading
from typing import Any

from chronomq.remoting import tls as shared
from chronomq.remoting.tls import DISABLED, ENFORCING, PERMISSIVE

__all__ = ["DISABLED", "ENFORCING", "PERMISSIVE", "Certificates", "TlsSettings", "load"]

log = logging.getLogger("chronomq.grpc")

NAME = "gRPC endpoint"  # how the reload lines name the port

Pems = tuple[bytes, bytes, bytes | None]  # certificate chain, key, client trust certificates


@dataclasses.dataclass(frozen=True)
class TlsSettings(shared.TlsSettings):
    """The shared settings, with grpc's credentials for them."""

    def server_credentials(self) -> Any:
        """grpc's credentials serving these files, reloaded when they change (``Certificates``)."""
        return Certificates(self).credentials()


def load(config: Any) -> TlsSettings:
    """The settings for ``config`` (a BrokerConfig, already validated). Raises OSError with the file and
    the reason when a file cannot be used."""
    settings = shared.load(config, NAME)
    return TlsSettings(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})


class _Watched(shared.ServerTls):
    """A ``ServerTls`` that keeps the PEM bytes its context was checked with: grpc takes the contents, not the
    files. A file that changes while it is read fails the build (the pair before is kept, and the next look
    sees the file changed again)."""

    pems: Pems

    def _build(self) -> ssl.SSLContext:
        before = self._contents()
        try:
            ctx = super()._build()
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            raise OSError(f"{self._culprit()}: {e}") from None
        if self._contents() != before:
            raise OSError("a file changed while it was being read")
        self.pems = before
        return ctx

    def _contents(self) -> Pems:
        s = self.settings
        assert s.cert_path is not None and s.key_path is not None
        try:
            trust = None if s.trust_path is None else s.trust_path.read_bytes()
            return s.cert_path.read_bytes(), s.key_path.read_bytes(), trust
        except OSError as e:
            raise OSError(f"cannot read {e.filename}: {e.strerror or e}") from None

    def _culprit(self) -> str:
        """Which file(s) a failed build is about: the trust file when it holds no usable certificate, else
        the certificate and its key."""
        s = self.settings
        if s.trust_path is not None:
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=str(s.trust_path))
            except (OSError, ValueError):
                return f"the client trust certificates {s.trust_path} (tlsServerTrustCertPath)"
        return f"the certificate {s.cert_path} and the key {s.key_path} cannot be used together"


class Certificates:
    """The endpoint's certificate, key and (mutual TLS) client trust files, served by grpc and reloaded when
    they change. ``credentials()``: grpc's server credentials, built once; their fetcher (``fetch``) is what
    grpc calls before each new TLS handshake. ``reloads`` counts the changes served."""

    def __init__(self, settings: shared.TlsSettings, name: str = NAME) -> None:
        assert settings.serves_tls and settings.cert_path is not None, "TLS settings with their files"
        self._watch = _Watched(settings, name)
        self._lock = threading.Lock()  # grpc calls the fetcher from several threads at once
        self.require_client_auth = settings.trust_path is not None

    @property
    def reloads(self) -> int:
        return self._watch.reloads

    def _configuration(self) -> Any:
        import grpc

        cert, key, trust = self._watch.pems
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=trust)

    def credentials(self) -> Any:
        import grpc

        with self._lock:
            initial = self._configuration()
        return grpc.dynamic_ssl_server_credentials(initial, self.fetch,
                                                   require_client_authentication=self.require_client_auth)

    def fetch(self) -> Any:
        """The configuration for the next handshake when the files changed (and can be used), else None:
        grpc keeps the one it has. Never raises (grpc would log a traceback of its own)."""
        with self._lock:
            try:
                if not self._watch.refresh():
                    return None
                return self._configuration()
            except Exception as e:  # not expected: refresh() logs and keeps what it had
                log.warning("%s TLS: cannot reload the certificate files (%s); still serving the ones "
                            "loaded before", self._watch.name, e)
                return None
