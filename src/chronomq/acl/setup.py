"""ACL 2.0 at a broker's start: the first Super users from ``initAuthenticationUser`` and
``innerClientAuthenticationCredentials`` (created when absent, as RocketMQ's initUser), and the validator
the broker asks, chained after ACL 1.0's when ``aclEnable`` is on too."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .auth2 import SUPER, AuthError, AuthStore
from .plain import AclConfigError
from .validator import Checker
from .validator2 import Acl2Validator, ChainValidator


def init_users(config: Any, store: AuthStore) -> None:
    """Raises AclConfigError naming the key."""
    for key, user_key, pass_key in (("initAuthenticationUser", "username", "password"),
                                    ("innerClientAuthenticationCredentials", "accessKey", "secretKey")):
        text = getattr(config, key)
        if not text.strip():
            continue
        try:
            doc = json.loads(text)
            name, password = str(doc[user_key]), str(doc[pass_key])
        except (ValueError, KeyError, TypeError):
            raise AclConfigError(f"{key}: expected JSON with {user_key!r} and {pass_key!r}") from None
        if name not in store.users:
            try:
                store.create_user({"username": name, "password": password, "userType": SUPER})
            except AuthError as e:
                raise AclConfigError(f"{key}: {e}") from None


def acl2_validator(config: Any, store: AuthStore, now_ms: Callable[[], int],
                   acl1: Checker | None) -> Any:
    init_users(config, store)
    v2 = Acl2Validator(store, now_ms, authentication=config.authenticationEnabled,
                       authorization=config.authorizationEnabled, cluster=config.brokerClusterName)
    return v2 if acl1 is None else ChainValidator([acl1, v2])
