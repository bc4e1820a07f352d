"""What the gRPC endpoint's TLS uses, read from the broker's configuration (docs/grpc.md, "TLS").

``load(config)`` reads the configured certificate, key and client trust store, or (``tlsTestModeEnable``,
no certificate configured) makes or reuses a self-signed pair under ``<storePathRootDir>/tls/``. Every file
is checked with the ``ssl`` module before grpc sees it (a key that does not match the certificate, an
encrypted key, a trust file with no certificate), so a mistake is a clear OSError at start, not a failed
handshake later.
"""

from __future__ import annotations

import logging
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import selfsigned

log = logging.getLogger("chronomq.grpc")

DISABLED, PERMISSIVE, ENFORCING = "disabled", "permissive", "enforcing"


@dataclass(frozen=True)
class TlsSettings:
    """``mode`` disabled | permissive | enforcing; the PEMs are None when the mode is disabled."""

    mode: str
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    trust_pem: bytes | None = None  # client certificates must chain to these (mutual TLS) when set
    cert_path: Path | None = None
    self_signed: bool = False

    @property
    def serves_tls(self) -> bool:
        return self.mode != DISABLED

    @property
    def serves_plaintext(self) -> bool:
        return self.mode != ENFORCING

    def server_credentials(self) -> Any:
        import grpc

        assert self.cert_pem is not None and self.key_pem is not None
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.trust_pem,
                                           require_client_auth=self.trust_pem is not None)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise OSError(f"TLS: cannot read {what} {path}: {e.strerror or e}") from None


def load(config: Any) -> TlsSettings:
    """The settings for ``config`` (a BrokerConfig, already validated). Raises OSError with the file and
    the reason when a file cannot be used."""
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
        log.info("gRPC endpoint TLS: %s self-signed certificate %s (set tlsCertPath and tlsKeyPath to serve "
                 "your own)", "made the" if made else "reusing the", cert_path)
    cert_pem = _read(cert_path, "the certificate (tlsCertPath)")
    key_pem = _read(key_path, "the private key (tlsKeyPath)")
    if b"ENCRYPTED" in key_pem:
        raise OSError(f"TLS: the private key {key_path} is encrypted; the gRPC endpoint needs it unencrypted "
                      "(openssl pkey -in KEY -out PLAIN_KEY), readable by the broker only")
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        check.load_cert_chain(cert_path, key_path)
    except (ssl.SSLError, ValueError) as e:
        raise OSError(f"TLS: the certificate {cert_path} and the key {key_path} cannot be used together: "
                      f"{e}") from None
    trust_pem = None
    if config.tlsServerNeedClientAuth == "require":
        trust_path = Path(config.tlsServerTrustCertPath)
        trust_pem = _read(trust_path, "the client trust certificates (tlsServerTrustCertPath)")
        try:
            check.load_verify_locations(cadata=trust_pem.decode("ascii"))
        except (ssl.SSLError, ValueError, UnicodeDecodeError) as e:
            raise OSError(f"TLS: no usable PEM certificate in {trust_path} (tlsServerTrustCertPath): "
                          f"{e}") from None
    return TlsSettings(mode, cert_pem, key_pem, trust_pem, cert_path, self_signed)
