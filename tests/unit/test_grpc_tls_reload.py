"""The 5.x gRPC endpoint reloads its certificate files as the remoting ports do: files replaced by rename
are served to the next TLS connection (open ones keep theirs), a certificate and key that do not match
keep the pair before served with a WARNING naming the files, and under mutual TLS the trust file is
reloaded too. A broker in process, the real grpcio client on 127.0.0.1; the certificates are self-signed
(``selfsigned.generate``), each its own CA."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio and protobuf (chronomq dependencies) are not installed")

from test_grpc_tls import Broker as GrpcBroker  # noqa: E402

from chronomq.grpc import selfsigned, tls  # noqa: E402
from chronomq.grpc._proto import rocketmq_v2_pb2 as pb  # noqa: E402

SERVICE = "/apache.rocketmq.v2.MessagingService/"
HOSTS = ["localhost", "127.0.0.1"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[bytes, bytes]]:
    """Three server pairs (each certificate its own CA) and two client pairs: name -> (cert, key)."""
    return {name: selfsigned.generate(f"chronomq {name}", HOSTS, client=name.startswith("client"))
            for name in ("one", "two", "three", "client_a", "client_b")}


def _replace(data: bytes, dst: Path) -> None:
    """Write ``dst`` anew by rename, as a certificate renewal should."""
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, dst)


class Broker(GrpcBroker):
    """The TLS tests' broker, with the endpoint's certificates and channels that verify against a CA."""

    @property
    def certificates(self) -> tls.Certificates:
        certificates = self.broker.grpc.certificates
        assert certificates is not None
        return certificates

    def tls(self, root: bytes, client: tuple[bytes, bytes] | None = None) -> Any:
        """A channel of its own (no subchannel shared with another channel) verifying against ``root``."""
        cert, key = client if client is not None else (None, None)
        creds = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)
        target = f"127.0.0.1:{self.broker.grpc.port}"
        self.channels.append(grpc.aio.secure_channel(target, creds,
                                                     options=[("grpc.use_local_subchannel_pool", 1)]))
        return self.channels[-1]


async def _served(channel: Any) -> bool:
    """True when a call over ``channel`` is answered; False when its TLS connection cannot be made."""
    fn = channel.unary_unary(SERVICE + "QueryRoute",
                             request_serializer=pb.QueryRouteRequest.SerializeToString,
                             response_deserializer=pb.QueryRouteResponse.FromString)
    try:
        r = await fn(pb.QueryRouteRequest(topic=pb.Resource(name="TT")), timeout=5)
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        return False
    assert r.status.code == pb.OK
    return True


def _lines(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and text in r.getMessage()]


async def test_replaced_files_are_served_to_the_next_tls_connection_and_a_mismatched_pair_is_not(
        tmp_path: Path, pki: dict[str, tuple[bytes, bytes]], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="chronomq.remoting")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _replace(pki["one"][0], cert)
    _replace(pki["one"][1], key)
    ca = {name: pair[0] for name, pair in pki.items()}
    async with Broker(tmp_path, tlsServerMode="enforcing", tlsCertPath=str(cert), tlsKeyPath=str(key)) as b:
        held = b.tls(ca["one"])
        assert await _served(held)
        assert await _served(b.tls(ca["one"])) and b.certificates.reloads == 0  # nothing changed

        _replace(pki["two"][0], cert)
        _replace(pki["two"][1], key)
        assert await _served(b.tls(ca["two"]))
        assert not await _served(b.tls(ca["one"]))
        assert await _served(held)  # the connection open before keeps the certificate it was served
        assert b.certificates.reloads == 1
        reloaded = _lines(caplog, logging.INFO, "certificate files changed, reloaded")
        assert reloaded == [f"gRPC endpoint TLS: certificate files changed, reloaded {cert}"]

        _replace(pki["three"][0], cert)  # renewed before its key: the pair does not match
        assert await _served(b.tls(ca["two"]))
        assert not await _served(b.tls(ca["three"]))
        assert b.certificates.reloads == 1
        warned = _lines(caplog, logging.WARNING, "cannot be used")
        assert len(warned) == 1 and warned[0].startswith("gRPC endpoint TLS: ")
        assert f"the certificate {cert} and the key {key} cannot be used together" in warned[0]
        assert "still serving the ones loaded before" in warned[0]
        assert b"PRIVATE KEY" not in warned[0].encode() and pki["two"][1].decode() not in warned[0]

        _replace(pki["three"][1], key)  # the key follows
        assert await _served(b.tls(ca["three"]))
        assert not await _served(b.tls(ca["two"]))
        assert b.certificates.reloads == 2
        assert len(_lines(caplog, logging.WARNING, "cannot be used")) == 1  # logged once, not per connection


async def test_mutual_tls_reloads_the_client_trust_file(
        tmp_path: Path, pki: dict[str, tuple[bytes, bytes]]) -> None:
    cert, key, trust = tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "clients.crt"
    _replace(pki["one"][0], cert)
    _replace(pki["one"][1], key)
    _replace(pki["client_a"][0], trust)
    async with Broker(tmp_path, tlsServerMode="enforcing", tlsCertPath=str(cert), tlsKeyPath=str(key),
                      tlsServerNeedClientAuth="require", tlsServerTrustCertPath=str(trust)) as b:
        root = pki["one"][0]
        assert await _served(b.tls(root, pki["client_a"]))
        assert not await _served(b.tls(root, pki["client_b"]))
        assert not await _served(b.tls(root))  # no client certificate

        _replace(pki["client_b"][0], trust)
        assert await _served(b.tls(root, pki["client_b"]))
        assert not await _served(b.tls(root, pki["client_a"]))
        assert not await _served(b.tls(root))
        assert b.certificates.reloads == 1


def test_the_fetcher_hands_grpc_a_configuration_only_for_changed_files_that_can_be_used(
        tmp_path: Path, pki: dict[str, tuple[bytes, bytes]], caplog: pytest.LogCaptureFixture) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    _replace(pki["one"][0], cert)
    _replace(pki["one"][1], key)
    certificates = tls.Certificates(tls.TlsSettings(tls.PERMISSIVE, cert_path=cert, key_path=key))
    assert certificates.credentials() is not None and not certificates.require_client_auth
    assert certificates.fetch() is None  # unchanged: grpc keeps what it has
    _replace(pki["two"][0], cert)
    _replace(pki["two"][1], key)
    assert isinstance(certificates.fetch(), grpc.ServerCertificateConfiguration)
    assert certificates.fetch() is None and certificates.reloads == 1
    caplog.set_level(logging.WARNING, logger="chronomq.remoting")
    key.unlink()  # the key half-way through a renewal done without rename
    assert certificates.fetch() is None
    assert [r.getMessage() for r in caplog.records] == [
        f"gRPC endpoint TLS: the changed certificate files cannot be used (cannot read {key}: No such file "
        "or directory); still serving the ones loaded before"]
    _replace(pki["two"][1], key)  # back: a new inode, so a change; the same contents as served
    assert certificates.fetch() is not None and certificates.reloads == 2
