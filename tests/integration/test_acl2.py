"""ACL 2.0 end to end on the 4.x port: users and ACLs made through the admin codes (chronomq's Admin and
``chronomq admin user|acl``), a policy table checked with chronomq's clients (the refusal's text asserted),
and the users and ACLs still in force after the broker restarts on the same store."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import pytest

from chronomq.broker.controller import BrokerController
from chronomq.cli.admin import add_admin_parsers, run_admin
from chronomq.client import Admin, Message, NotPermitted, Producer, SimpleConsumer
from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig, ConfigError
from chronomq.namesrv.server import NameServer
from tests.conftest import free_port

ROOT = ("root", "root-secret")


def _broker(tmp_path: Path, ns: NameServer, clock: VirtualClock, port: int, **keys: str) -> BrokerController:
    values = {"storePathRootDir": str(tmp_path), "listenPort": str(port), "haListenPort": str(free_port()),
              "namesrvAddr": ns.address, "metricsPort": "-1", "authenticationEnabled": "true",
              "authorizationEnabled": "true",
              "initAuthenticationUser": '{"username": "root", "password": "root-secret"}', **keys}
    config, _ = BrokerConfig.load(None, values)
    return BrokerController(config, clock, local_register=ns.routes.register_broker)


def _cli(ns: NameServer, *argv: str) -> int:
    p = argparse.ArgumentParser()
    add_admin_parsers(p)
    args = p.parse_args([argv[0], *argv[1:], "-n", ns.address, "--access-key", ROOT[0],
                         "--secret-key", ROOT[1]])
    return run_admin(args)


async def test_users_and_acls_through_the_admin_codes_decide_what_clients_may_do(tmp_path: Path, caplog,
                                                                                  capsys):
    clock = VirtualClock()
    ns = NameServer("127.0.0.1", free_port(), clock)
    port = free_port()
    await ns.start()
    b = _broker(tmp_path, ns, clock, port)
    await b.start()
    try:
        async with Admin(ns.address, credentials=ROOT, clock=clock) as admin:
            addr = b.server.address if isinstance(b.server.address, str) else f"127.0.0.1:{port}"
            for t in ("orders-1", "orders-secret", "audit"):
                await admin.create_topic(t, 1)  # root is the Super user initAuthenticationUser made
            await admin.create_user(addr, "alice", "alice-pw")
            await admin.create_acl(addr, "User:alice", ["Topic:orders-*"], ["Pub"])
            await admin.create_acl(addr, "User:alice", ["Topic:orders-secret"], ["Pub"], decision="Deny")
            assert (await admin.get_user(addr, "alice"))["userType"] == "Normal"
            # the CLI: bob may publish to audit, but only from 10.0.0.0/8
            assert await asyncio.to_thread(_cli, ns, "user", "create", "-u", "bob", "-p", "bob-pw") == 0
            assert await asyncio.to_thread(_cli, ns, "acl", "create", "-s", "User:bob", "-r", "Topic:audit",
                                           "-a", "Pub", "-i", "10.0.0.0/8") == 0
            assert await asyncio.to_thread(_cli, ns, "user", "list") == 0
            assert await asyncio.to_thread(_cli, ns, "acl", "list") == 0
            out = capsys.readouterr().out
            assert "bob" in out and "bob-pw" not in out and "10.0.0.0/8" in out and "Topic:orders-*" in out
            # a Normal user may not make users
            async with Admin(ns.address, credentials=("alice", "alice-pw"), clock=clock) as alice_admin:
                with pytest.raises(NotPermitted, match=r"User:alice has no permission to access "
                                   r"Cluster:DefaultCluster \(Update\)"):
                    await alice_admin.create_user(addr, "mallory", "x1234567", "Super")

        alice = ("alice", "alice-pw")
        async with Producer("PG_a", ns.address, credentials=alice, retries=0, clock=clock) as p:
            assert (await p.send(Message("orders-1", b"allowed"))).status == "SEND_OK"
            with caplog.at_level(logging.WARNING, logger="chronomq.acl"), pytest.raises(NotPermitted) as e:
                await p.send(Message("orders-secret", b"denied"))
            assert ("User:alice has no permission to access Topic:orders-secret (Pub) from 127.0.0.1, "
                    "the decision is deny") in str(e.value)
            assert "alice" in caplog.text and "alice-pw" not in caplog.text  # who and what, never a secret
            with pytest.raises(NotPermitted, match=r"Topic:audit \(Pub\) from 127\.0\.0\.1, no matched"):
                await p.send(Message("audit", b"not listed"))
        async with SimpleConsumer("g1", ns.address, credentials=alice) as c:
            q = (await c.queues("orders-1"))[0]
            with pytest.raises(NotPermitted, match=r"Topic:orders-1 \(Sub\) from 127.0.0.1, no matched"):
                await c.pull(q, 0)
        async with Producer("PG_b", ns.address, credentials=("bob", "bob-pw"), retries=0, clock=clock) as p:
            with pytest.raises(NotPermitted, match=r"Topic:audit \(Pub\) from 127\.0\.0\.1, no matched"):
                await p.send(Message("audit", b"from the wrong network"))
        async with Producer("PG_x", ns.address, credentials=("alice", "wrong-pw"), retries=0,
                            clock=clock) as p:
            with pytest.raises(NotPermitted, match="check signature failed for User:alice"):
                await p.send(Message("orders-1", b"x"))
        async with Producer("PG_r", ns.address, credentials=ROOT, retries=0, clock=clock) as p:
            assert (await p.send(Message("orders-secret", b"Super passes"))).status == "SEND_OK"
    finally:
        await b.shutdown()

    # a restart on the same store: the users and ACLs are read again
    alice = ("alice", "alice-pw")
    b = _broker(tmp_path, ns, clock, port)
    await b.start()
    try:
        async with Producer("PG_a", ns.address, credentials=alice, retries=0, clock=clock) as p:
            assert (await p.send(Message("orders-1", b"after restart"))).status == "SEND_OK"
            with pytest.raises(NotPermitted, match="the decision is deny"):
                await p.send(Message("orders-secret", b"still denied"))
        assert await asyncio.to_thread(_cli, ns, "acl", "delete", "-s", "User:alice",
                                       "-r", "Topic:orders-secret") == 0
        assert await asyncio.to_thread(_cli, ns, "user", "delete", "-u", "bob") == 0
        assert b.processor.auth.auth_store.users.keys() == {"root", "alice"}
        async with Producer("PG_a", ns.address, credentials=alice, retries=0, clock=clock) as p:
            assert (await p.send(Message("orders-secret", b"now allowed"))).status == "SEND_OK"
    finally:
        await b.shutdown()
        await ns.stop()


async def test_only_a_super_user_makes_a_super_user(tmp_path: Path):
    """With authentication alone every signed user may call the admin codes (as in RocketMQ), but a Super
    user is made, changed or deleted only by a Super user."""
    clock = VirtualClock()
    ns = NameServer("127.0.0.1", free_port(), clock)
    await ns.start()
    b = _broker(tmp_path, ns, clock, free_port(), authorizationEnabled="false")
    await b.start()
    try:
        addr = b.server.address
        async with Admin(ns.address, credentials=ROOT, clock=clock) as root:
            await root.create_user(addr, "alice", "alice-pw")
            async with Admin(ns.address, credentials=("alice", "alice-pw"), clock=clock) as alice:
                with pytest.raises(NotPermitted, match="The super user can only be create by super user"):
                    await alice.create_user(addr, "mallory", "mallory-pw", "Super")
                with pytest.raises(NotPermitted, match="The super user can only be update by super user"):
                    await alice.delete_user(addr, "root")
                await alice.create_user(addr, "carol", "carol-pw")  # a Normal user: allowed
            await root.create_user(addr, "admin2", "admin2-pw", "Super")
            assert {u["username"]: u["userType"] for u in await root.list_users(addr)} == {
                "root": "Super", "alice": "Normal", "carol": "Normal", "admin2": "Super"}
            with pytest.raises(NotPermitted, match="The user is existed"):
                await root.create_user(addr, "alice", "again")
    finally:
        await b.shutdown()
        await ns.stop()


def test_a_bad_init_user_stops_the_broker(tmp_path: Path):
    ns = NameServer("127.0.0.1", free_port(), VirtualClock())
    with pytest.raises(ConfigError, match="initAuthenticationUser: expected JSON with 'username'"):
        _broker(tmp_path, ns, VirtualClock(), free_port(), initAuthenticationUser="root:secret")
