"""``chronomq admin`` against a real ``chronomq start`` on 127.0.0.1: the verbs no other test drives
(topics, route, update-topic, broker-status, -b; times as ISO-8601 UTC or --epoch-ms), and -n given a
broker's address instead of the name server's (the client Admin raises NotANameServer; the CLI says what
-n takes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chronomq.client import Admin
from chronomq.client.admin import NotANameServer
from tests.compat.harness import ChronomqProcess
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "chronomq.cli.main", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChronomqProcess]:
    p = ChronomqProcess(tmp_path_factory.mktemp("cli") / "data")
    p.start()
    yield p
    p.stop()


def test_topic_verbs_and_broker_status(server: ChronomqProcess) -> None:
    ns = server.namesrv_addr
    out = _cli("admin", "update-topic", "-n", ns, "CliTopic", "--queues", "3")
    assert out.returncode == 0 and out.stdout.strip() == f"topic CliTopic updated on {server.broker_addr}"
    wait_for(lambda: "CliTopic" in _cli("admin", "topics", "-n", ns).stdout, timeout=30,
             message="CliTopic listed by the name server")
    out = _cli("admin", "route", "-n", ns, "CliTopic")
    assert out.returncode == 0, out.stderr
    route = json.loads(out.stdout)
    assert [q["writeQueueNums"] for q in route["queueDatas"]] == [3]
    assert route["brokerDatas"][0]["brokerAddrs"] == {"0": server.broker_addr}
    out = _cli("admin", "route", "-n", ns, "NoSuchTopic")
    assert out.returncode == 1 and "TOPIC_NOT_EXIST" in out.stderr
    out = _cli("admin", "broker-status", "-n", ns)
    assert out.returncode == 0 and out.stdout.splitlines()[0].startswith("broker broker-a (")
    b = server.broker_addr
    out = _cli("admin", "broker-status", "-b", b)  # no name server involved
    assert out.returncode == 0 and out.stdout.startswith(f"broker {b} ({b})")
    boot = dict(ln.split(maxsplit=1) for ln in out.stdout.splitlines()[1:])["bootTimestamp"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", boot), boot  # ISO-8601 UTC, ms
    out = _cli("admin", "broker-status", "-b", b, "--epoch-ms")
    assert dict(ln.split(maxsplit=1) for ln in out.stdout.splitlines()[1:])["bootTimestamp"].isdigit()
    out = _cli("admin", "delay-stats", "-b", server.broker_addr)
    assert out.returncode == 0 and "since start" in out.stdout and " oldest_deliver " in out.stdout
    out = _cli("admin", "consumer-progress", "-n", ns, "-g", "NoSuchGroup")
    assert out.returncode == 0 and out.stdout.strip() == "no committed offsets for group NoSuchGroup"


def test_consumer_progress_shows_when_the_last_committed_message_was_stored(server: ChronomqProcess) -> None:
    from chronomq.client import Message, Producer

    ns = server.namesrv_addr
    with Admin(ns) as admin:
        admin.create_topic("CliProgress", 1)
    before = int(time.time() * 1000)
    with Producer("cli_progress_p", ns) as p:
        for i in range(2):
            p.send(Message("CliProgress", f"m{i}"))
    after = int(time.time() * 1000)
    with Admin(ns) as admin:  # the offset past both: the last committed message is the second
        assert set(admin.reset_offsets("CliGroup", "CliProgress", after + 3_600_000).values()) == {2}
    out = _cli("admin", "consumer-progress", "-n", ns, "-g", "CliGroup")
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[0].split(), out.stdout.splitlines()[-1].split()
    assert header == ["broker", "topic", "queue", "max", "committed", "lag", "last_consumed", "online"]
    assert row[:6] == ["broker-a", "CliProgress", "0", "2", "2", "0"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", row[6]), row
    out = _cli("admin", "consumer-progress", "-n", ns, "-g", "CliGroup", "--epoch-ms")
    header, row = out.stdout.splitlines()[0].split(), out.stdout.splitlines()[-1].split()
    assert header[6] == "last_consumed_ms" and before <= int(row[6]) <= after


@pytest.mark.parametrize("verb", [["cluster"], ["topics"], ["route", "T"], ["delay-stats"], ["pending"],
                                  ["cancel", "some-id"]])
def test_a_broker_address_given_as_name_server_is_named(server: ChronomqProcess, verb: list[str]) -> None:
    out = _cli("admin", *verb, "-n", server.broker_addr)
    assert out.returncode == 1
    assert f"{server.broker_addr} is a broker, not a name server" in out.stderr, out.stderr
    assert "-n takes the name server's address" in out.stderr and "not supported" not in out.stderr
    assert ("-b " in out.stderr) == (verb[0] not in ("cluster", "topics", "route"))


def test_client_admin_raises_not_a_name_server(server: ChronomqProcess) -> None:
    with Admin(server.broker_addr) as admin:
        for call in (admin.brokers, admin.list_topics, admin.delay_stats):
            with pytest.raises(NotANameServer) as ei:
                call()
            assert ei.value.addr == server.broker_addr
    with Admin(server.namesrv_addr) as admin:
        assert admin.masters() == [("broker-a", server.broker_addr)]
        assert admin.cluster() == {"DefaultCluster": {"broker-a": {0: server.broker_addr}}}


def test_admin_verbs_carry_acl_credentials(tmp_path: Path) -> None:
    acl = tmp_path / "plain_acl.yml"
    acl.write_text("accounts:\n  - accessKey: admin-key\n    secretKey: admin-secret\n    admin: true\n")
    with ChronomqProcess(tmp_path / "data", {"aclEnable": "true", "aclFile": str(acl)}) as p:
        ns = p.namesrv_addr
        out = _cli("admin", "update-topic", "-n", ns, "AclCli", "--queues", "2")
        assert out.returncode == 1 and "No accessKey is configured" in out.stderr
        out = _cli("admin", "update-topic", "-n", ns, "AclCli", "--access-key", "admin-key",
                   "--secret-key", "wrong-secret")
        assert out.returncode == 1 and "Check signature failed" in out.stderr
        env = {"CHRONOMQ_ACCESS_KEY": "admin-key", "CHRONOMQ_SECRET_KEY": "admin-secret"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            out = _cli("admin", "update-topic", "-n", ns, "AclCli", "--queues", "2")
            assert out.returncode == 0, out.stderr
            out = _cli("admin", "broker-status", "-n", ns)
            assert out.returncode == 0 and "brokerRole" in out.stdout
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        out = _cli("admin", "topics", "-n", ns, "--access-key", "admin-key")
        assert out.returncode == 1 and "secret key" in out.stderr
        assert "admin-secret" not in p.log_tail(20_000)
