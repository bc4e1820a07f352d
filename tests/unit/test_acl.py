"""ACL 1.0: the signature, the accounts file, the resources a request touches, and a broker with aclEnable
(and its embedded name server's check) refusing or accepting chronomq.client's requests."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tests.conftest import free_port
from tests.integration.rawclient import AsyncRawClient, send_ext

from chronomq.acl import AclConfigError, AclError, AclValidator, parse, refusal, resources
from chronomq.acl.plain import DENY, PUB, SUB, AddressRule
from chronomq.broker.controller import BrokerController
from chronomq.client import Admin, Message, NotPermitted, Producer
from chronomq.clock import VirtualClock
from chronomq.config import BrokerConfig, ConfigError
from chronomq.namesrv.server import NameServer
from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode as R
from chronomq.remoting.codes import ResponseCode as C
from chronomq.remoting.signing import sign, signature

ACL = """
globalWhiteRemoteAddresses:
  - 10.10.103.*
accounts:
  - accessKey: RocketMQ
    secretKey: 12345678
    whiteRemoteAddress:
    admin: false
    defaultTopicPerm: DENY
    defaultGroupPerm: SUB
    topicPerms:
      - TopicA=PUB|SUB
      - TopicS=SUB
    groupPerms:
      - GroupX=DENY
  - accessKey: rocketmq2
    secretKey: 12345678
    admin: true
"""


def test_the_signature_is_hmac_sha1_over_sorted_values_and_the_body():
    # values in key order, keys not signed, Signature itself excluded, body appended
    ext = {"topic": "TopicTest", "AccessKey": "RocketMQ", "OnsChannel": "LOCAL", "Signature": "x"}
    assert signature(ext, b"", "12345678") == "ZzFK3VPxyYTbh5AunI3Vp3USODc="
    assert signature(ext, b"body", "12345678") != signature(ext, b"", "12345678")
    req = RemotingCommand.request(R.GET_ROUTEINFO_BY_TOPIC, {"topic": "T", "n": 1})
    cmd = sign(req, "ak_12345", "sk_12345")
    assert cmd.ext_fields["AccessKey"] == "ak_12345"
    assert cmd.ext_fields["Signature"] == signature({"topic": "T", "n": "1", "AccessKey": "ak_12345"}, b"",
                                                    "sk_12345")


def test_the_accounts_file_and_its_rules():
    import yaml

    acl = parse(yaml.safe_load(ACL))
    a = acl.accounts["RocketMQ"]
    assert a.perms == {"TopicA": PUB | SUB, "TopicS": SUB, "%RETRY%GroupX": DENY}
    assert (a.default_topic_perm, a.default_group_perm, a.admin) == (DENY, SUB, False)
    assert acl.accounts["rocketmq2"].admin and acl.accounts["rocketmq2"].default_topic_perm == DENY
    assert acl.global_white[0].match("10.10.103.7") and not acl.global_white[0].match("10.10.104.7")
    assert AddressRule("192.168.1.1-100").match("192.168.1.50")
    assert not AddressRule("192.168.1.1-100").match("192.168.1.150")
    pair = AddressRule("192.168.1.{1,2}")
    assert pair.match("192.168.1.2") and not pair.match("192.168.1.3")
    assert AddressRule("127.0.0.1,127.0.0.2").match("127.0.0.2") and AddressRule("*").match("1.2.3.4")
    assert not AddressRule(None).match("127.0.0.1")
    for bad in ({"accounts": [{"accessKey": "short", "secretKey": "12345678"}]},
                {"accounts": [{"accessKey": "RocketMQ", "secretKey": "12345678", "topicPerms": ["nope"]}]},
                {"globalWhiteRemoteAddresses": ["not-an-address"]}, ["a list"]):
        with pytest.raises(AclConfigError):
            parse(bad)


def test_what_each_request_touches():
    assert resources(R.SEND_MESSAGE, {"topic": "T"}, None) == {"T": PUB}
    assert resources(R.SEND_MESSAGE_V2, {"b": "%RETRY%G", "a": "G"}, None) == {"%RETRY%G": PUB | SUB}
    pull = {"topic": "T", "consumerGroup": "G"}
    assert resources(R.PULL_MESSAGE, pull, None) == {"T": SUB, "%RETRY%G": SUB}
    hb = b'{"consumerDataSet":[{"groupName":"G","subscriptionDataSet":[{"topic":"T"}]}]}'
    assert resources(R.HEART_BEAT, {}, hb) == {"%RETRY%G": SUB, "T": SUB}
    assert resources(R.GET_ROUTEINFO_BY_TOPIC, {"topic": "T"}, None) == {}


def test_a_reply_needs_pub_on_its_topic_like_a_send(tmp_path: Path):
    (tmp_path / "acl.yml").write_text(ACL)
    v = AclValidator(tmp_path / "acl.yml", VirtualClock().now_ms)
    for code, field in ((R.SEND_REPLY_MESSAGE, "topic"), (R.SEND_REPLY_MESSAGE_V2, "b")):
        for topic, allowed in (("TopicS", False), ("TopicA", True)):  # TopicS: SUB only
            req = sign(RemotingCommand.request(code, {field: topic, "a": "PG"}, b"reply"), "RocketMQ",
                       "12345678")
            answer = refusal(v, req, "192.168.0.1:5000")
            if allowed:
                assert answer is None
            else:
                assert answer is not None and answer.code == C.NO_PERMISSION
                assert "No default permission for topic:TopicS" in answer.remark


@pytest.fixture
async def acl_broker(tmp_path: Path):
    acl_file = tmp_path / "conf" / "plain_acl.yml"
    acl_file.parent.mkdir(parents=True)
    acl_file.write_text(ACL)
    clock = VirtualClock()
    ns = NameServer("127.0.0.1", free_port(), clock)
    values = {"storePathRootDir": str(tmp_path), "listenPort": str(free_port()),
              "haListenPort": str(free_port()), "namesrvAddr": ns.address, "aclEnable": "true",
              "metricsPort": "-1"}
    config, _ = BrokerConfig.load(None, values)
    b = BrokerController(config, clock, local_register=ns.routes.register_broker)
    acl = b.processor.acl
    assert acl is not None and acl.path == acl_file  # the default: conf/plain_acl.yml of the data dir
    ns.request_check = lambda req, addr: refusal(acl, req, addr)
    await ns.start()
    await b.start()
    try:
        yield b, ns, clock, acl_file
    finally:
        await b.shutdown()
        await ns.stop()


async def test_a_broker_with_acl_checks_every_request(acl_broker, caplog):
    b, ns, clock, acl_file = acl_broker
    good = ("RocketMQ", "12345678")
    admin_creds = ("rocketmq2", "12345678")
    async with Admin(ns.address, credentials=admin_creds, clock=clock) as admin:
        await admin.create_topic("TopicA", 2)  # an admin code: needs admin: true
        await admin.create_topic("TopicB", 2)
    async with Producer("PG_acl", ns.address, credentials=good, retries=0, clock=clock) as p:
        r = await p.send(Message("TopicA", b"allowed"))
        assert r.status == "SEND_OK"
        with caplog.at_level(logging.WARNING, logger="chronomq.acl"), pytest.raises(NotPermitted) as e:
            await p.send(Message("TopicB", b"no permission"))
        assert "No default permission for topic:TopicB" in str(e.value)
        assert "RocketMQ" in caplog.text and "12345678" not in caplog.text  # who, never the secret
    for creds, why in ((("RocketMQ", "wrong-secret"), "Check signature failed"),
                       (("nobody00", "12345678"), "No acl config for nobody00"),
                       (None, "No accessKey is configured")):
        async with Producer("PG_acl2", ns.address, credentials=creds, retries=0, clock=clock) as p:
            with pytest.raises(Exception) as e:  # refused by the name server's check first
                await p.send(Message("TopicA", b"x"))
            assert why in str(e.value)
    async with Admin(ns.address, credentials=good, clock=clock) as admin:
        with pytest.raises(Exception) as e:
            await admin.create_topic("TopicC", 1)
        assert "Need admin permission for request code=17" in str(e.value)

    # a tampered request: signed, then a field changed on the way
    c = await AsyncRawClient.connect(b.server.address)
    try:
        ext = {k: str(v) for k, v in send_ext("TopicA", 0).items()}
        cmd = sign(RemotingCommand.request(R.SEND_MESSAGE, ext, b"body"), *good)
        ok = await c.request(R.SEND_MESSAGE, dict(cmd.ext_fields), b"body")
        assert ok.code == C.SUCCESS
        tampered = await c.request(R.SEND_MESSAGE, {**cmd.ext_fields, "topic": "TopicS"}, b"body")
        assert tampered.code == C.NO_PERMISSION and "Check signature failed" in tampered.remark
        other_body = await c.request(R.SEND_MESSAGE, dict(cmd.ext_fields), b"other")
        assert other_body.code == C.NO_PERMISSION
    finally:
        await c.close()

    # the file changes: read again within 5 s, without a restart
    acl_file.write_text(ACL.replace("TopicS=SUB", "TopicB=PUB"))
    await clock.advance(6000)
    async with Producer("PG_acl", ns.address, credentials=good, clock=clock) as p:
        assert (await p.send(Message("TopicB", b"now allowed"))).status == "SEND_OK"
    # a broken file keeps the rules in force
    acl_file.write_text("accounts: [oops")
    await clock.advance(6000)
    async with Producer("PG_acl", ns.address, credentials=good, clock=clock) as p:
        assert (await p.send(Message("TopicB", b"still allowed"))).status == "SEND_OK"
    assert b.processor.acl.refused >= 6


def test_a_missing_or_broken_accounts_file_stops_the_broker(tmp_path: Path):
    values = {"storePathRootDir": str(tmp_path), "aclEnable": "true"}
    config, _ = BrokerConfig.load(None, values)
    with pytest.raises(ConfigError, match=r"plain_acl\.yml"):
        BrokerController(config, VirtualClock())
    (tmp_path / "bad.yml").write_text("accounts:\n  - accessKey: ab\n    secretKey: cd\n")
    config, _ = BrokerConfig.load(None, {**values, "aclFile": str(tmp_path / "bad.yml")})
    with pytest.raises(ConfigError, match="7 characters"):
        BrokerController(config, VirtualClock())
    assert AclValidator  # the validator is what the broker builds from the file


def test_a_replayed_or_stale_request_is_refused(tmp_path: Path):
    import yaml

    (tmp_path / "acl.yml").write_text(yaml.safe_dump({"accounts": [{
        "accessKey": "RocketMQ", "secretKey": "12345678", "defaultTopicPerm": "PUB|SUB",
        "defaultGroupPerm": "SUB"}]}))
    clock = VirtualClock()
    v = AclValidator(tmp_path / "acl.yml", clock.now_ms, replay_window_ms=60_000)

    def signed(now: int | None) -> RemotingCommand:
        req = RemotingCommand.request(R.SEND_MESSAGE, {"topic": "T"}, b"b")
        return sign(req, "RocketMQ", "12345678", now)

    req = signed(clock.now_ms())
    v.check(req.code, req.ext_fields, req.body, "127.0.0.1")
    with pytest.raises(AclError, match="replayed"):  # the same bytes again
        v.check(req.code, req.ext_fields, req.body, "127.0.0.1")
    again = signed(clock.now_ms())  # the same request sent again by the client: a new nonce, accepted
    v.check(again.code, again.ext_fields, again.body, "127.0.0.1")
    old = signed(clock.now_ms() - 61_000)
    with pytest.raises(AclError, match="possible replay"):
        v.check(old.code, old.ext_fields, old.body, "127.0.0.1")
    legacy = signed(None)  # RocketMQ's clients sign no Timestamp: checked as RocketMQ checks them
    v.check(legacy.code, legacy.ext_fields, legacy.body, "127.0.0.1")
    v.check(legacy.code, legacy.ext_fields, legacy.body, "127.0.0.1")
    strict = AclValidator(tmp_path / "acl.yml", clock.now_ms, require_timestamp=True)
    with pytest.raises(AclError, match="no Timestamp"):
        strict.check(legacy.code, legacy.ext_fields, legacy.body, "127.0.0.1")
