"""``chronomq admin user ...`` and ``chronomq admin acl ...``: ACL 2.0 users and ACLs on the broker(s)
(RocketMQ 5.3's codes 3001-3010, as mqadmin createUser/createAcl/...), through ``chronomq.client.Admin``::

    chronomq admin user create|update -u NAME [-p PASSWORD] [--type Super|Normal] [--status enable|disable]
    chronomq admin user delete|get -u NAME;  chronomq admin user list [--filter TEXT]
    chronomq admin acl create|update -s User:NAME -r RESOURCE[,..] -a ACTION[,..] [-i IP/CIDR,..]
                                     [-d Allow|Deny]
    chronomq admin acl delete -s User:NAME [-r RESOURCE];  acl get -s User:NAME;  acl list [-s TEXT] [-r TEXT]

A password is read from -p or CHRONOMQ_USER_PASSWORD (which keeps it out of the process list); get and
list never print one (the broker answers it, as RocketMQ's does).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from .admin_session import open_admin, targets
from .output import AdminError, table


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def _no_password(user: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in user.items() if k != "password"}


def _password(args: argparse.Namespace, needed: bool) -> str | None:
    pw = args.password or os.environ.get("CHRONOMQ_USER_PASSWORD")
    if needed and not pw:
        raise AdminError("a user needs a password: -p or CHRONOMQ_USER_PASSWORD")
    return pw or None


def _acl_rows(acls: list[dict[str, Any]]) -> str:
    rows = [[a.get("subject", ""), p.get("policyType", ""), e.get("resource", ""),
             ",".join(e.get("actions") or []), ",".join(e.get("sourceIps") or []) or "*",
             e.get("decision", "")]
            for a in acls for p in a.get("policies") or [] for e in p.get("entries") or []]
    return table(rows, ["subject", "policy", "resource", "actions", "source ips", "decision"])


def run_auth_verb(args: argparse.Namespace) -> int:
    """Run ``user``/``acl`` on every master broker (or -b); the answers print once per broker."""
    kind, op = args.verb, args.op
    with open_admin(args) as admin:
        for name, addr in targets(admin, args):
            if kind == "user":
                if op == "create":
                    admin.create_user(addr, args.username, _password(args, True), args.type or "Normal")
                elif op == "update":
                    admin.update_user(addr, args.username, _password(args, False), args.type, args.status)
                elif op == "delete":
                    admin.delete_user(addr, args.username)
                elif op == "get":
                    user = admin.get_user(addr, args.username)
                    if user is None:
                        raise AdminError(f"no user {args.username!r} on {name}")
                    print(json.dumps(_no_password(user)))
                    continue
                else:
                    users = admin.list_users(addr, args.filter)
                    print(table([[u.get("username", ""), u.get("userType", ""), u.get("userStatus", "")]
                                 for u in users], ["username", "type", "status"]))
                    continue
                print(f"user {args.username} {op}d on {name}")
            else:
                if op in ("create", "update"):
                    admin.create_acl(addr, args.subject, _split(args.resources), _split(args.actions),
                                     _split(args.source_ips), args.decision, update=op == "update")
                elif op == "delete":
                    admin.delete_acl(addr, args.subject, args.resources or None)
                elif op == "get":
                    acl = admin.get_acl(addr, args.subject)
                    if acl is None:
                        raise AdminError(f"no ACL for {args.subject!r} on {name}")
                    print(_acl_rows([acl]))
                    continue
                else:
                    print(_acl_rows(admin.list_acls(addr, args.subject, args.resources)))
                    continue
                print(f"ACL of {args.subject} {op}d on {name}")
    return 0


def add_auth_parsers(sub: Any, common: Callable[..., None]) -> None:
    sp = sub.add_parser("user", help="ACL 2.0 users (create, update, delete, get, list)")
    common(sp)
    sp.add_argument("op", choices=["create", "update", "delete", "get", "list"])
    sp.add_argument("-u", "--username", default="")
    sp.add_argument("-p", "--password", help="the user's password (better: CHRONOMQ_USER_PASSWORD)")
    sp.add_argument("--type", choices=["Super", "Normal"])
    sp.add_argument("--status", choices=["enable", "disable"])
    sp.add_argument("--filter", help="list: usernames holding this text")
    sp = sub.add_parser("acl", help="ACL 2.0 ACLs (create, update, delete, get, list)")
    common(sp)
    sp.add_argument("op", choices=["create", "update", "delete", "get", "list"])
    sp.add_argument("-s", "--subject", default="", help="User:NAME (list: a filter)")
    sp.add_argument("-r", "--resources", help="Topic:NAME, Topic:PREFIX*, Group:NAME, Topic:*, *; comma list "
                    "(delete: the one resource; list: a filter)")
    sp.add_argument("-a", "--actions", default="", help="Pub,Sub,Create,Update,Delete,Get,List,All")
    sp.add_argument("-i", "--source-ips", help="addresses or CIDRs the entry is limited to")
    sp.add_argument("-d", "--decision", choices=["Allow", "Deny"], default="Allow")
