"""RocketMQ ACL 2.0 (5.3): users and ACLs, their matching, and the file they are kept in.

A user is a username, a password, a type (Super: passes every authorization; Normal) and a status
(enable/disable). An ACL belongs to a subject ("User:alice") and holds policies (Custom, else Default) of
entries: a resource ("Topic:orders-*", "Group:g1", "Topic:*", "*"), actions (Pub, Sub, Create, Update,
Delete, Get, List, All), source IPs (addresses or CIDRs; none: any) and a decision (Allow/Deny). As in
RocketMQ's AclAuthorizationHandler, the entries that match a request are ordered most specific first
(a typed resource before "*", an exact name before a prefix before "Type:*", a longer prefix first) and
Deny before Allow among equals; the first decides. No matching entry: refused.

Rules: the store is one JSON file written atomically (temp, fsync, rename) on every change and read at
start; a password is never logged.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACTIONS = ("All", "Any", "Pub", "Sub", "Create", "Update", "Delete", "Get", "List")
RESOURCE_TYPES = ("Any", "Cluster", "Namespace", "Topic", "Group")
SUPER, NORMAL = "Super", "Normal"
ENABLE, DISABLE = "enable", "disable"
ALLOW, DENY = "Allow", "Deny"
CUSTOM, DEFAULT = "Custom", "Default"
LITERAL, PREFIXED, ANY_NAME = 0, 1, 2  # resource patterns, in order of precedence


class AuthError(ValueError):
    """A user, ACL or request that cannot be accepted; the text names it (never a password)."""


def _canon(value: Any, names: Iterable[str], what: str, default: str | None = None) -> str:
    text = str(value).strip() if value not in (None, "") else ""
    if not text:
        if default is None:
            raise AuthError(f"{what} is missing")
        return default
    for n in names:
        if n.lower() == text.lower():
            return n
    raise AuthError(f"unknown {what} {text!r}: one of {', '.join(names)}")


@dataclass(frozen=True)
class Resource:
    type: str  # one of RESOURCE_TYPES
    name: str = ""  # the name, or the prefix for PREFIXED
    pattern: int = LITERAL

    @classmethod
    def parse(cls, key: Any) -> Resource:
        """RocketMQ's resource key: "*", "Type:*", "Type:prefix*" or "Type:name"."""
        text = str(key or "").strip()
        if not text:
            raise AuthError("a policy entry has no resource")
        if text == "*":
            return cls("Any", "", ANY_NAME)
        kind, sep, name = text.partition(":")
        if not sep or not name:
            raise AuthError(f"resource {text!r} is not Type:name (Topic:orders, Group:g1*, Topic:*, *)")
        kind = _canon(kind, RESOURCE_TYPES, "resource type")
        if name == "*":
            return cls(kind, "", ANY_NAME)
        if name.endswith("*"):
            return cls(kind, name[:-1], PREFIXED)
        return cls(kind, name, LITERAL)

    @property
    def key(self) -> str:
        if self.type == "Any":
            return "*"
        return f"{self.type}:{'*' if self.pattern == ANY_NAME else self.name + ('*' if self.pattern else '')}"

    def matches(self, kind: str, name: str) -> bool:
        if self.type == "Any":
            return True
        if self.type != kind:
            return False
        if self.pattern == ANY_NAME:
            return True
        return name.startswith(self.name) if self.pattern == PREFIXED else name == self.name

    def rank(self) -> tuple[int, int, int]:
        """Smaller = more specific (RocketMQ's comparePolicyEntries)."""
        return (self.type == "Any", self.pattern, -len(self.name))


def _source(spec: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(str(spec).strip(), strict=False)
    except ValueError:
        raise AuthError(f"source IP {spec!r} is not an address or a CIDR") from None


@dataclass
class Entry:
    resource: Resource
    actions: tuple[str, ...]
    source_ips: tuple[str, ...] = ()
    decision: str = ALLOW
    _nets: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        self._nets = tuple(_source(s) for s in self.source_ips)

    def matches(self, kind: str, name: str, action: str, ip: str) -> bool:
        if not self.resource.matches(kind, name):
            return False
        if action != "Any" and action not in self.actions and "All" not in self.actions:
            return False
        if not self._nets:
            return True
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return any(addr in n for n in self._nets)

    def to_json(self) -> dict[str, Any]:
        return {"resource": self.resource.key, "actions": list(self.actions),
                "sourceIps": list(self.source_ips), "decision": self.decision}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Entry:
        actions = d.get("actions") or []
        if isinstance(actions, str):
            actions = actions.split(",")
        acts = tuple(_canon(a, ACTIONS, "action") for a in actions if str(a).strip())
        if not acts:
            raise AuthError(f"the entry for {d.get('resource')!r} has no action")
        ips = d.get("sourceIps") or []
        if isinstance(ips, str):
            ips = ips.split(",")
        sources = tuple(str(i).strip() for i in ips if str(i).strip())
        return cls(Resource.parse(d.get("resource")), acts, sources,
                   _canon(d.get("decision"), (ALLOW, DENY), "decision"))


@dataclass
class User:
    username: str
    password: str = field(repr=False)  # never in a repr or a log line
    user_type: str = NORMAL
    status: str = ENABLE

    def to_json(self) -> dict[str, Any]:
        return {"username": self.username, "password": self.password, "userType": self.user_type,
                "userStatus": self.status}


@dataclass
class Acl:
    subject: str
    policies: dict[str, list[Entry]] = field(default_factory=dict)  # policy type -> entries

    def to_json(self) -> dict[str, Any]:
        return {"subject": self.subject, "policies": [
            {"policyType": t, "entries": [e.to_json() for e in es]} for t, es in self.policies.items() if es]}

    def decide(self, kind: str, name: str, action: str, ip: str) -> Entry | None:
        """The entry that decides (Custom's, else Default's), or None when none matches."""
        for ptype in (CUSTOM, DEFAULT):
            found = [e for e in self.policies.get(ptype, ()) if e.matches(kind, name, action, ip)]
            if found:
                return min(found, key=lambda e: (e.resource.rank(), e.decision != DENY))
        return None


def subject_of(text: Any) -> str:
    s = str(text or "").strip()
    kind, sep, name = s.partition(":")
    if not sep or kind.lower() != "user" or not name:
        raise AuthError(f"subject {s!r} is not User:<username>")
    return "User:" + name


def parse_policies(body: Mapping[str, Any]) -> dict[str, list[Entry]]:
    """An AclInfo's policies; raises AuthError."""
    out: dict[str, list[Entry]] = {}
    for p in body.get("policies") or []:
        if not isinstance(p, Mapping):
            raise AuthError("a policy is not an object")
        ptype = _canon(p.get("policyType"), (CUSTOM, DEFAULT), "policy type", CUSTOM)
        out.setdefault(ptype, []).extend(Entry.from_json(e) for e in p.get("entries") or [])
    if not any(out.values()):
        raise AuthError("The body of acl has no policy entry")
    return out


def merge(old: Acl, policies: Mapping[str, list[Entry]]) -> None:
    """RocketMQ's updateAcl: an entry for a resource already in the policy replaces it; others are added."""
    for ptype, entries in policies.items():
        have = old.policies.setdefault(ptype, [])
        for e in entries:
            for i, h in enumerate(have):
                if h.resource == e.resource:
                    have[i] = e
                    break
            else:
                have.append(e)


class AuthStore:
    """Users and ACLs, kept in one JSON file (read at start, rewritten on every change by ``write``: the
    broker's atomic write, temp + fsync + rename)."""

    def __init__(self, path: str | Path, write: Callable[[Path, bytes], None]) -> None:
        self.path = Path(path)
        self._write = write
        self.users: dict[str, User] = {}
        self.acls: dict[str, Acl] = {}
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        try:
            doc = json.loads(self.path.read_bytes())
            for u in doc.get("users") or []:
                self.users[u["username"]] = User(u["username"], u["password"], u.get("userType", NORMAL),
                                                 u.get("userStatus", ENABLE))
            for a in doc.get("acls") or []:
                self.acls[a["subject"]] = Acl(a["subject"], parse_policies(a))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise AuthError(f"the users and ACLs file {self.path} cannot be used: {e}") from None

    def save(self) -> None:
        doc = {"users": [u.to_json() for u in self.users.values()],
               "acls": [a.to_json() for a in self.acls.values()]}
        self._write(self.path, json.dumps(doc, indent=1).encode("utf-8"))
        try:
            self.path.chmod(0o600)  # it holds passwords
        except OSError:
            pass

    # --- users (RocketMQ's AuthenticationMetadataManagerImpl) ------------------------------------------
    def create_user(self, info: Mapping[str, Any]) -> User:
        name = str(info.get("username") or "").strip()
        if not name:
            raise AuthError("username can not be blank")
        if not info.get("password"):
            raise AuthError("password can not be blank")
        if name in self.users:
            raise AuthError("The user is existed")
        user = User(name, str(info["password"]), _canon(info.get("userType"), (SUPER, NORMAL), "user type",
                                                        NORMAL),
                    _canon(info.get("userStatus"), (ENABLE, DISABLE), "user status", ENABLE))
        self.users[name] = user
        self.save()
        return user

    def update_user(self, info: Mapping[str, Any]) -> User:
        name = str(info.get("username") or "").strip()
        old = self.users.get(name)
        if old is None:
            raise AuthError("The user is not exist")
        if info.get("password"):
            old.password = str(info["password"])
        if info.get("userType"):
            old.user_type = _canon(info["userType"], (SUPER, NORMAL), "user type")
        if info.get("userStatus"):
            old.status = _canon(info["userStatus"], (ENABLE, DISABLE), "user status")
        self.save()
        return old

    def delete_user(self, name: str) -> None:
        """The user and its ACL (as RocketMQ deletes both)."""
        if self.users.pop(name, None) is not None or self.acls.pop("User:" + name, None) is not None:
            self.acls.pop("User:" + name, None)
            self.save()

    def list_users(self, flt: str | None) -> list[User]:
        return [u for n, u in sorted(self.users.items()) if not flt or flt in n]

    # --- ACLs (RocketMQ's AuthorizationMetadataManagerImpl) --------------------------------------------
    def _check_subject(self, subject: str) -> str:
        s = subject_of(subject)
        if s[5:] not in self.users:
            raise AuthError(f"The subject of {s} is not exist")
        return s

    def create_acl(self, subject: str, policies: dict[str, list[Entry]]) -> None:
        s = self._check_subject(subject)
        old = self.acls.get(s)
        if old is None:
            self.acls[s] = Acl(s, policies)
        else:
            merge(old, policies)  # RocketMQ's createAcl on an existing subject updates it
        self.save()

    def update_acl(self, subject: str, policies: dict[str, list[Entry]]) -> None:
        s = self._check_subject(subject)
        old = self.acls.get(s)
        if old is None:
            raise AuthError(f"The acl of {s} is not exist")
        merge(old, policies)
        self.save()

    def delete_acl(self, subject: str, policy_type: str | None, resource: str | None) -> None:
        """The whole ACL, or (with ``resource``) that resource's entries of the policy type (Custom)."""
        s = subject_of(subject)
        acl = self.acls.get(s)
        if acl is None:
            return
        if not resource:
            del self.acls[s]
        else:
            res = Resource.parse(resource)
            ptype = _canon(policy_type, (CUSTOM, DEFAULT), "policy type", CUSTOM)
            acl.policies[ptype] = [e for e in acl.policies.get(ptype, []) if e.resource != res]
            if not any(acl.policies.values()):
                del self.acls[s]
        self.save()

    def list_acls(self, subject_filter: str | None, resource_filter: str | None) -> list[Acl]:
        out = []
        for s, acl in sorted(self.acls.items()):
            if subject_filter and subject_filter not in s:
                continue
            if resource_filter and not any(resource_filter in e.resource.key
                                           for es in acl.policies.values() for e in es):
                continue
            out.append(acl)
        return out
