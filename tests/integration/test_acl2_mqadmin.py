"""RocketMQ 5.3.3's own mqadmin (createUser, getUser, listUser, createAcl, getAcl, listAcl, deleteAcl,
deleteUser) against a chronomq broker: the user and ACL codes answer in the shapes its tool decodes and
prints. One chronomq and one mqadmin classpath for the module (the fixtures of tests/compat/test_mqadmin.py);
independent commands run side by side."""

from __future__ import annotations

import pytest

from chronomq.client import Admin
from tests.compat.harness import ChronomqProcess
from tests.compat.test_mqadmin import MQAdmin, _ok, mqadmin, server  # noqa: F401 (module fixtures)

pytestmark = pytest.mark.compat


def test_mqadmin_makes_and_reads_users_and_acls(server: ChronomqProcess, mqadmin: MQAdmin) -> None:  # noqa: F811
    b = server.broker_addr
    made = mqadmin.run_all([("createUser", "-b", b, "-u", "alice", "-p", "alice-pw"),
                            ("createUser", "-b", b, "-u", "bob", "-p", "bob-pw")])
    assert all(f"create user to {b} success" in _ok(out) for out in made), made
    acl, user, users = mqadmin.run_all([
        ("createAcl", "-b", b, "-s", "User:alice", "-r", "Topic:orders-*,Group:g1", "-a", "Pub,Sub",
         "-i", "10.0.0.0/8", "-d", "Allow"),
        ("getUser", "-b", b, "-u", "alice"), ("listUser", "-b", b)])
    assert "success" in _ok(acl), acl
    assert ["alice", "alice-pw", "Normal", "enable"] in [line.split() for line in _ok(user).splitlines()]
    names = {line.split()[0] for line in _ok(users).splitlines() if line.split()}
    assert {"alice", "bob"} <= names
    got, listed, deleted = mqadmin.run_all([
        ("getAcl", "-b", b, "-s", "User:alice"), ("listAcl", "-b", b, "-s", "alice"),
        ("deleteUser", "-b", b, "-u", "bob")])
    for out in (got, listed):
        assert "User:alice" in _ok(out) and "Topic:orders-*" in out and "10.0.0.0/8" in out, out
    assert "success" in _ok(deleted), deleted
    gone = mqadmin.run("deleteAcl", "-b", b, "-s", "User:alice", "-r", "Group:g1")
    assert "success" in _ok(gone), gone
    with Admin(server.namesrv_addr) as admin:
        assert [u["username"] for u in admin.list_users(b)] == ["alice"]
        entries = admin.get_acl(b, "User:alice")["policies"][0]["entries"]
        assert [(e["resource"], e["actions"], e["sourceIps"], e["decision"]) for e in entries] == [
            ("Topic:orders-*", ["Pub", "Sub"], ["10.0.0.0/8"], "Allow")]
