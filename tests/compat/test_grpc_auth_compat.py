"""Credentials on the 5.x endpoint with the official Python 5.x client (rocketmq-python-client), unchanged:
with aclEnable, the right access key and secret are served (route, send, heartbeat, assignment-free
receive and ack over plaintext and TLS), a wrong secret and no credentials are refused on every RPC the
client makes; then, with tlsServerMode=enforcing, TLS is served and plaintext refused. One broker for the
module (restarted once to change the TLS mode)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.compat.harness import ChronomqProcess, CompatUnavailable, free_port, grpc5_python, run_driver
from tests.compat.observe import b64
from tests.compat.test_grpc_compat import create_topic

pytestmark = pytest.mark.compat

TOPIC, GROUP = "AuthTopic", "AuthGroup"
ACL = f"""
accounts:
  - accessKey: grpcUser01
    secretKey: grpcSecret01
    defaultTopicPerm: DENY
    defaultGroupPerm: DENY
    topicPerms:
      - {TOPIC}=PUB|SUB
    groupPerms:
      - {GROUP}=SUB
"""
RIGHT = {"access_key": "grpcUser01", "secret_key": "grpcSecret01"}
STEPS = ("producer_start", "send", "consumer_start", "receive", "ack")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChronomqProcess]:
    grpc5_python()
    tmp = tmp_path_factory.mktemp("grpc_auth")
    (tmp / "acl.yml").write_text(ACL)
    port = free_port()
    p = ChronomqProcess(tmp / "data", {"grpcListenPort": str(port), "minInvisibleTimeMillsForRecv": "1000"})
    p.start()
    try:
        create_topic(p, TOPIC)  # before the ACL is on: the topic is made with an unsigned admin request
        p.stop(timeout=30)
        p.overrides.update({"aclEnable": "true", "aclFile": str(tmp / "acl.yml")})
        p.start()
        p.grpc_endpoint = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
        yield p
    finally:
        p.stop(timeout=30)


def probe(server: ChronomqProcess, **args: Any) -> dict[str, str]:
    endpoint = server.grpc_endpoint  # type: ignore[attr-defined]
    t0 = time.monotonic()
    out = run_driver("v5_client", {"endpoint": endpoint, "mode": "auth", "topic": TOPIC, "group": GROUP,
                                   **args}, timeout=120)
    # each step's time, the receives it took and the driver's whole run, shown when a test fails
    print(f"probe ({time.monotonic() - t0:.1f} s in all):", out)
    return out["steps"]


def refused_rpcs(server: ChronomqProcess, start: int) -> set[str]:
    # "ACL: refused QueryRoute (topic:AuthTopic Pub|Sub) from ...": the RPC, what it asked for, who
    return set(re.findall(r"ACL: refused (\w+) \([^)]*\) from", server.log_tail(1_000_000)[start:]))


def test_right_credentials_are_served_wrong_and_none_refused_on_every_rpc(server: ChronomqProcess) -> None:
    mark = len(server.log_tail(1_000_000))
    steps = probe(server, **RIGHT)
    assert steps == dict.fromkeys(STEPS, "ok")
    assert refused_rpcs(server, mark) == set()  # nor its heartbeats, settings, ...
    for creds in ({"access_key": "grpcUser01", "secret_key": "not-the-secret"}, {}):
        mark = len(server.log_tail(1_000_000))
        steps = probe(server, **creds, deadline_s=3)
        # the client asks for the route first and stops there: nothing else reaches the endpoint
        assert "route" in steps["send"] and "route" in steps["receive"] and steps["ack"] == "skipped", steps
        assert refused_rpcs(server, mark) == {"QueryRoute"}
        log = server.log_tail(1_000_000)[mark:]
        assert "grpcSecret01" not in log and "not-the-secret" not in log


def test_tls_with_credentials_in_permissive_then_enforcing_refuses_plaintext(server: ChronomqProcess) -> None:
    ca = str(Path(server.data_dir) / "tls" / "selfsigned.crt")
    assert probe(server, **RIGHT, tls=True, ca_file=ca) == dict.fromkeys(STEPS, "ok")
    server.stop(timeout=30)
    server.overrides["tlsServerMode"] = "enforcing"
    server.start()
    assert probe(server, **RIGHT, tls=True, ca_file=ca) == dict.fromkeys(STEPS, "ok")
    steps = probe(server, **RIGHT, deadline_s=3)
    assert steps["send"] != "ok" and steps["receive"] != "ok", steps


def test_java_client_with_right_wrong_and_no_credentials(server: ChronomqProcess) -> None:
    """The Java 5.x client over TLS (its default; the broker is in enforcing mode when the test above ran
    first): sends and receives with the right key, and cannot start with a wrong one or none."""
    from tests.compat.jvm import java_driver

    try:
        java_driver("java5")
    except CompatUnavailable as e:
        pytest.skip(str(e))
    ep = server.grpc_endpoint  # type: ignore[attr-defined]
    right = {"accessKey": RIGHT["access_key"], "secretKey": RIGHT["secret_key"]}
    mark = len(server.log_tail(1_000_000))
    sent = run_driver("java5:produce", {"endpoint": ep, "topics": [TOPIC], **right, "messages": [
        {"topic": TOPIC, "body": b64(f"j{i}"), "keys": [f"J{i}"]} for i in range(2)]}, timeout=120)
    assert [r["ok"] for r in sent["results"]] == [True, True], sent
    got = run_driver("java5:simple_consume", {"endpoint": ep, "group": GROUP, "topic": TOPIC, **right,
                                              "expect": 2, "maxSeconds": 30}, timeout=120)
    assert got["acked"] >= 2, got
    assert refused_rpcs(server, mark) == set()
    for creds in ({"accessKey": RIGHT["access_key"], "secretKey": "not-the-secret"}, {}):
        mark = len(server.log_tail(1_000_000))
        sent = run_driver("java5:produce", {"endpoint": ep, "topics": [TOPIC], **creds, "messages": [
            {"topic": TOPIC, "body": b64("x"), "keys": ["X"]}]}, timeout=120)
        assert sent["startError"]["code"] == 40100 and sent["results"] == [], sent  # UnauthorizedException
        got = run_driver("java5:simple_consume", {"endpoint": ep, "group": GROUP, "topic": TOPIC, **creds,
                                                  "expect": 1, "maxSeconds": 5}, timeout=120)
        assert got["startError"]["code"] == 40100 and got["records"] == [], got
        assert "QueryRoute" in refused_rpcs(server, mark)
