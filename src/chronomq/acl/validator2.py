"""The ACL 2.0 check of one request (sans-IO), behind the same ``check``/``authorize`` as ACL 1.0's
``AclValidator`` (see validator.py), so the 4.x port and the 5.x endpoint ask it alike.

Authentication (``authenticationEnabled``): the request's AccessKey is a username of the store, the user is
enabled, and its Signature is RocketMQ's remoting HMAC keyed with the user's password. Authorization
(``authorizationEnabled``): a Super user passes; otherwise every (resource, action) the request needs must
be decided Allow by the user's ACL (auth2.Acl.decide). A request's needs: ACL 1.0's resources (PUB -> Pub,
SUB -> Sub, a group "%RETRY%<group>" -> Group:<group> Sub) plus, on the remoting port, the admin codes'
own (RocketMQ 5.3's RocketMQAction annotations: topic create/update -> Create, delete -> Delete, topic
queries -> Get, the user/ACL codes and broker config -> Cluster:<cluster> Update or Get).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from chronomq.remoting.codes import RequestCode
from chronomq.remoting.signing import ACCESS_KEY, SIGNATURE, signature

from .auth2 import DISABLE, SUPER, AuthStore
from .plain import ANY, PUB, RETRY_PREFIX, SUB
from .validator import AclError, resources

Need = tuple[str, str, str]  # resource type, name, action

AUTH_CODES = {3001: "Update", 3002: "Update", 3003: "Update", 3004: "Get", 3005: "Get", 3006: "Update",
              3007: "Update", 3008: "Update", 3009: "Get", 3010: "Get"}
TOPIC_CODES: dict[int, str] = {
    RequestCode.UPDATE_AND_CREATE_TOPIC: "Create", RequestCode.DELETE_TOPIC_IN_BROKER: "Delete",
    RequestCode.GET_TOPIC_CONFIG: "Get", RequestCode.GET_MAX_OFFSET: "Get",
    RequestCode.GET_MIN_OFFSET: "Get", RequestCode.GET_TOPIC_STATS_INFO: "Get"}
UPDATE_BROKER_CONFIG, UPDATE_GROUP, DELETE_GROUP = 25, 200, 207


def from_need(need: Mapping[str, int]) -> list[Need]:
    """ACL 1.0's resource -> PUB/SUB as ACL 2.0's (type, name, action)."""
    out: list[Need] = []
    for res, perm in need.items():
        if res.startswith(RETRY_PREFIX):
            if res != RETRY_PREFIX:  # a blank group (a producer's unregister) is not checked, as in RocketMQ
                out.append(("Group", res[len(RETRY_PREFIX):], "Sub"))
            continue
        if perm & PUB:
            out.append(("Topic", res, "Pub"))
        if perm & SUB:
            out.append(("Topic", res, "Sub"))
        if perm & ANY and not perm & (PUB | SUB):
            out.append(("Topic", res, "Pub|Sub"))  # either one (a 5.x route query, as RocketMQ's proxy asks)
    return out


def admin_needs(code: int, ext: Mapping[str, Any], body: bytes | None, cluster: str) -> list[Need]:
    """What an admin code needs beyond ACL 1.0's resources."""
    if code in AUTH_CODES:
        return [("Cluster", cluster, AUTH_CODES[code])]
    if code in TOPIC_CODES:
        return [("Topic", str(ext.get("topic") or ""), TOPIC_CODES[code])]
    if code == UPDATE_BROKER_CONFIG:
        return [("Cluster", cluster, "Update")]
    if code == DELETE_GROUP:
        return [("Group", str(ext.get("groupName") or ""), "Delete")]
    if code == UPDATE_GROUP:
        try:
            name = json.loads(body or b"{}").get("groupName")
        except (ValueError, AttributeError):
            name = None
        return [("Group", str(name or ""), "Update")]
    return []


class Acl2Validator:
    """ACL 2.0 over an AuthStore; ``refused`` counts refusals (for the broker's figures)."""

    def __init__(self, store: AuthStore, now_ms: Callable[[], int], *, authentication: bool = True,
                 authorization: bool = True, cluster: str = "DefaultCluster") -> None:
        self.store = store
        self._now_ms = now_ms
        self.authentication = authentication
        self.authorization = authorization
        self.cluster = cluster
        self.refused = 0

    def check(self, code: int, ext: Mapping[str, Any], body: bytes | None, remote_ip: str) -> None:
        """Raise AclError when the remoting request is refused."""
        ak = ext.get(ACCESS_KEY)
        self.authorize(str(ak) if ak else None, remote_ip,
                       lambda secret: ext.get(SIGNATURE) == signature(ext, body, secret),
                       lambda: resources(code, ext, body), False, f"request code={code}",
                       actions=admin_needs(code, ext, body, self.cluster))

    def authorize(self, access_key: str | None, remote_ip: str, verify: Callable[[str], bool],
                  need: Callable[[], Mapping[str, int]], admin: bool = False, what: str = "this request",
                  *, actions: Sequence[Need] = ()) -> None:
        """As AclValidator.authorize; ``actions``: further (type, name, action) the request needs. With
        ``admin`` and no ``actions`` the request needs a Super user."""
        users = self.store.users
        user = users.get(access_key) if access_key else None
        if self.authentication:
            if not access_key:
                raise AclError("No accessKey is configured (authenticationEnabled)")
            if user is None:
                raise AclError(f"User:{access_key} is not found")
            if user.status == DISABLE:
                raise AclError(f"User:{access_key} is disabled")
            if not verify(user.password):
                raise AclError(f"check signature failed for User:{access_key}")
        if not self.authorization:
            return
        if user is None:
            raise AclError(f"User:{access_key or '-'} is not found (authorizationEnabled)")
        if user.status == DISABLE:
            raise AclError(f"User:{access_key} is disabled")
        if user.user_type == SUPER:
            return
        needed = from_need(need()) + list(actions)
        if admin and not actions:
            raise AclError(f"Need a Super user for {what}, but User:{access_key} is not")
        acl = self.store.acls.get("User:" + user.username)
        for kind, name, action in needed:
            entry = None
            for one in action.split("|"):  # "Pub|Sub": the first alternative allowed, else the first found
                found = acl.decide(kind, name, one, remote_ip) if acl is not None else None
                if found is not None and (entry is None or found.decision == "Allow"):
                    entry = found
                if entry is not None and entry.decision == "Allow":
                    break
            if entry is None or entry.decision != "Allow":
                detail = "no matched policies" if entry is None else "the decision is deny"
                raise AclError(f"User:{user.username} has no permission to access {kind}:{name} ({action}) "
                               f"from {remote_ip}, {detail}")


class ChainValidator:
    """ACL 1.0 and ACL 2.0 both on: a request must pass each, 1.0's first (RocketMQ 5.3 runs its plain ACL
    hook and its auth pipeline one after the other)."""

    def __init__(self, validators: Sequence[Any]) -> None:
        self.validators = list(validators)
        self.refused = 0

    def check(self, code: int, ext: Mapping[str, Any], body: bytes | None, remote_ip: str) -> None:
        for v in self.validators:
            v.check(code, ext, body, remote_ip)

    def authorize(self, access_key: str | None, remote_ip: str, verify: Callable[[str], bool],
                  need: Callable[[], Mapping[str, int]], admin: bool = False, what: str = "this request",
                  *, actions: Sequence[Need] = ()) -> None:
        for v in self.validators:
            if isinstance(v, Acl2Validator):
                v.authorize(access_key, remote_ip, verify, need, admin, what, actions=actions)
            else:
                v.authorize(access_key, remote_ip, verify, need, admin, what)
