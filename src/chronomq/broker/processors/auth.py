"""RocketMQ 5.3's user and ACL admin codes (AUTH_CREATE_USER 3001 .. AUTH_LIST_ACL 3010, as its
AdminBrokerProcessor serves them): users as UserInfo JSON {username, password, userType, userStatus},
ACLs as AclInfo JSON {subject, policies: [{policyType, entries: [{resource, actions, sourceIps,
decision}]}]}, kept by acl/auth2.AuthStore (opened at the first request, or at start when ACL 2.0 is on).

Rules: a refusal is NO_PERMISSION with the reason as remark; only a Super user (or a request without an
AccessKey, as RocketMQ decides) may create, update or delete a Super user; GET/LIST user return the
password, as RocketMQ does (mqadmin copyUser needs it), and nothing here logs one.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from chronomq.remoting.codec import RemotingCommand
from chronomq.remoting.codes import RequestCode, ResponseCode
from chronomq.remoting.signing import ACCESS_KEY
from chronomq.store.atomicfile import write_atomic

from .base import Handler, ProcessorBase, RequestConnection

if TYPE_CHECKING:
    from chronomq.acl.auth2 import AuthStore

    from ..services import BrokerServices

log = logging.getLogger("chronomq.acl")


def _a() -> Any:
    """acl/auth2, loaded at the first request (the accounts' code loads only when it is used)."""
    import chronomq.acl.auth2 as auth2

    return auth2


class AuthProcessor(ProcessorBase):
    """Users and ACLs (ACL 2.0)."""

    def __init__(self, services: BrokerServices) -> None:
        super().__init__(services)
        self._store: AuthStore | None = None

    @property
    def auth_store(self) -> AuthStore:
        if self._store is None:
            self._store = _a().AuthStore(self.config.auth_path, write_atomic)
        return self._store

    def handlers(self) -> dict[int, Handler]:
        return {RequestCode.AUTH_CREATE_USER: self._wrap(self.create_user),
                RequestCode.AUTH_UPDATE_USER: self._wrap(self.update_user),
                RequestCode.AUTH_DELETE_USER: self._wrap(self.delete_user),
                RequestCode.AUTH_GET_USER: self._wrap(self.get_user),
                RequestCode.AUTH_LIST_USER: self._wrap(self.list_user),
                RequestCode.AUTH_CREATE_ACL: self._wrap(self.create_acl),
                RequestCode.AUTH_UPDATE_ACL: self._wrap(self.update_acl),
                RequestCode.AUTH_DELETE_ACL: self._wrap(self.delete_acl),
                RequestCode.AUTH_GET_ACL: self._wrap(self.get_acl),
                RequestCode.AUTH_LIST_ACL: self._wrap(self.list_acl)}

    def _wrap(self, fn: Any) -> Handler:
        def handle(req: RemotingCommand, conn: RequestConnection) -> RemotingCommand:
            try:
                body = fn(req)
            except _a().AuthError as e:
                log.warning("ACL: request code %s from %s (AccessKey %s) not done: %s", req.code,
                            conn.remote_addr, req.ext_fields.get(ACCESS_KEY) or "-", e)
                return req.response(ResponseCode.NO_PERMISSION, remark=str(e))
            return req.response(ResponseCode.SUCCESS, body=b"" if body is None else
                                json.dumps(body).encode("utf-8"))
        return handle

    def _not_super(self, req: RemotingCommand) -> bool:
        ak = req.ext_fields.get(ACCESS_KEY)
        if not ak:
            return False
        user = self.auth_store.users.get(str(ak))
        return user is None or user.user_type != _a().SUPER

    def _user_info(self, req: RemotingCommand, create: bool) -> dict[str, Any]:
        name = str(req.ext_fields.get("username") or "").strip()
        if not name:
            raise _a().AuthError("The username is blank")
        info = _body(req)
        info["username"] = name
        verb = "create" if create else "update"
        if str(info.get("userType") or "").lower() == "super" and self._not_super(req):
            raise _a().AuthError(f"The super user can only be {verb} by super user")
        old = self.auth_store.users.get(name)
        if not create and old is not None and old.user_type == _a().SUPER and self._not_super(req):
            raise _a().AuthError("The super user can only be update by super user")
        return info

    def create_user(self, req: RemotingCommand) -> None:
        self.auth_store.create_user(self._user_info(req, True))

    def update_user(self, req: RemotingCommand) -> None:
        self.auth_store.update_user(self._user_info(req, False))

    def delete_user(self, req: RemotingCommand) -> None:
        name = str(req.ext_fields.get("username") or "")
        user = self.auth_store.users.get(name)
        if user is not None and user.user_type == _a().SUPER and self._not_super(req):
            raise _a().AuthError("The super user can only be update by super user")
        self.auth_store.delete_user(name)

    def get_user(self, req: RemotingCommand) -> Any:
        name = str(req.ext_fields.get("username") or "").strip()
        if not name:
            raise _a().AuthError("The username is blank")
        user = self.auth_store.users.get(name)
        return None if user is None else user.to_json()

    def list_user(self, req: RemotingCommand) -> Any:
        users = self.auth_store.list_users(req.ext_fields.get("filter"))
        return [u.to_json() for u in users] or None

    def create_acl(self, req: RemotingCommand) -> None:
        body = _body(req)
        self.auth_store.create_acl(str(body.get("subject") or req.ext_fields.get("subject") or ""),
                              _a().parse_policies(body))

    def update_acl(self, req: RemotingCommand) -> None:
        body = _body(req)
        self.auth_store.update_acl(str(body.get("subject") or req.ext_fields.get("subject") or ""),
                              _a().parse_policies(body))

    def delete_acl(self, req: RemotingCommand) -> None:
        g = req.ext_fields.get
        self.auth_store.delete_acl(str(g("subject") or ""), g("policyType"), g("resource"))

    def get_acl(self, req: RemotingCommand) -> Any:
        acl = self.auth_store.acls.get(_a().subject_of(req.ext_fields.get("subject")))
        return None if acl is None else acl.to_json()

    def list_acl(self, req: RemotingCommand) -> Any:
        g = req.ext_fields.get
        acls = self.auth_store.list_acls(g("subjectFilter"), g("resourceFilter"))
        return [a.to_json() for a in acls] or None


def _body(req: RemotingCommand) -> dict[str, Any]:
    try:
        doc = json.loads(req.body or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise _a().AuthError(f"the body is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise _a().AuthError("the body is not a JSON object")
    return doc
