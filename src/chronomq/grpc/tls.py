"""What the gRPC endpoint's TLS uses (docs/grpc.md, "TLS"): the broker's TLS settings, read by
``chronomq.remoting.tls.load`` (shared with the remoting ports: the same keys, files and self-signed
certificate), as grpc's server credentials.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from chronomq.remoting import tls as shared
from chronomq.remoting.tls import DISABLED, ENFORCING, PERMISSIVE

__all__ = ["DISABLED", "ENFORCING", "PERMISSIVE", "TlsSettings", "load"]


@dataclasses.dataclass(frozen=True)
class TlsSettings(shared.TlsSettings):
    """The shared settings, with grpc's credentials for them."""

    def server_credentials(self) -> Any:
        import grpc

        assert self.cert_pem is not None and self.key_pem is not None
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.trust_pem,
                                           require_client_auth=self.trust_pem is not None)


def load(config: Any) -> TlsSettings:
    """The settings for ``config`` (a BrokerConfig, already validated). Raises OSError with the file and
    the reason when a file cannot be used."""
    settings = shared.load(config, "gRPC endpoint")
    return TlsSettings(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})
