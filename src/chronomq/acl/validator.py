"""The check of one request against the accounts (sans-IO: a request's code, ext fields, body and client
address in, nothing or an AclError out), in RocketMQ's order: a globally white address passes; a request
without a known AccessKey is refused; an address white for that account passes; the signature must match;
admin-only codes need ``admin: true``; then each resource the request touches (a topic, or a group as
%RETRY%<group>) needs the permission its code asks for, the account's defaults standing in for resources
it does not list. ``AclValidator`` reloads its file when it changes (checked at most every 5 s).

Replays: a signed request that carries chronomq's ``Timestamp`` (and ``Nonce``) is refused when its time is
more than ``replay_window_ms`` away from the broker's or its signature was already seen within that
window (at most ``MAX_SEEN`` signatures are remembered; past that the oldest are forgotten). A request
without a Timestamp, as RocketMQ's clients send them, is checked as RocketMQ checks it, unless
``require_timestamp``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from chronomq.remoting.codes import RequestCode, ResponseCode
from chronomq.remoting.signing import ACCESS_KEY, SIGNATURE, TIMESTAMP, signature

from .plain import ANY, PUB, RETRY_PREFIX, SUB, AclConfigError, PlainAcl, check_perm, parse

log = logging.getLogger("chronomq.acl")

# UPDATE_AND_CREATE_TOPIC, UPDATE_BROKER_CONFIG, DELETE_TOPIC_IN_BROKER, and the subscription groups' 200/207
ADMIN_CODES = frozenset({RequestCode.UPDATE_AND_CREATE_TOPIC, 25, RequestCode.DELETE_TOPIC_IN_BROKER, 200,
                         207})
TRACE_TOPIC = "RMQ_SYS_TRACE_TOPIC"
RELOAD_CHECK_MS = 5000
MAX_SEEN = 1_000_000


class AclError(Exception):
    """A refused request; the text says why, never with a secret."""


class Checker(Protocol):
    """What the broker asks of its ACL (1.0's AclValidator, 2.0's Acl2Validator, or both chained)."""

    refused: int

    def check(self, code: int, ext: Mapping[str, Any], body: bytes | None, remote_ip: str) -> None: ...

    def authorize(self, access_key: str | None, remote_ip: str, verify: Callable[[str], bool],
                  need: Callable[[], Mapping[str, int]], admin: bool = False,
                  what: str = "this request") -> None: ...


def _retry(group: Any) -> str | None:
    return None if group is None else RETRY_PREFIX + str(group)


def resources(code: int, ext: Mapping[str, Any], body: bytes | None) -> dict[str, int]:
    """What a request touches and needs: resource -> PUB/SUB (RocketMQ's PlainAccessValidator.parse).
    A reply (324/325) is a send to the reply topic and needs what a send (10/310) with its header needs."""
    need: dict[str, int] = {}

    def add(res: Any, perm: int) -> None:
        if res is not None:
            need[str(res)] = need.get(str(res), 0) | perm

    g = ext.get
    if code in (RequestCode.SEND_MESSAGE, RequestCode.SEND_REPLY_MESSAGE):
        add(g("topic"), PUB)
        if str(g("topic", "")).startswith(RETRY_PREFIX):
            add(_retry(g("group")), SUB)
    elif code in (RequestCode.SEND_MESSAGE_V2, RequestCode.SEND_REPLY_MESSAGE_V2):
        add(g("b"), PUB)
        if str(g("b", "")).startswith(RETRY_PREFIX):
            add(_retry(g("a")), SUB)
    elif code == RequestCode.CONSUMER_SEND_MSG_BACK:
        add(_retry(g("group")), SUB)
    elif code == RequestCode.PULL_MESSAGE:
        add(g("topic"), SUB)
        add(_retry(g("consumerGroup")), SUB)
    elif code == RequestCode.QUERY_MESSAGE:
        add(g("topic"), SUB)
    elif code == RequestCode.HEART_BEAT:
        try:
            hb = json.loads(body) if body else {}
        except (ValueError, UnicodeDecodeError) as e:
            raise AclError(f"the heartbeat body is not JSON: {e}") from None
        for c in (hb.get("consumerDataSet") or []) if isinstance(hb, dict) else []:
            add(_retry(c.get("groupName")), SUB)
            for s in c.get("subscriptionDataSet") or []:
                add(s.get("topic"), SUB)
    elif code in (RequestCode.UNREGISTER_CLIENT, RequestCode.GET_CONSUMER_LIST_BY_GROUP):
        add(_retry(g("consumerGroup")), SUB)
    elif code == RequestCode.UPDATE_CONSUMER_OFFSET:
        add(_retry(g("consumerGroup")), SUB)
        add(g("topic"), SUB)
    return need


def asked(need: Mapping[str, int]) -> str:
    """What a request asks for, as a refusal's log line names it: ``topic:orders Pub, group:g1 Sub``."""
    out = []
    for res, perm in sorted(need.items()):
        if res.startswith(RETRY_PREFIX):
            if res != RETRY_PREFIX:  # a producer's blank group (its unregister) names none
                out.append(f"group:{res[len(RETRY_PREFIX):]} Sub")
            continue
        actions = [a for bit, a in ((PUB, "Pub"), (SUB, "Sub")) if perm & bit]
        out.append(f"topic:{res} {'|'.join(actions) or ('Pub|Sub' if perm & ANY else '?')}")
    return ", ".join(out) or "no topic or group"


class AclValidator:
    def __init__(self, path: str | Path, now_ms: Callable[[], int], replay_window_ms: int = 300_000,
                 require_timestamp: bool = False) -> None:
        self.path = Path(path)
        self._now_ms = now_ms
        self.replay_window_ms = replay_window_ms
        self.require_timestamp = require_timestamp
        self._seen: dict[str, int] = {}  # signature -> when it stops mattering (insertion = time order)
        self._mtime = -1.0
        self._next_stat = 0
        self.acl = PlainAcl([], {})
        self.refused = 0
        self.reload(force=True)

    def reload(self, force: bool = False) -> bool:
        """Read the file again if it changed; a file that cannot be used keeps the rules in force (and
        says why). Raises AclConfigError only on the first load."""
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError as e:
            if force:
                raise AclConfigError(f"the ACL file {self.path} cannot be read: {e.strerror}") from None
            return False
        if not force and mtime == self._mtime:
            return False
        try:
            import yaml  # the field's standard YAML parser (RocketMQ's format is YAML)

            acl = parse(yaml.safe_load(self.path.read_text(encoding="utf-8")))
        except (OSError, AclConfigError, yaml.YAMLError) as e:
            if force:
                raise AclConfigError(f"the ACL file {self.path}: {e}") from None
            log.error("ACL file %s changed but cannot be used (%s); the previous rules stay in force",
                      self.path, e)
            self._mtime = mtime
            return False
        self.acl, self._mtime = acl, mtime
        log.info("ACL: %d accounts and %d global white addresses from %s", len(acl.accounts),
                 len(acl.global_white), self.path)
        return True

    def _check_replay(self, ext: Mapping[str, Any], now: int) -> None:
        raw = ext.get(TIMESTAMP)
        if raw is None:
            if self.require_timestamp:
                raise AclError("the request carries no Timestamp (aclRequireTimestamp is on)")
            return
        try:
            ts = int(str(raw))
        except ValueError:
            raise AclError(f"bad Timestamp {raw!r}") from None
        if abs(now - ts) > self.replay_window_ms:
            raise AclError(f"the request's Timestamp is {abs(now - ts) // 1000} s away from this broker's "
                           f"clock (more than {self.replay_window_ms // 1000} s): a possible replay")
        seen = self._seen
        sig = str(ext.get(SIGNATURE))
        if sig in seen and seen[sig] > now:
            raise AclError("a replayed request (its signature was already used)")
        while seen:
            first = next(iter(seen))
            if seen[first] > now and len(seen) < MAX_SEEN:
                break
            del seen[first]
        seen[sig] = now + self.replay_window_ms

    def check(self, code: int, ext: Mapping[str, Any], body: bytes | None, remote_ip: str) -> None:
        """Raise AclError when the remoting request is refused."""
        ak = ext.get(ACCESS_KEY)

        def verify(secret: str) -> bool:
            if ext.get(SIGNATURE) != signature(ext, body, secret):
                return False
            self._check_replay(ext, self._now_ms())
            return True

        self.authorize(str(ak) if ak else None, remote_ip, verify, lambda: resources(code, ext, body),
                       code in ADMIN_CODES, f"request code={code}")

    def authorize(self, access_key: str | None, remote_ip: str, verify: Callable[[str], bool],
                  need: Callable[[], Mapping[str, int]], admin: bool = False,
                  what: str = "this request") -> None:
        """The check of one request, whatever protocol carried it; raise AclError when it is refused.
        ``verify`` is given the account's secret and says whether the request's signature holds (it may
        raise AclError itself, as a replay); ``need`` gives what the request touches, resource -> PUB/SUB
        (a group as %RETRY%<group>); ``admin``: the request needs an admin account."""
        now = self._now_ms()
        if now >= self._next_stat:
            self._next_stat = now + RELOAD_CHECK_MS
            self.reload()
        acl = self.acl
        if any(w.match(remote_ip) for w in acl.global_white):
            return
        ak = access_key
        if not ak:
            raise AclError("No accessKey is configured")
        account = acl.accounts.get(ak)
        if account is None:
            raise AclError(f"No acl config for {ak}")
        if account.white.match(remote_ip):
            return
        if not verify(account.secret_key):
            raise AclError(f"Check signature failed for accessKey={ak}")
        needed = need()
        if needed.get(TRACE_TOPIC) == PUB:
            return
        if admin and not account.admin:
            raise AclError(f"Need admin permission for {what}, but accessKey={ak} is not")
        if not needed or (account.admin and not account.perms):
            return
        for res, perm in needed.items():
            group = res.startswith(RETRY_PREFIX)
            default = account.default_group_perm if group else account.default_topic_perm
            owned = account.perms.get(res, default)
            if not check_perm(perm, owned):
                what_res = f"group:{res[len(RETRY_PREFIX):]}" if group else f"topic:{res}"
                raise AclError(f"No default permission for {what_res}")


def refusal(validator: Checker | None, req: Any, remote_addr: str) -> Any:
    """The NO_PERMISSION answer to a request ``validator`` refuses (the reason as remark, and a log line
    naming the access key and address), or None when it passes or there is no validator. A oneway request
    gets no answer from the caller's server, but is refused all the same."""
    if validator is None:
        return None
    ip = remote_addr.rpartition(":")[0] or remote_addr
    try:
        validator.check(req.code, req.ext_fields, req.body, ip.strip("[]"))
    except AclError as e:
        validator.refused += 1
        try:
            what = asked(resources(req.code, req.ext_fields, req.body))
        except AclError:  # a heartbeat body that is not JSON: the reason says so
            what = "?"
        log.warning("ACL: refused request code %s (%s) from %s (AccessKey %s): %s", req.code, what,
                    remote_addr, req.ext_fields.get(ACCESS_KEY) or "-", e)
        return req.response(ResponseCode.NO_PERMISSION, remark=f"AclException: {e}")
    return None
