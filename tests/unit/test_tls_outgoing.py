"""The broker's own connections over TLS (docs/tls.md, "Outgoing connections"): RocketMQ's client keys
(tls.enable, tls.client.*) and their checks, and a broker registering with a name server of its own
(another server object on the loop, in enforcing mode) as ``chronomq broker`` does: with tlsEnable it
registers and its route is found, verifying the name server's certificate when told to and presenting its
own under mutual TLS; without, the name server refuses it and the broker logs that once, not every round."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.conftest import free_port

from chronomq.broker.controller import BrokerController
from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig, ConfigError
from chronomq.namesrv.server import NameServer
from chronomq.remoting import selfsigned
from chronomq.remoting.tls import ServerTls, outgoing_context

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Server, client and stranger pairs (self-signed, each its own root), an encrypted-looking key and a
    file that holds no certificate."""
    d = tmp_path_factory.mktemp("pki")
    out = {}
    for name, client in (("server", False), ("client", True), ("stranger", True)):
        cert, key = selfsigned.generate(f"chronomq {name}", ["localhost", "127.0.0.1"], client=client)
        (d / f"{name}.crt").write_bytes(cert)
        (d / f"{name}.key").write_bytes(key)
        out[name], out[name + "_key"] = d / f"{name}.crt", d / f"{name}.key"
    out["encrypted_key"] = d / "encrypted.key"
    out["encrypted_key"].write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE "
                                    "KEY-----\n")
    out["not_pem"] = d / "not.pem"
    out["not_pem"].write_text("hello\n")
    return out


# --- the keys ----------------------------------------------------------------------------------------------
def test_rocketmq_names_set_the_client_keys(pki: dict[str, Path]) -> None:
    config, warnings = BrokerConfig.load(None, {
        "tls.enable": "true", "tls.client.authServer": "true",
        "tls.client.trustCertPath": str(pki["server"]), "tls.client.certPath": str(pki["client"]),
        "tls.client.keyPath": str(pki["client_key"])})
    assert warnings == []
    assert config.tlsEnable and config.tlsClientAuthServer
    assert (config.tlsClientTrustCertPath, config.tlsClientCertPath, config.tlsClientKeyPath) == (
        str(pki["server"]), str(pki["client"]), str(pki["client_key"]))
    ctx = outgoing_context(config)
    assert ctx is not None and ctx.verify_mode.name == "CERT_REQUIRED" and not ctx.check_hostname
    default, _ = BrokerConfig.load(None, {})
    assert not default.tlsEnable and outgoing_context(default) is None  # plaintext, as before


def test_without_auth_server_any_certificate_is_taken_and_with_it_the_system_roots_serve() -> None:
    config, _ = BrokerConfig.load(None, {"tlsEnable": "true"})
    ctx = outgoing_context(config)
    assert ctx is not None and ctx.verify_mode.name == "CERT_NONE"  # RocketMQ's clients' default
    config, _ = BrokerConfig.load(None, {"tlsEnable": "true", "tlsClientAuthServer": "true"})
    ctx = outgoing_context(config)
    assert ctx is not None and ctx.verify_mode.name == "CERT_REQUIRED" and not ctx.check_hostname


@pytest.mark.parametrize(("keys", "says"), [
    ({"tlsClientCertPath": "CERT"}, "tlsClientCertPath (tls.client.certPath) and tlsClientKeyPath "
                                    "(tls.client.keyPath): set both or neither"),
    ({"tls.client.keyPath": "KEY"}, "set both or neither"),
    ({"tlsEnable": "true", "tlsClientAuthServer": "true", "tlsClientTrustCertPath": "MISSING"},
     "tlsClientTrustCertPath (tls.client.trustCertPath): cannot read"),
    ({"tlsEnable": "true", "tlsClientAuthServer": "true", "tlsClientTrustCertPath": "NOT_PEM"},
     "no usable PEM certificate in"),
    ({"tlsEnable": "true", "tlsClientCertPath": "CERT", "tlsClientKeyPath": "MISSING"},
     "tlsClientKeyPath (tls.client.keyPath): cannot read"),
    ({"tlsEnable": "true", "tlsClientCertPath": "CERT", "tlsClientKeyPath": "OTHER_KEY"},
     "cannot be used together"),
    ({"tlsEnable": "true", "tlsClientCertPath": "CERT", "tlsClientKeyPath": "ENCRYPTED"},
     "is encrypted"),
    ({"tlsEnable": "maybe"}, "tlsEnable: 'maybe' is not a boolean"),
])
def test_client_key_mistakes_are_configuration_errors(pki: dict[str, Path], tmp_path: Path,
                                                      keys: dict[str, str], says: str) -> None:
    files = {"CERT": pki["client"], "OTHER_KEY": pki["stranger_key"], "ENCRYPTED": pki["encrypted_key"],
             "NOT_PEM": pki["not_pem"], "MISSING": tmp_path / "missing.pem", "KEY": pki["client_key"]}
    values = {k: str(files.get(v, v)) for k, v in keys.items()}
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        BrokerConfig.load(None, values)


def test_the_client_files_are_not_read_while_tls_enable_is_off(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    config, _ = BrokerConfig.load(None, {"tlsClientAuthServer": "true", "tlsClientTrustCertPath": missing,
                                         "tlsClientCertPath": missing, "tlsClientKeyPath": missing})
    assert outgoing_context(config) is None


# --- registration with an enforcing name server ----------------------------------------------------------
@pytest.fixture
async def namesrv(tmp_path: Path, pki: dict[str, Path]) -> AsyncIterator[NameServer]:
    """A name server serving TLS only, with the server certificate of ``pki``."""
    keys = {"storePathRootDir": str(tmp_path / "ns"), "tlsServerMode": "enforcing",
            "tlsCertPath": str(pki["server"]), "tlsKeyPath": str(pki["server_key"])}
    config, _ = BrokerConfig.load(None, keys)
    ns = NameServer("127.0.0.1", free_port(), SystemClock(), tls=ServerTls.from_config(config, "namesrv"))
    await ns.start()
    try:
        yield ns
    finally:
        await ns.stop()


async def _registered(tmp_path: Path, ns: NameServer, **keys: str) -> tuple[BrokerController, bool]:
    """A broker of ``keys`` started against ``ns`` (and stopped): whether its route was found."""
    values = {"storePathRootDir": str(tmp_path / "b"), "listenPort": str(free_port()),
              "haListenPort": str(free_port()), "metricsPort": "-1", "namesrvAddr": ns.address,
              "brokerName": "broker-tls", **keys}
    config, _ = BrokerConfig.load(None, values)
    broker = BrokerController(config, SystemClock())
    await broker.start()  # registers once before it returns
    try:
        for _ in range(2):  # and again: a refusal is not logged twice
            await broker.register_all()
        route = ns.routes.topic_route("broker-tls")
        found = route is not None and [b["brokerAddrs"] for b in route["brokerDatas"]] == [
            {"0": broker.broker_addr}]
        return broker, found
    finally:
        await broker.shutdown()


async def test_a_broker_with_tls_enable_registers_and_without_it_is_refused_once(
        tmp_path: Path, namesrv: NameServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    _, found = await _registered(tmp_path, namesrv, tlsEnable="true")
    assert found and namesrv.server.tls_connections >= 1 and namesrv.server.tls_failures == 0
    assert [r for r in caplog.records if "registered with name server" in r.getMessage()]
    caplog.clear()
    assert namesrv.routes.topic_route("broker-tls") is None  # unregistered at its shutdown
    _, found = await _registered(tmp_path / "plain", namesrv)
    assert not found and namesrv.server.refused_by_tls_mode >= 3
    refusals = [r.getMessage() for r in caplog.records if "cannot register" in r.getMessage()]
    assert len(refusals) == 1 and "set tlsEnable=true" in refusals[0], refusals
    assert not [r for r in caplog.records if r.exc_info]


async def test_a_verifying_broker_registers_with_the_trusted_name_server_only(
        tmp_path: Path, namesrv: NameServer, pki: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    _, found = await _registered(tmp_path / "a", namesrv, tlsEnable="true", tlsClientAuthServer="true",
                                 tlsClientTrustCertPath=str(pki["server"]))
    assert found
    _, found = await _registered(tmp_path / "b", namesrv, tlsEnable="true", tlsClientAuthServer="true",
                                 tlsClientTrustCertPath=str(pki["stranger"]))
    assert not found
    refusals = [r.getMessage() for r in caplog.records if "cannot register" in r.getMessage()]
    assert len(refusals) == 1 and "TLS handshake failed" in refusals[0] and "certificate" in refusals[0]


async def test_under_mutual_tls_the_broker_presents_its_client_certificate(
        tmp_path: Path, pki: dict[str, Path]) -> None:
    keys = {"storePathRootDir": str(tmp_path / "ns"), "tlsServerMode": "enforcing",
            "tlsCertPath": str(pki["server"]), "tlsKeyPath": str(pki["server_key"]),
            "tlsServerNeedClientAuth": "require", "tlsServerTrustCertPath": str(pki["client"])}
    config, _ = BrokerConfig.load(None, keys)
    ns = NameServer("127.0.0.1", free_port(), SystemClock(), tls=ServerTls.from_config(config, "namesrv"))
    await ns.start()
    try:
        _, found = await _registered(tmp_path / "a", ns, tlsEnable="true",
                                     tlsClientCertPath=str(pki["client"]),
                                     tlsClientKeyPath=str(pki["client_key"]))
        assert found
        failures = ns.server.tls_failures
        _, found = await _registered(tmp_path / "b", ns, tlsEnable="true",
                                     tlsClientCertPath=str(pki["stranger"]),
                                     tlsClientKeyPath=str(pki["stranger_key"]))
        assert not found and ns.server.tls_failures > failures
    finally:
        await ns.stop()
