"""No secret in logs, metrics, the console or admin output: known secret values (an ACL 1.0 account's
secretKey, the passwords of initAuthenticationUser and of an ACL 2.0 user, the secretKey of
innerClientAuthenticationCredentials, a TLS private key's path and contents, a console user's password) are
given to brokers, a name server, the console and the 5.x endpoint's check, then looked for in every log
record of accepted and refused requests (DEBUG and up), the metrics text, the broker configuration as
GET_BROKER_CONFIG answers it (mqadmin getBrokerConfig), the console's pages and error pages, ``chronomq
admin user get|list`` and the reprs of the settings that hold them. Each refusal is also logged with who
(the access key or user and the address) and what (the request, its topics and groups)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import free_port

from chronomq.broker.controller import BrokerController
from chronomq.client import Admin, Message, NotPermitted, Producer
from chronomq.clock import SystemClock
from chronomq.config import BrokerConfig
from chronomq.namesrv.server import NameServer
from chronomq.remoting import selfsigned
from chronomq.remoting.codes import RequestCode

SECRET_ACL = "acl-S3cret-9f1e2d"  # the ACL 1.0 account's secretKey
SECRET_INIT = "init-S3cret-4b7a0c"  # initAuthenticationUser's password
SECRET_INNER = "inner-S3cret-77d1aa"  # innerClientAuthenticationCredentials' secretKey
SECRET_USER = "user-S3cret-2c8e55"  # an ACL 2.0 user's password
SECRET_CONSOLE = "console-pw-6e0b31"  # a console user's password
KEY_DIR = "keydir-0b5e71"  # in the TLS private key's path

ACL_FILE = f"""
accounts:
  - accessKey: opsAccess
    secretKey: {SECRET_ACL}
    admin: true
    defaultTopicPerm: PUB|SUB
    defaultGroupPerm: PUB|SUB
    topicPerms:
      - Locked=SUB
"""


def secrets_in(text: str, key_pem: bytes) -> list[str]:
    """The known secrets that appear in ``text``: the values, the key's path, any line of the key's PEM."""
    body = [line for line in key_pem.decode().splitlines() if line and not line.startswith("-----")]
    found = [s for s in (SECRET_ACL, SECRET_INIT, SECRET_INNER, SECRET_USER, SECRET_CONSOLE, KEY_DIR)
             if s in text]
    return found + [f"key line {i}" for i, line in enumerate(body) if line in text]


def logged(caplog: pytest.LogCaptureFixture) -> str:
    """Every record as it would be written, exceptions and stacks included."""
    fmt = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    return "\n".join(fmt.format(r) for r in caplog.records)


def tls_pair(tmp_path: Path) -> tuple[Path, Path, bytes]:
    cert, key = selfsigned.generate("no secrets", ["127.0.0.1"])
    (tmp_path / KEY_DIR).mkdir()
    cert_path, key_path = tmp_path / "broker.crt", tmp_path / KEY_DIR / "broker.key"
    cert_path.write_bytes(cert)
    key_path.write_bytes(key)
    return cert_path, key_path, key


async def cluster(tmp_path: Path, **keys: str) -> tuple[NameServer, BrokerController]:
    """A name server and a broker in process, both with the broker's keys (TLS on both ports)."""
    from chronomq.remoting.tls import ServerTls

    clock = SystemClock()
    ns_port = free_port()
    values = {"storePathRootDir": str(tmp_path / "store"), "listenPort": str(free_port()),
              "haListenPort": str(free_port()), "namesrvAddr": f"127.0.0.1:{ns_port}",
              "metricsPort": str(free_port()),
              "grpcListenPort": "-1",
              "initAuthenticationUser": f'{{"username": "root", "password": "{SECRET_INIT}"}}',
              "innerClientAuthenticationCredentials":
                  f'{{"accessKey": "inner", "secretKey": "{SECRET_INNER}"}}', **keys}
    config, _ = BrokerConfig.load(None, values)
    ns = NameServer("127.0.0.1", ns_port, clock, tls=ServerTls.from_config(config, "namesrv"))
    await ns.start()
    broker = BrokerController(config, clock, local_register=ns.routes.register_broker)
    await broker.start()
    return ns, broker


async def broker_config(admin: Admin, addr: str) -> str:
    inst = admin._instance
    resp = await inst.invoke_ok(addr, inst.request(RequestCode.GET_BROKER_CONFIG), what="broker config")
    return resp.body.decode()


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as resp:
        return resp.read().decode()


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("ACL: refused")]


async def test_acl_1_requests_config_and_metrics_hold_no_secret(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    (tmp_path / "plain_acl.yml").write_text(ACL_FILE)
    cert_path, key_path, key_pem = tls_pair(tmp_path)
    ns, broker = await cluster(tmp_path, aclEnable="true", aclFile=str(tmp_path / "plain_acl.yml"),
                               tlsCertPath=str(cert_path), tlsKeyPath=str(key_path))
    ops = ("opsAccess", SECRET_ACL)
    try:
        async with Admin(ns.address, credentials=ops) as admin:
            for topic in ("Open", "Locked"):
                await admin.create_topic(topic, 1)  # accepted, an admin request
            config = await broker_config(admin, broker.broker_addr)
        async with Producer("PG_ok", ns.address, credentials=ops, retries=0, tls=True) as p:
            assert (await p.send(Message("Open", b"accepted"))).status == "SEND_OK"  # over TLS too
            with pytest.raises(NotPermitted, match="No default permission for topic:Locked"):
                await p.send(Message("Locked", b"refused: no PUB"))
        async with Producer("PG_bad", ns.address, credentials=("opsAccess", "wrong-" + SECRET_ACL),
                            retries=0) as p:
            with pytest.raises(NotPermitted, match="Check signature failed for accessKey=opsAccess"):
                await p.send(Message("Open", b"refused: the signature"))
        async with Producer("PG_none", ns.address, retries=0) as p:
            with pytest.raises(NotPermitted, match="No accessKey is configured"):
                await p.send(Message("Open", b"refused: no credentials"))
        assert broker.metrics is not None
        metrics = await asyncio.to_thread(fetch, f"http://127.0.0.1:{broker.metrics.port}/metrics")
    finally:
        await broker.shutdown()
        await ns.stop()

    # the broker configuration: set secrets masked, the certificate (not secret) shown
    for key in ("initAuthenticationUser", "innerClientAuthenticationCredentials", "tlsKeyPath"):
        assert f"\n{key}=***\n" in config, key
    assert f"\ntlsCertPath={cert_path}\n" in config and "\ntlsClientKeyPath=\n" in config
    assert secrets_in(config, key_pem) == []
    assert "rocketmq_producer_offset" in metrics and secrets_in(metrics, key_pem) == []
    # who and what of each refusal: the access key, the address, the request's topic and group
    lines = refusals(caplog)  # the three sends, and the unregisters of the two refused producers
    assert all(re.search(r" from 127\.0\.0\.1:\d+ \(AccessKey (opsAccess|-)\): ", line)
               for line in lines), lines
    locked = next(line for line in lines if "No default permission" in line)
    assert re.search(r"request code \d+ \(topic:Locked Pub\) from 127\.0\.0\.1:\d+ \(AccessKey opsAccess\)",
                     locked), locked
    assert any("(AccessKey -)" in line and "topic:Open Pub" in line for line in lines)
    assert any("(AccessKey opsAccess)" in line and "Check signature failed" in line for line in lines)
    assert secrets_in(logged(caplog), key_pem) == []
    account = broker_account_repr(tmp_path / "plain_acl.yml")
    assert "opsAccess" in account and SECRET_ACL not in account


def broker_account_repr(path: Path) -> str:
    from chronomq.acl import AclValidator

    return repr(AclValidator(path, SystemClock().now_ms).acl)


async def test_acl_2_users_requests_and_admin_output_hold_no_secret(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    from chronomq.cli.admin import add_admin_parsers, run_admin

    caplog.set_level(logging.DEBUG)
    ns, broker = await cluster(tmp_path, authenticationEnabled="true", authorizationEnabled="true")
    root = ("root", SECRET_INIT)

    def cli(*argv: str) -> int:
        p = argparse.ArgumentParser()
        add_admin_parsers(p)
        return run_admin(p.parse_args([*argv, "-n", ns.address, "--access-key", root[0],
                                       "--secret-key", root[1]]))

    try:
        async with Admin(ns.address, credentials=root) as admin:
            addr = broker.broker_addr
            await admin.create_topic("Open", 1)
            await admin.create_user(addr, "alice", SECRET_USER)
            await admin.create_acl(addr, "User:alice", ["Topic:Open"], ["Pub"])
            config = await broker_config(admin, addr)
            assert (await admin.get_user(addr, "alice"))["username"] == "alice"
        capsys.readouterr()
        assert await asyncio.to_thread(cli, "user", "get", "-u", "alice") == 0
        assert await asyncio.to_thread(cli, "user", "list") == 0
        assert await asyncio.to_thread(cli, "acl", "list") == 0
        out = capsys.readouterr().out
        assert "alice" in out and "root" in out and "Topic:Open" in out
        async with Producer("PG_alice", ns.address, credentials=("alice", SECRET_USER), retries=0) as p:
            assert (await p.send(Message("Open", b"accepted"))).status == "SEND_OK"
            with pytest.raises(NotPermitted, match=r"User:alice has no permission to access Topic:Other"):
                await p.send(Message("Other", b"refused"))
        wrong = ("alice", "wrong-" + SECRET_USER)
        async with Producer("PG_x", ns.address, credentials=wrong, retries=0) as p:
            with pytest.raises(NotPermitted, match="check signature failed for User:alice"):
                await p.send(Message("Open", b"refused"))
    finally:
        await broker.shutdown()
        await ns.stop()
    assert "\ninitAuthenticationUser=***\n" in config
    assert secrets_in(config, b"") == [] and secrets_in(out, b"") == []
    lines = refusals(caplog)
    assert any("(topic:Other Pub)" in line and "(AccessKey alice)" in line and "127.0.0.1:" in line
               for line in lines), lines
    assert secrets_in(logged(caplog), b"") == []
    from chronomq.acl.auth2 import User

    assert SECRET_USER not in repr(User("alice", SECRET_USER))


def test_5x_refusals_and_passes_log_no_secret(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("grpc", reason="grpcio and protobuf (chronomq dependencies) are not installed")
    import time

    from chronomq.acl.validator import AclValidator
    from chronomq.grpc._proto import rocketmq_v2_pb2 as pb
    from chronomq.grpc.auth import Guard, sign

    caplog.set_level(logging.DEBUG)
    (tmp_path / "plain_acl.yml").write_text(ACL_FILE)
    clock = SystemClock()
    guard = Guard(AclValidator(tmp_path / "plain_acl.yml", clock.now_ms), clock.now_ms)

    def md(secret: str) -> dict[str, str]:
        dt = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        return {"x-mq-date-time": dt, "authorization": "MQv2-HMAC-SHA1 Credential=opsAccess, "
                "SignedHeaders=x-mq-date-time, Signature=" + sign(secret, dt)}

    def send(topic: str) -> Any:
        return pb.SendMessageRequest(messages=[pb.Message(topic=pb.Resource(name=topic), body=b"x")])

    peer = "127.0.0.1:50505"
    assert guard.refusal("SendMessage", send("Open"), md(SECRET_ACL), "127.0.0.1", peer) is None
    assert "Locked" in (guard.refusal("SendMessage", send("Locked"), md(SECRET_ACL), "127.0.0.1", peer) or "")
    assert guard.refusal("SendMessage", send("Open"), md("wrong-" + SECRET_ACL), "127.0.0.1", peer)
    lines = refusals(caplog)
    assert len(lines) == 2 and all("SendMessage" in s and "AccessKey opsAccess" in s and peer in s
                                   for s in lines), lines
    assert secrets_in(logged(caplog), b"") == []


async def test_the_console_pages_and_logs_hold_no_secret(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("starlette", reason="the web extra is not installed")
    from tests.web.conftest import Browser

    from chronomq.web import ConsoleConfig, ConsoleServer
    from chronomq.web.auth import hash_password

    caplog.set_level(logging.DEBUG)
    (tmp_path / "plain_acl.yml").write_text(ACL_FILE)
    (tmp_path / "users.yml").write_text(f'users:\n  - name: viewer\n    password_hash: '
                                        f'"{hash_password(SECRET_CONSOLE)}"\n')
    ns, broker = await cluster(tmp_path, aclEnable="true", aclFile=str(tmp_path / "plain_acl.yml"))
    ops = ("opsAccess", SECRET_ACL)
    cfg = ConsoleConfig(namesrv=ns.address, port=free_port(), users_file=str(tmp_path / "users.yml"),
                        access_key=ops[0], secret_key=ops[1])
    assert SECRET_ACL not in repr(cfg)
    console = ConsoleServer(cfg)
    wrong = ConsoleServer(ConsoleConfig(namesrv=ns.address, port=free_port(), access_key=ops[0],
                                        secret_key="wrong-" + SECRET_ACL))
    pages: list[str] = []
    try:
        async with Producer("PG_console", ns.address, credentials=ops) as p:
            await p.send(Message("Open", b"for the console", keys=["k1"]))
        await console.start()
        await wrong.start()

        def browse() -> None:
            b = Browser(console.url)
            status, _, html = b.get("/login")
            bad = b.post("/login", {"csrf": Browser.csrf(html), "username": "viewer",
                                    "password": "wrong-" + SECRET_CONSOLE, "next": "/"})
            assert bad[0] == 401
            pages.append(bad[2])
            ok = b.post("/login", {"csrf": Browser.csrf(bad[2]), "username": "viewer",
                                   "password": SECRET_CONSOLE, "next": "/"})
            assert ok[0] == 303, ok
            for path in ("/", "/topics", "/topics/Open", "/groups", "/delayed", "/dlq",
                         "/messages?key=k1&topic=Open"):
                status, _, html = b.get(path)
                assert status == 200, (path, html)
                pages.append(html)
            for path in ("/", "/topics"):  # the cluster refuses the console's signature: said on the page
                status, _, html = Browser(wrong.url).get(path)
                assert "Check signature failed for accessKey=opsAccess" in html, html
                pages.append(html)

        await asyncio.to_thread(browse)
    finally:
        await wrong.stop()
        await console.stop()
        await broker.shutdown()
        await ns.stop()
    assert "broker-a" in pages[1] and "Open" in pages[2]
    for html in pages:
        assert secrets_in(html, b"") == []
    text = logged(caplog)
    assert "failed login for 'viewer'" in text  # who, never the password tried
    assert secrets_in(text, b"") == []


def test_the_spark_sources_settings_show_no_secret_key() -> None:
    pytest.importorskip("pyarrow", reason="pyarrow (the spark extra) is not installed")
    from chronomq.spark import options as o
    from chronomq.spark.io import ReadSettings

    creds = {"namesrv": "127.0.0.1:9876", "accessKey": "opsAccess", "secretKey": SECRET_ACL}
    read = o.parse_read_options({**creds, "subscribe": "T"}, streaming=False)
    shown = [read, o.parse_write_options(creds), ReadSettings.of(read, [1000]),
             o.parse_pending_options({**creds, "mode": "pending"}, streaming=False)]
    assert read.credentials == ("opsAccess", SECRET_ACL)  # kept for the clients, never shown: Spark's
    for settings in shown:  # InputPartition repr prints a partition's settings
        assert SECRET_ACL not in repr(settings)
