"""RocketMQ's plain ACL accounts file (plain_acl.yml), parsed into the rules the validator applies.

Keys: ``globalWhiteRemoteAddresses`` (a list), ``accounts`` (a list of ``accessKey``, ``secretKey``,
``whiteRemoteAddress``, ``admin``, ``defaultTopicPerm``, ``defaultGroupPerm``, ``topicPerms`` and
``groupPerms`` as "name=PERM" strings). Permissions are DENY, PUB, SUB and "PUB|SUB"; anything else,
including ANY, means DENY, as in RocketMQ. Addresses: "*", a.b.c.d, a.b.*.*, ranges such as
192.168.1.1-100, comma lists and 192.168.1.{1,2}. Keys shorter than 7 characters are refused. Group
permissions are kept under "%RETRY%<group>", the resource RocketMQ checks for a group.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

DENY, ANY, PUB, SUB = 1, 2, 4, 8
RETRY_PREFIX = "%RETRY%"
MIN_KEY_LENGTH = 7


class AclConfigError(ValueError):
    """An accounts file that cannot be used: the reason names the entry."""


def parse_perm(text: Any) -> int:
    s = str(text).strip().upper() if text is not None else ""
    return {"PUB": PUB, "SUB": SUB, "PUB|SUB": PUB | SUB, "SUB|PUB": PUB | SUB}.get(s, DENY)


def check_perm(needed: int, owned: int) -> bool:
    if owned & DENY:
        return False
    if needed & ANY:
        return bool(owned & (PUB | SUB))
    return bool(needed & owned)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(text.strip())
    except ValueError:
        raise AclConfigError(f"{text!r} is not an IP address") from None


class AddressRule:
    """One white-address entry; ``match(ip)`` for a client's IP (no port)."""

    def __init__(self, spec: str | None) -> None:
        spec = (spec or "").strip()
        self.spec = spec
        self.any = spec in ("*", "*.*.*.*", "*:*:*:*:*:*:*:*")
        self.exact: set[str] = set()
        self.prefix = ""
        self.index = -1
        self.lo = self.hi = 0
        if not spec or self.any:
            return
        if spec.endswith("}"):
            head, _, items = spec[:-1].partition("{")
            self.exact = {str(_ip(head + it.strip())) for it in items.split(",") if it.strip()}
        elif "," in spec:
            self.exact = {str(_ip(it)) for it in spec.split(",") if it.strip()}
        elif "*" in spec or "-" in spec:
            parts = spec.split(".")
            if len(parts) != 4:
                raise AclConfigError(f"address range {spec!r}: only IPv4 ranges are understood")
            for i in range(1, 4):
                p = parts[i]
                if p == "*":
                    self.index, self.lo, self.hi = i, 0, 255
                    break
                if "-" in p:
                    a, _, b = p.partition("-")
                    if not (a.isdigit() and b.isdigit() and 0 <= int(a) <= int(b) <= 255):
                        raise AclConfigError(f"address range {spec!r}: bad range {p!r}")
                    self.index, self.lo, self.hi = i, int(a), int(b)
                    break
            if self.index < 0:
                raise AclConfigError(f"address range {spec!r} has no '*' or 'a-b' part")
            self.prefix = ".".join(parts[: self.index]) + "."
        else:
            self.exact = {str(_ip(spec))}

    def match(self, ip: str) -> bool:
        if self.any:
            return True
        if self.exact:
            return ip in self.exact
        if self.index > 0 and ip.startswith(self.prefix):
            parts = ip.split(".")
            octet = parts[self.index] if len(parts) == 4 else ""
            return octet.isdigit() and self.lo <= int(octet) <= self.hi
        return False


@dataclass
class Account:
    access_key: str
    secret_key: str = field(repr=False)  # never in a repr, a log line or an error
    white: AddressRule
    admin: bool = False
    default_topic_perm: int = DENY
    default_group_perm: int = DENY
    perms: dict[str, int] = field(default_factory=dict)  # topic name or %RETRY%group -> perm


@dataclass
class PlainAcl:
    global_white: list[AddressRule]
    accounts: dict[str, Account]


def _perm_entries(entries: Any, what: str, key: str, group: bool) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in entries or []:
        name, sep, perm = str(e).partition("=")
        if not sep or not name.strip() or "=" in perm:
            raise AclConfigError(f"account {key!r}: {what} entry {e!r} is not 'name=PERM'")
        out[(RETRY_PREFIX if group else "") + name.strip()] = parse_perm(perm)
    return out


def parse(doc: Any) -> PlainAcl:
    """A loaded plain_acl.yml document (a mapping); raises AclConfigError."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise AclConfigError("the file is not a mapping of globalWhiteRemoteAddresses and accounts")
    whites = [AddressRule(str(a)) for a in doc.get("globalWhiteRemoteAddresses") or []]
    accounts: dict[str, Account] = {}
    for i, a in enumerate(doc.get("accounts") or []):
        if not isinstance(a, dict):
            raise AclConfigError(f"accounts[{i}] is not a mapping")
        ak, sk = str(a.get("accessKey") or ""), str(a.get("secretKey") or "")
        if len(ak) < MIN_KEY_LENGTH or len(sk) < MIN_KEY_LENGTH:
            raise AclConfigError(f"accounts[{i}]: accessKey and secretKey need {MIN_KEY_LENGTH} characters "
                                 "or more")
        if ak in accounts:
            continue  # the first one wins, as in RocketMQ
        perms = _perm_entries(a.get("topicPerms"), "topicPerms", ak, False)
        perms.update(_perm_entries(a.get("groupPerms"), "groupPerms", ak, True))
        admin = str(a.get("admin", False)).strip().lower() == "true"
        accounts[ak] = Account(ak, sk, AddressRule(a.get("whiteRemoteAddress")), admin,
                               parse_perm(a.get("defaultTopicPerm")), parse_perm(a.get("defaultGroupPerm")),
                               perms)
    return PlainAcl(whites, accounts)
