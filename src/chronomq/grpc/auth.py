"""The 5.x endpoint's check of credentials: the official clients sign each call's metadata with
``authorization: MQv2-HMAC-SHA1 Credential=<ak>, SignedHeaders=x-mq-date-time, Signature=<hex>``, the
signature being HMAC-SHA1(secret, x-mq-date-time) in hex (either case). ``Guard`` checks it against the
broker's accounts (``AclValidator.authorize``, ACL 1.0 or 2.0 alike) and maps each RPC to what it touches
as RocketMQ's proxy does (``need``). A refusal answers UNAUTHORIZED (40100) in the response's Status, as
the proxy answers both authentication and authorization failures, and is logged once, never the secret.
"""

from __future__ import annotations

import calendar
import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from chronomq.acl.plain import ANY, PUB, RETRY_PREFIX, SUB
from chronomq.acl.validator import AclError, asked

from ._proto import rocketmq_v2_pb2 as pb

log = logging.getLogger("chronomq.grpc")

AUTHORIZATION = "authorization"
DATE_TIME = "x-mq-date-time"
ALGORITHM = "MQv2-HMAC-SHA1"
DATE_TIME_FORMAT = "%Y%m%dT%H%M%SZ"


class Authorizer(Protocol):
    """What the broker's ACL offers any protocol (acl/validator.py)."""

    refused: int

    def authorize(self, access_key: str | None, remote_ip: str, verify: Callable[[str], bool],
                  need: Callable[[], Mapping[str, int]], admin: bool = ..., what: str = ...) -> None: ...


def sign(secret: str, date_time: str) -> str:
    """The clients' signature: HMAC-SHA1 of the x-mq-date-time value keyed with the secret, lower hex."""
    return hmac.new(secret.encode(), date_time.encode(), hashlib.sha1).hexdigest()


def parse_authorization(value: str) -> tuple[str, str]:
    """(access key, hex signature) of an ``authorization`` value, read as RocketMQ's proxy reads it: the
    algorithm word, then comma-separated key=value items; a Credential of the form ``ak/...`` (the Go and
    C++ clients add ``//Rocketmq``) names ``ak``. Raises AclError when it cannot be read."""
    _, _, items = value.strip().partition(" ")
    if not items:
        raise AclError("the authorization header is incorrect")
    ak = sig = ""
    for item in items.split(","):
        key, eq, val = item.strip().partition("=")
        if not eq:
            raise AclError(f"the authorization header item {item.strip()[:40]!r} is not key=value")
        if key == "Credential":
            ak = val.split("/", 1)[0]
        elif key == "Signature":
            sig = val
    if not ak:
        raise AclError("the authorization header names no Credential")
    return ak, sig


def date_time_ms(value: str) -> int:
    """Milliseconds of an x-mq-date-time (yyyyMMdd'T'HHmmss'Z', read as UTC); raises ValueError."""
    return calendar.timegm(time.strptime(value, DATE_TIME_FORMAT)) * 1000


def _name(r: Any) -> str:
    return str(r.name)


def need(rpc: str, req: Any) -> dict[str, int]:
    """What an RPC touches and needs, resource -> PUB/SUB/ANY, a group as %RETRY%<group>, as RocketMQ's
    proxy builds it for each request (a blank name is not checked)."""
    out: dict[str, int] = {}

    def add(res: str, perm: int) -> None:
        if res and res != RETRY_PREFIX:
            out[res] = out.get(res, 0) | perm

    if rpc == "SendMessage":
        for m in req.messages:
            add(_name(m.topic), PUB)
    elif rpc in ("EndTransaction", "RecallMessage"):
        add(_name(req.topic), PUB)
    elif rpc == "QueryRoute":
        add(_name(req.topic), ANY)
    elif rpc in ("Heartbeat", "NotifyClientTermination"):
        if req.HasField("group"):
            add(RETRY_PREFIX + _name(req.group), SUB)
    elif rpc == "ReceiveMessage":
        add(_name(req.message_queue.topic), SUB)
        add(RETRY_PREFIX + _name(req.group), SUB)
    elif rpc in ("AckMessage", "ChangeInvisibleDuration", "ForwardMessageToDeadLetterQueue",
                 "QueryAssignment"):
        add(_name(req.topic), SUB)
        add(RETRY_PREFIX + _name(req.group), SUB)
    elif rpc == "Telemetry" and isinstance(req, pb.TelemetryCommand) and req.HasField("settings"):
        s = req.settings
        if s.HasField("publishing"):
            for t in s.publishing.topics:
                add(_name(t), PUB)
        if s.HasField("subscription"):
            add(RETRY_PREFIX + _name(s.subscription.group), SUB)
            for e in s.subscription.subscriptions:
                add(_name(e.topic), SUB)
    return out


class Guard:
    """``refusal(rpc, req, metadata, ip)``: None when the call may go on, else the reason (logged once).
    ``req`` None checks the credentials only (a Telemetry stream's start). ``require_date_time``: refuse a
    call whose x-mq-date-time is more than ``window_ms`` from the broker's clock (RocketMQ's proxy checks no
    time, and the Java client writes its local time with a 'Z', so this is off unless aclRequireTimestamp)."""

    def __init__(self, acl: Authorizer, now_ms: Callable[[], int], *, require_date_time: bool = False,
                 window_ms: int = 300_000) -> None:
        self.acl = acl
        self.now_ms = now_ms
        self.require_date_time = require_date_time
        self.window_ms = window_ms

    def _verify(self, date_time: str, sig: str) -> Callable[[str], bool]:
        def verify(secret: str) -> bool:
            if not hmac.compare_digest(sig.lower(), sign(secret, date_time)):
                return False
            if self.require_date_time:
                try:
                    then = date_time_ms(date_time)
                except ValueError:
                    raise AclError(f"bad {DATE_TIME} {date_time[:32]!r}") from None
                if abs(self.now_ms() - then) > self.window_ms:
                    raise AclError(f"the call's {DATE_TIME} is more than {self.window_ms // 1000} s away "
                                   "from this broker's clock: a possible replay")
            return True

        return verify

    def refusal(self, rpc: str, req: Any, metadata: Mapping[str, str], ip: str, peer: str) -> str | None:
        ak: str | None = None
        sig, bad_header = "", ""
        if metadata.get(AUTHORIZATION):
            try:
                ak, sig = parse_authorization(metadata[AUTHORIZATION])
            except AclError as e:  # refused below, unless the address is globally white
                bad_header = str(e)
        try:
            self.acl.authorize(ak, ip, self._verify(metadata.get(DATE_TIME, ""), sig),
                               lambda: need(rpc, req) if req is not None else {}, False, rpc)
        except AclError as e:
            self.acl.refused += 1
            reason = bad_header or str(e)
            try:
                what = asked(need(rpc, req)) if req is not None else "no topic or group"
            except Exception:  # a request too malformed to name its resources is still refused
                what = "?"
            log.warning("ACL: refused %s (%s) from %s (AccessKey %s): %s", rpc, what, peer, ak or "-", reason)
            return reason
        return None
