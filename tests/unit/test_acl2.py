"""ACL 2.0: resource keys, the matching of policy entries (exact, prefix, any; actions; source CIDRs;
most specific first, Deny over Allow among equals), the store's file, and the check's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chronomq.acl.auth2 import Acl, AuthError, AuthStore, Entry, Resource, parse_policies
from chronomq.acl.plain import ANY, PUB, SUB
from chronomq.acl.validator import AclError
from chronomq.acl.validator2 import Acl2Validator, admin_needs, from_need
from chronomq.remoting.codes import RequestCode as R
from chronomq.store.atomicfile import write_atomic


def entry(res: str, actions: str, decision: str = "Allow", ips: str = "") -> Entry:
    return Entry.from_json({"resource": res, "actions": actions, "decision": decision, "sourceIps": ips})


def test_resource_keys():
    assert Resource.parse("Topic:orders-*").key == "Topic:orders-*"
    assert Resource.parse("group:g1").key == "Group:g1"  # the type is case-insensitive, as RocketMQ's
    assert Resource.parse("Topic:*").matches("Topic", "anything")
    assert Resource.parse("*").matches("Group", "g")
    assert not Resource.parse("Topic:orders-*").matches("Topic", "order")
    assert not Resource.parse("Topic:a").matches("Group", "a")
    for bad in ("", "orders", "Queue:x", "Topic:"):
        with pytest.raises(AuthError):
            Resource.parse(bad)
    with pytest.raises(AuthError, match="unknown action 'Publish'"):
        entry("Topic:a", "Publish")
    with pytest.raises(AuthError, match="not an address or a CIDR"):
        entry("Topic:a", "Pub", ips="10.0.0.0/99")


@pytest.mark.parametrize("entries, kind, name, action, ip, want", [
    ([entry("Topic:orders-*", "Pub")], "Topic", "orders-1", "Pub", "127.0.0.1", "Allow"),
    ([entry("Topic:orders-*", "Pub")], "Topic", "orders-1", "Sub", "127.0.0.1", None),
    ([entry("Topic:orders-*", "All")], "Topic", "orders-1", "Sub", "127.0.0.1", "Allow"),
    ([entry("Topic:orders-*", "Pub")], "Topic", "other", "Pub", "127.0.0.1", None),
    # source addresses: a CIDR that holds the client, one that does not
    ([entry("Topic:t", "Pub", ips="127.0.0.0/8")], "Topic", "t", "Pub", "127.0.0.1", "Allow"),
    ([entry("Topic:t", "Pub", ips="10.0.0.0/8")], "Topic", "t", "Pub", "127.0.0.1", None),
    ([entry("Topic:t", "Pub", ips="10.1.2.3,127.0.0.1")], "Topic", "t", "Pub", "127.0.0.1", "Allow"),
    # Deny over Allow for the same resource; the most specific entry first
    ([entry("Topic:t", "Pub"), entry("Topic:t", "Pub", "Deny")], "Topic", "t", "Pub", "127.0.0.1", "Deny"),
    ([entry("Topic:t", "Pub", "Deny"), entry("Topic:t", "Pub")], "Topic", "t", "Pub", "127.0.0.1", "Deny"),
    ([entry("Topic:orders-*", "Pub"), entry("Topic:orders-secret", "Pub", "Deny")],
     "Topic", "orders-secret", "Pub", "127.0.0.1", "Deny"),
    ([entry("*", "Pub", "Deny"), entry("Topic:orders-*", "Pub")], "Topic", "orders-1", "Pub", "127.0.0.1",
     "Allow"),
    ([entry("Topic:o*", "Pub", "Deny"), entry("Topic:orders-*", "Pub")], "Topic", "orders-1", "Pub",
     "127.0.0.1", "Allow"),  # the longer prefix decides
])
def test_matching(entries, kind, name, action, ip, want):
    got = Acl("User:a", {"Custom": entries}).decide(kind, name, action, ip)
    assert (got.decision if got else None) == want


def test_custom_policies_before_default():
    acl = Acl("User:a", {"Custom": [entry("Topic:t", "Pub", "Deny")], "Default": [entry("*", "All")]})
    assert acl.decide("Topic", "t", "Pub", "1.2.3.4").decision == "Deny"
    assert acl.decide("Topic", "u", "Pub", "1.2.3.4").decision == "Allow"


def test_needs_from_acl_1_resources_and_admin_codes():
    assert from_need({"orders": PUB | SUB, "%RETRY%g1": SUB}) == [
        ("Topic", "orders", "Pub"), ("Topic", "orders", "Sub"), ("Group", "g1", "Sub")]
    assert admin_needs(R.UPDATE_AND_CREATE_TOPIC, {"topic": "t"}, None, "C") == [("Topic", "t", "Create")]
    assert admin_needs(R.DELETE_TOPIC_IN_BROKER, {"topic": "t"}, None, "C") == [("Topic", "t", "Delete")]
    assert admin_needs(R.AUTH_LIST_USER, {}, None, "C") == [("Cluster", "C", "Get")]
    assert admin_needs(R.AUTH_CREATE_ACL, {}, None, "C") == [("Cluster", "C", "Update")]
    assert admin_needs(R.SEND_MESSAGE, {"topic": "t"}, None, "C") == []


def test_the_store_file_is_rewritten_and_read_again(tmp_path: Path):
    path = tmp_path / "config" / "auth.json"
    s = AuthStore(path, write_atomic)
    s.create_user({"username": "alice", "password": "pw-alice"})
    with pytest.raises(AuthError, match="The user is existed"):
        s.create_user({"username": "alice", "password": "x"})
    with pytest.raises(AuthError, match="The subject of User:bob is not exist"):
        s.create_acl("User:bob", parse_policies({"policies": [{"entries": [
            {"resource": "Topic:t", "actions": ["Pub"], "decision": "Allow"}]}]}))
    s.create_acl("User:alice", parse_policies({"policies": [{"policyType": "Custom", "entries": [
        {"resource": "Topic:orders-*", "actions": ["Pub"], "sourceIps": ["127.0.0.0/8"],
         "decision": "Allow"}]}]}))
    s.update_acl("User:alice", parse_policies({"policies": [{"entries": [
        {"resource": "Group:g1", "actions": ["Sub"], "decision": "Allow"}]}]}))
    assert not path.with_name("auth.json.tmp").exists()
    again = AuthStore(path, write_atomic)
    assert again.users["alice"].password == "pw-alice" and again.users["alice"].user_type == "Normal"
    saved = json.loads(path.read_text())["acls"][0]["policies"][0]["entries"][0]
    assert saved == {"resource": "Topic:orders-*", "actions": ["Pub"], "sourceIps": ["127.0.0.0/8"],
                     "decision": "Allow"}

    def keys(store: AuthStore) -> list[str]:
        return [e.resource.key for e in store.acls["User:alice"].policies["Custom"]]

    assert keys(again) == ["Topic:orders-*", "Group:g1"]
    again.delete_acl("User:alice", None, "Group:g1")
    assert keys(AuthStore(path, write_atomic)) == ["Topic:orders-*"]
    again.delete_user("alice")  # its ACL goes with it
    assert AuthStore(path, write_atomic).users == {} and AuthStore(path, write_atomic).acls == {}
    path.write_text("{oops")
    with pytest.raises(AuthError, match="cannot be used"):
        AuthStore(path, write_atomic)


def test_the_check_authenticates_then_authorizes(tmp_path: Path):
    s = AuthStore(tmp_path / "auth.json", write_atomic)
    s.create_user({"username": "root", "password": "root-pw", "userType": "Super"})
    s.create_user({"username": "alice", "password": "pw"})
    s.create_acl("User:alice", parse_policies({"policies": [{"entries": [
        {"resource": "Topic:orders-*", "actions": ["Pub"], "decision": "Allow"}]}]}))
    v = Acl2Validator(s, lambda: 0)
    ok = lambda secret: secret == "pw" or secret == "root-pw"  # noqa: E731
    v.authorize("root", "10.0.0.1", ok, lambda: {"anything": PUB | SUB}, True, "x")  # Super passes
    v.authorize("alice", "127.0.0.1", ok, lambda: {"orders-1": PUB})
    for ak, need, admin, why in (
            ("alice", {"orders-1": SUB}, False,
             "User:alice has no permission to access Topic:orders-1 (Sub) from 127.0.0.1, "
             "no matched policies"),
            ("alice", {}, True, "Need a Super user for x, but User:alice is not"),
            ("bob", {}, False, "User:bob is not found"),
            (None, {}, False, "No accessKey is configured")):
        with pytest.raises(AclError) as e:
            v.authorize(ak, "127.0.0.1", ok, lambda need=need: need, admin, "x")
        assert why in str(e.value)
    with pytest.raises(AclError, match="check signature failed for User:alice"):
        v.authorize("alice", "127.0.0.1", lambda secret: False, lambda: {"orders-1": PUB})
    s.update_user({"username": "alice", "userStatus": "disable"})
    with pytest.raises(AclError, match="User:alice is disabled"):
        v.authorize("alice", "127.0.0.1", ok, lambda: {"orders-1": PUB})
    # authorization alone: the AccessKey names the user, the signature is not checked
    v2 = Acl2Validator(s, lambda: 0, authentication=False)
    v2.authorize("root", "127.0.0.1", lambda secret: False, lambda: {"t": PUB})


def test_both_acls_on_a_request_must_pass_each(tmp_path: Path):
    import yaml

    from chronomq.acl.validator import AclValidator
    from chronomq.acl.validator2 import ChainValidator

    plain = tmp_path / "plain_acl.yml"
    plain.write_text(yaml.safe_dump({"accounts": [
        {"accessKey": "alice00", "secretKey": "secret00", "defaultTopicPerm": "PUB"}]}))
    s = AuthStore(tmp_path / "auth.json", write_atomic)
    s.create_user({"username": "alice00", "password": "secret00"})
    s.create_acl("User:alice00", parse_policies({"policies": [{"entries": [
        {"resource": "Topic:orders-*", "actions": ["Pub"], "decision": "Allow"}]}]}))
    chain = ChainValidator([AclValidator(plain, lambda: 0), Acl2Validator(s, lambda: 0)])
    ok = lambda secret: secret == "secret00"  # noqa: E731
    chain.authorize("alice00", "127.0.0.1", ok, lambda: {"orders-1": PUB})
    with pytest.raises(AclError, match=r"Topic:audit \(Pub\) from 127\.0\.0\.1, no matched"):  # 2.0 refuses
        chain.authorize("alice00", "127.0.0.1", ok, lambda: {"audit": PUB})
    with pytest.raises(AclError, match="No default permission for topic:orders-1"):  # 1.0 refuses
        chain.authorize("alice00", "127.0.0.1", ok, lambda: {"orders-1": SUB})


def test_a_need_of_either_pub_or_sub_passes_with_either_and_not_with_another_action(tmp_path: Path):
    """A 5.x route query needs Pub or Sub on its topic (ACL 1.0's ANY), as RocketMQ's proxy asks."""
    assert from_need({"orders-1": ANY}) == [("Topic", "orders-1", "Pub|Sub")]
    s = AuthStore(tmp_path / "auth.json", write_atomic)
    for name in ("pub", "sub", "maker", "denied"):
        s.create_user({"username": name, "password": "pw"})
    rules = {"pub": [("Topic:orders-*", "Pub", "Allow")], "sub": [("Topic:orders-*", "Sub", "Allow")],
             "maker": [("Topic:orders-*", "Create", "Allow")],
             "denied": [("Topic:orders-*", "Sub", "Allow"), ("Topic:orders-1", "Pub", "Deny")]}
    for name, entries in rules.items():
        s.create_acl(f"User:{name}", parse_policies({"policies": [{"entries": [
            {"resource": r, "actions": [a], "decision": d} for r, a, d in entries]}]}))
    v = Acl2Validator(s, lambda: 0)
    ok = lambda secret: True  # noqa: E731
    v.authorize("pub", "127.0.0.1", ok, lambda: {"orders-1": ANY})
    v.authorize("sub", "127.0.0.1", ok, lambda: {"orders-1": ANY})
    v.authorize("denied", "127.0.0.1", ok, lambda: {"orders-1": ANY})  # its Sub is allowed
    with pytest.raises(AclError, match=r"Topic:orders-1 \(Pub\|Sub\) from 127.0.0.1, no matched policies"):
        v.authorize("maker", "127.0.0.1", ok, lambda: {"orders-1": ANY})
    with pytest.raises(AclError, match="no matched policies"):
        v.authorize("pub", "127.0.0.1", ok, lambda: {"audit": ANY})
