"""ACL with the official 4.x client (rocketmq==0.4.4, set_session_credentials): `chronomq start` with
aclEnable accepts its signed requests with the right keys and refuses a wrong secret, a topic without
permission, and a client without credentials."""

from __future__ import annotations

import base64
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.compat.harness import run_driver

pytestmark = [pytest.mark.compat, pytest.mark.timeout(240)]

ACL = """
accounts:
  - accessKey: RocketMQ
    secretKey: 12345678
    admin: false
    defaultTopicPerm: DENY
    defaultGroupPerm: SUB
    topicPerms:
      - AclTopic=PUB|SUB
      - TBW102=PUB|SUB
"""


def produce(ns: str, topic: str, creds: list[str] | None, count: int = 5) -> dict[str, Any]:
    args: dict[str, Any] = {"namesrv": ns, "group": f"PG_{uuid.uuid4().hex[:8]}", "mode": "sync",
                            "generate": {"topic": topic, "count": count, "prefix": "acl"},
                            "timeout_ms": 3000, "deadline_s": 40}
    if creds:
        args["credentials"] = creds
    return run_driver("produce", args, timeout=90)


def test_the_official_client_signs_and_is_checked(chronomq_factory, official_client, tmp_path: Path):
    acl_file = tmp_path / "plain_acl.yml"
    acl_file.write_text(ACL)
    server = chronomq_factory({"aclEnable": "true", "aclFile": str(acl_file)})
    ns = server.namesrv_addr
    right = ["RocketMQ", "12345678", "ALIYUN"]

    ok = produce(ns, "AclTopic", right)
    assert not ok["errors"] and len(ok["results"]) == 5, ok["errors"][:2]
    pull = {"namesrv": ns, "group": f"CG_{uuid.uuid4().hex[:8]}", "topic": "AclTopic", "expect": 5,
            "deadline_s": 40, "credentials": right}
    got = run_driver("pull_consume", pull, timeout=90)
    assert sorted(base64.b64decode(m["body_b64"]) for m in got["messages"]) == \
        sorted(f"acl-{i}".encode() for i in range(5))

    for creds, topic in ((["RocketMQ", "wrong-secret", "ALIYUN"], "AclTopic"), (right, "OtherTopic"),
                         (None, "AclTopic")):
        refused = produce(ns, topic, creds, count=1)
        assert refused["errors"] and not refused["results"], (creds, topic, refused)
    log = server.log_tail(20_000)
    assert "Check signature failed for accessKey=RocketMQ" in log
    assert "No accessKey is configured" in log
    assert "12345678" not in log  # the secret never reaches the log
